"""CUDA C of the fused (flash-style) attention kernel, shared by the per-node kernel
(flash_attention.py) and the compiled plans' step (plan/flash_step.py).

One block of 128 threads computes BM = 32 query rows of one (batch, query head) against every key:
the Q tile (pre-scaled) stays in shared memory, K and V tiles of BN keys pass through one shared
buffer in turn, and the softmax is online (running max and sum per row, float32), so no
Sq x Skv matrix is ever written to global memory. Each thread owns 4 rows x BN/16 keys of a score
tile and the same 4 rows x D/16 columns of the output accumulator; a row's 16 threads are one
half-warp, so row reductions are 4 shuffles. Inputs of every dtype are widened to float32 on their
way into shared memory; the output is rounded once at the end.

`fa_tile<T, D, BN>(...)` is the whole kernel body (a __device__ template, inlined): the per-node
library instantiates it per head size with run-time sizes, a plan instantiates it with literals.
The body is guarded so that a plan module holding several attention steps defines it once.
"""

from __future__ import annotations

__all__ = ["BLOCK_Q", "BODY", "HEAD_SIZES", "THREADS", "TYPES", "key_block", "library_source"]

HEAD_SIZES = (32, 64, 80, 96, 128)
BLOCK_Q = 32  # query rows per block
THREADS = 128
# C element type per dtype name.
TYPES = {"float32": "float", "float16": "fa_f16", "bfloat16": "fa_bf16"}


def key_block(head: int) -> int:
    """Keys per tile: 64 up to head size 64, 32 above (the static shared memory stays < 48 KiB)."""
    return 64 if head <= 64 else 32


