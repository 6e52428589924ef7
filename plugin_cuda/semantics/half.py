"""float16 and bfloat16 in CUDA C without CUDA headers: raw 16-bit storage types and their float32
conversions (round to nearest even), shared by the fused per-node kernels (kernels/fused.py,
kernels/attention.py) and the compiled plans' generated kernels (plan/codegen.py).

Storage types: `half_bits` (float16 bits, converted with PTX `cvt`) and `bf16_bits` (the high 16
bits of a float32; a struct, so that its overloads differ from float16's). `to_f(x)` reads any of
float, half_bits, bf16_bits as a float; `put(p, i, v)` stores float `v` at p[i] in p's type.
No header is needed, so NVRTC compiles the source without include paths."""

from __future__ import annotations

__all__ = ["HALF_CUDA"]

HALF_CUDA = r"""
typedef long long i64;
typedef unsigned short half_bits;
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(half_bits h) {
  float f; asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ void put(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void put(half_bits* p, i64 i, float v) {
  half_bits h; asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v)); p[i] = h;
}
struct bf16_bits { unsigned short bits; };
__device__ __forceinline__ float to_f(bf16_bits h) { return __uint_as_float((unsigned)h.bits << 16); }
__device__ __forceinline__ void put(bf16_bits* p, i64 i, float v) {
  const unsigned u = __float_as_uint(v);
  bf16_bits h;
  if ((u & 0x7fffffffu) > 0x7f800000u) h.bits = (unsigned short)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  else h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
  p[i] = h;
}
"""