BODY = r"""
#ifndef EPHOST_FLASH_BODY
#define EPHOST_FLASH_BODY
typedef long long fa_i64;
struct fa_f16 { unsigned short b; };
struct fa_bf16 { unsigned short b; };
#define FA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float fa_to_f(float v) { return v; }
__device__ __forceinline__ float fa_to_f(fa_f16 h) {
  float f; asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h.b)); return f;
}
__device__ __forceinline__ float fa_to_f(fa_bf16 h) { return __uint_as_float((unsigned)h.b << 16); }
__device__ __forceinline__ void fa_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void fa_put(fa_f16* p, float v) {
  unsigned short h; asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v)); p->b = h;
}
__device__ __forceinline__ void fa_put(fa_bf16* p, float v) {
  const unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) p->b = (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
  else p->b = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}

// The mask term of key j for one query row: 0 to keep the logit, -inf to drop it, or the additive
// value. kind: 1 bool, 2 float32, 3 float16, 4 bfloat16; `row` points at the row's first key.
__device__ __forceinline__ float fa_mask(const void* row, int kind, int j) {
  if (kind == 1) return ((const unsigned char*)row)[j] ? 0.0f : FA_NEG_INF;
  if (kind == 2) return ((const float*)row)[j];
  if (kind == 3) return fa_to_f(((const fa_f16*)row)[j]);
  return fa_to_f(((const fa_bf16*)row)[j]);
}

// Copy rows [r0, r0 + ROWS) of a (rows, D) slab with row stride `ld` (elements) into shared memory as
// float32 times `mul` (rows past `n`: zeros, which the masks never read as keys).
template <typename T, int D, int ROWS>
__device__ __forceinline__ void fa_load(float* dst, const T* __restrict__ src, fa_i64 ld, int r0, int n, float mul) {
  constexpr int LD = D + 4;
  if constexpr (sizeof(T) == 4) {
    if ((((unsigned long long)src) & 15) == 0 && (ld & 3) == 0) {  // float32 rows in 16-byte pieces
      constexpr int W = D / 4;
      for (int e = threadIdx.x; e < ROWS * W; e += 128) {
        const int r = e / W, w = e - r * W;
        float4 x = {0.0f, 0.0f, 0.0f, 0.0f};
        if (r0 + r < n) x = *(const float4*)((const float*)src + (fa_i64)(r0 + r) * ld + 4 * w);
        x.x *= mul; x.y *= mul; x.z *= mul; x.w *= mul;
        *(float4*)&dst[r * LD + 4 * w] = x;
      }
      return;
    }
  }
  for (int e = threadIdx.x; e < ROWS * D; e += 128) {
    const int r = e / D, d = e - r * D;
    dst[r * LD + d] = r0 + r < n ? fa_to_f(src[(fa_i64)(r0 + r) * ld + d]) * mul : 0.0f;
  }
}

template <typename T, int D, int BN>
__device__ __forceinline__ void fa_tile(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const void* __restrict__ mask,
    T* __restrict__ y, fa_i64 qb, fa_i64 qh, fa_i64 qs, fa_i64 kb, fa_i64 kh, fa_i64 ks, fa_i64 yb, fa_i64 yh,
    fa_i64 ys, fa_i64 mb, fa_i64 mh, fa_i64 mi, int mask_kind, int mask_len, int group, int sq, int skv,
    int causal, float scale, float softcap) {
  constexpr int BM = 32, RM = 4, CN = BN / 16, DN = D / 16, LD = D + 4, LP = BN + 4;
  __shared__ __align__(16) float qt[BM * LD];
  __shared__ __align__(16) float kv[BN * LD];
  __shared__ __align__(16) float pt[BM * LP];
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;  // ty: rows ty*4 .. ty*4+3 of the tile
  const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, hk = h / group;
  k += b * kb + hk * kh;
  v += b * kb + hk * kh;
  fa_load<T, D, BM>(qt, q + b * qb + h * qh, qs, q0, sq, scale);
  int kv_end = skv;
  if (causal) kv_end = min(kv_end, q0 + BM);  // later keys are masked for every row of the tile
  if (mask_kind) kv_end = min(kv_end, mask_len);  // keys past the mask are masked (padding)
  float m[RM], l[RM], o[RM][DN];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    m[r] = FA_NEG_INF; l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < DN; ++c) o[r][c] = 0.0f;
  }
  for (int k0 = 0; k0 < kv_end; k0 += BN) {
    __syncthreads();  // the previous V tile is read (and, the first time, the Q tile written)
    fa_load<T, D, BN>(kv, k, ks, k0, skv, 1.0f);
    __syncthreads();
    float s[RM][CN];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int c = 0; c < CN; ++c) s[r][c] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
      float4 a[RM], w[CN];
#pragma unroll
      for (int r = 0; r < RM; ++r) a[r] = *(const float4*)&qt[(ty * RM + r) * LD + d];
#pragma unroll
      for (int c = 0; c < CN; ++c) w[c] = *(const float4*)&kv[(tx + 16 * c) * LD + d];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < CN; ++c)
          s[r][c] += a[r].x * w[c].x + a[r].y * w[c].y + a[r].z * w[c].z + a[r].w * w[c].w;
    }
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      const int i = q0 + ty * RM + r;
      const void* mrow = 0;
      if (mask_kind) {
        const fa_i64 at = b * mb + h * mh + (fa_i64)min(i, sq - 1) * mi;
        mrow = mask_kind == 1 ? (const void*)((const unsigned char*)mask + at)
             : mask_kind == 2 ? (const void*)((const float*)mask + at) : (const void*)((const unsigned short*)mask + at);
      }
      float mx = FA_NEG_INF;
#pragma unroll
      for (int c = 0; c < CN; ++c) {
        const int j = k0 + tx + 16 * c;
        float x = s[r][c];
        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
        const bool allowed = j < kv_end && (!causal || j <= i);
        if (allowed && mask_kind) x += fa_mask(mrow, mask_kind, j);
        s[r][c] = allowed ? x : FA_NEG_INF;
        mx = fmaxf(mx, s[r][c]);
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float mnew = fmaxf(m[r], mx);
      const float base = mnew == FA_NEG_INF ? 0.0f : mnew;  // nothing kept yet: exp(-inf) = 0, no NaN
      const float corr = expf(m[r] - base);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < CN; ++c) {
        const float p = expf(s[r][c] - base);
        sum += p;
        pt[(ty * RM + r) * LP + tx + 16 * c] = p;
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l[r] = l[r] * corr + sum;
      m[r] = mnew;
#pragma unroll
      for (int c = 0; c < DN; ++c) o[r][c] *= corr;
    }
    __syncthreads();  // every score of the K tile is computed: the buffer takes the V tile
    fa_load<T, D, BN>(kv, v, ks, k0, skv, 1.0f);
    __syncthreads();
#pragma unroll 2
    for (int j = 0; j < BN; j += 4) {
      float4 p[RM];
#pragma unroll
      for (int r = 0; r < RM; ++r) p[r] = *(const float4*)&pt[(ty * RM + r) * LP + j];
#pragma unroll
      for (int c = 0; c < DN; ++c) {
        const float* vc = &kv[j * LD + tx + 16 * c];
        const float v0 = vc[0], v1 = vc[LD], v2 = vc[2 * LD], v3 = vc[3 * LD];
#pragma unroll
        for (int r = 0; r < RM; ++r) o[r][c] += p[r].x * v0 + p[r].y * v1 + p[r].z * v2 + p[r].w * v3;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const int i = q0 + ty * RM + r;
    if (i >= sq) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // no key kept: zeros, as the ONNX reference
    T* yr = y + b * yb + h * yh + (fa_i64)i * ys;
#pragma unroll
    for (int c = 0; c < DN; ++c) fa_put(yr + tx + 16 * c, o[r][c] * inv);
  }
}
// One warp's score tiles in the m16n8 accumulator layout (NT tiles of 8 keys; the thread holds rows
// rows[0] = g and rows[1] = g + 8 of the warp's 16, keys k0 + n * 8 + 2 t + {0, 1}): logits (scale,
// softcap, causal, mask), the online-softmax update of the running max m and sum l, the rescale of
// the output tiles o; s is left holding the probabilities. A row's 4 threads are one quad.
template <int NT, int DT>
__device__ __forceinline__ void fa_quad_softmax(float (&s)[NT][4], float (&o)[DT][4], float (&m)[2], float (&l)[2],
                                                const int (&rows)[2], const void* const (&mrow)[2], int k0, int t,
                                                int kv_end, int causal, int mask_kind, float scale, float softcap) {
  float mx[2] = {FA_NEG_INF, FA_NEG_INF};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = x >> 1, j = k0 + n * 8 + 2 * t + (x & 1);
      float val = s[n][x] * scale;
      if (softcap > 0.0f) val = softcap * tanhf(val / softcap);
      const bool allowed = j < kv_end && (!causal || j <= rows[r]);
      if (allowed && mask_kind) val += fa_mask(mrow[r], mask_kind, j);
      s[n][x] = allowed ? val : FA_NEG_INF;
      mx[r] = fmaxf(mx[r], s[n][x]);
    }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mnew = fmaxf(m[r], mx[r]);
    base[r] = mnew == FA_NEG_INF ? 0.0f : mnew;  // nothing kept yet: exp(-inf) = 0, no NaN
    const float corr = expf(m[r] - base[r]);
    l[r] *= corr;
    m[r] = mnew;
#pragma unroll
    for (int c = 0; c < DT; ++c) { o[c][2 * r] *= corr; o[c][2 * r + 1] *= corr; }
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      s[n][x] = expf(s[n][x] - base[x >> 1]);
      sum[x >> 1] += s[n][x];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    l[r] += sum[r];
  }
}

// The first key of each of the thread's two rows in the mask (kind 1 bool, 2 float32, else 16-bit).
__device__ __forceinline__ void fa_mask_rows(const void* (&mrow)[2], const void* mask, int mask_kind,
                                             fa_i64 at, fa_i64 mi, const int (&rows)[2], int sq) {
  const int bytes = mask_kind == 1 ? 1 : mask_kind == 2 ? 4 : 2;
#pragma unroll
  for (int x = 0; x < 2; ++x)
    mrow[x] = mask_kind ? (const char*)mask + (at + (fa_i64)min(rows[x], sq - 1) * mi) * bytes : (const char*)0;
}
#endif
"""

# The per-node library's kernels: sizes, strides and the mask as run-time arguments.
_ENTRY = r"""
extern "C" __global__ void __launch_bounds__(128) ephost_flash_d{d}(
    const T* q, const T* k, const T* v, const void* mask, T* y, fa_i64 qb, fa_i64 qh, fa_i64 qs, fa_i64 kb,
    fa_i64 kh, fa_i64 ks, fa_i64 yb, fa_i64 yh, fa_i64 ys, fa_i64 mb, fa_i64 mh, fa_i64 mi, int mask_kind,
    int mask_len, int group, int sq, int skv, int causal, float scale, float softcap) {{
  fa_tile<T, {d}, {bn}>(q, k, v, mask, y, qb, qh, qs, kb, kh, ks, yb, yh, ys, mb, mh, mi, mask_kind, mask_len,
                       group, sq, skv, causal, scale, softcap);
}}
"""


_ENTRY_MMA = r"""
extern "C" __global__ void __launch_bounds__(128) ephost_flash_mma_d{d}(
    const T* q, const T* k, const T* v, const void* mask, T* y, fa_i64 qb, fa_i64 qh, fa_i64 qs, fa_i64 kb,
    fa_i64 kh, fa_i64 ks, fa_i64 yb, fa_i64 yh, fa_i64 ys, fa_i64 mb, fa_i64 mh, fa_i64 mi, int mask_kind,
    int mask_len, int group, int sq, int skv, int causal, float scale, float softcap) {{
  fa_tile_mma<T, {d}>(q, k, v, mask, y, qb, qh, qs, kb, kh, ks, yb, yh, ys, mb, mh, mi, mask_kind, mask_len,
                     group, sq, skv, causal, scale, softcap);
}}
"""


_ENTRY_TF32 = r"""
extern "C" __global__ void __launch_bounds__(128) ephost_flash_tf32_d{d}(
    const float* q, const float* k, const float* v, const void* mask, float* y, fa_i64 qb, fa_i64 qh, fa_i64 qs,
    fa_i64 kb, fa_i64 kh, fa_i64 ks, fa_i64 yb, fa_i64 yh, fa_i64 ys, fa_i64 mb, fa_i64 mh, fa_i64 mi,
    int mask_kind, int mask_len, int group, int sq, int skv, int causal, float scale, float softcap) {{
  fa_tile_tf32<{d}, {bn}>(q, k, v, mask, y, qb, qh, qs, kb, kh, ks, yb, yh, ys, mb, mh, mi, mask_kind, mask_len,
                         group, sq, skv, causal, scale, softcap);
}}
"""


def library_source(dtype_name: str, host_mma: str = "", kernels: tuple = ("simt", "tensor")) -> str:
    """The per-node module for one element type: `kernels` "simt" gives one kernel `ephost_flash_d<D>`
    per head size; "tensor" the tensor-core ones, from sm_80 on: `ephost_flash_mma_d<D>` for the half
    types (flash_mma_source.py), `ephost_flash_tf32_d<D>` for float32 (flash_tf32_source.py).
    `host_mma`: C code put before the tensor-core bodies (the CPU test shim's MMAs)."""
    from .flash_mma_source import BODY_MMA
    from .flash_tf32_source import BODY_TF32

    ctype = TYPES.get(dtype_name)
    if ctype is None:
        raise ValueError(f"flash attention got dtype {dtype_name}; allowed: {', '.join(TYPES)}")
    entries = "".join(_ENTRY.format(d=d, bn=key_block(d)) for d in HEAD_SIZES) if "simt" in kernels else ""
    if "tensor" in kernels:
        entry = _ENTRY_MMA if dtype_name != "float32" else _ENTRY_TF32
        tensor = "".join(entry.format(d=d, bn=key_block(d)) for d in HEAD_SIZES)
        entries += f"#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800\n{tensor}#endif\n"
    return f"{BODY}\n{host_mma}\n{BODY_MMA}\n{BODY_TF32}\ntypedef {ctype} T;\n{entries}"
