"""CUDA C of the float32 flash attention kernel on TF32 tensor cores (mma.sync m16n8k8, float32
accumulation): what float32 Attention runs with option use_tf32=1 (the plugin's default, as for its
GEMMs); use_tf32=0 keeps the exact-float32 SIMT kernel (flash_source.py).

The layout follows the half kernel (flash_mma_source.py): 4 warps x 16 query rows, Q as A fragments
in registers (read once from global memory), K and V tiles (64 keys up to head size 64, else 32)
through one shared buffer, online softmax in float32 on the accumulators. The m16n8k8 accumulator
layout is not the next MMA's A layout, so each warp passes its P tile through its own rows of a
shared buffer. Operands are rounded to TF32 (cvt.rna) as they enter the MMA.

Without `__CUDA_ARCH__` (the CPU test shim) the MMA is the shim's `fa_mma_tf32_host`.
"""

from __future__ import annotations

__all__ = ["BLOCK_Q_TF32", "BODY_TF32"]

BLOCK_Q_TF32 = 64

BODY_TF32 = r"""
#if !defined(EPHOST_FLASH_TF32_BODY) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#define EPHOST_FLASH_TF32_BODY
#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned fa_tf32(float x) {
  unsigned u; asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(u) : "f"(x)); return u;
}
__device__ __forceinline__ void fa_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
__device__ __forceinline__ unsigned fa_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ void fa_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  fa_mma_tf32_host(c, a, b0, b1);
}
#endif

template <int D, int BN>
__device__ __forceinline__ void fa_tile_tf32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const void* __restrict__ mask, float* __restrict__ y, fa_i64 qb, fa_i64 qh, fa_i64 qs, fa_i64 kb, fa_i64 kh,
    fa_i64 ks, fa_i64 yb, fa_i64 yh, fa_i64 ys, fa_i64 mb, fa_i64 mh, fa_i64 mi, int mask_kind, int mask_len,
    int group, int sq, int skv, int causal, float scale, float softcap) {
  constexpr int BM = 64, LD = D + 4, LP = BN + 4, KC = D / 8, NT = BN / 8, DT = D / 8;
  __shared__ __align__(16) float kv[BN * LD];
  __shared__ __align__(16) float pt[BM * LP];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, hk = h / group;
  k += b * kb + hk * kh;
  v += b * kb + hk * kh;
  const int wr = warp * 16;
  const int rows[2] = {q0 + wr + g, q0 + wr + g + 8};
  unsigned qa[KC][4];  // this warp's 16 rows of Q as A fragments: (row g | g + 8, column t | t + 4)
  {
    const float* qr = q + b * qb + h * qh;
#pragma unroll
    for (int c = 0; c < KC; ++c)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int i = rows[x & 1], d = c * 8 + t + 4 * (x >> 1);
        qa[c][x] = fa_tf32(i < sq ? qr[(fa_i64)i * qs + d] : 0.0f);
      }
  }
  int kv_end = skv;
  if (causal) kv_end = min(kv_end, q0 + BM);
  if (mask_kind) kv_end = min(kv_end, mask_len);
  const void* mrow[2];
  fa_mask_rows(mrow, mask, mask_kind, b * mb + h * mh, mi, rows, sq);
  float* pw = pt + wr * LP;  // this warp's 16 rows of P
  float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int c = 0; c < DT; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
  for (int k0 = 0; k0 < kv_end; k0 += BN) {
    __syncthreads();  // the previous V tile and P rows are read
    fa_load<float, D, BN>(kv, k, ks, k0, skv, 1.0f);
    __syncthreads();
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const float* kr = &kv[(n * 8 + g) * LD + c * 8 + t];
        fa_mma_tf32(s[n], qa[c], fa_tf32(kr[0]), fa_tf32(kr[4]));
      }
    }
    fa_quad_softmax<NT, DT>(s, o, m, l, rows, mrow, k0, t, kv_end, causal, mask_kind, scale, softcap);
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int x = 0; x < 4; ++x) pw[(g + 8 * (x >> 1)) * LP + n * 8 + 2 * t + (x & 1)] = s[n][x];
    __syncthreads();  // every warp is done with the K tile (and its P rows are written)
    fa_load<float, D, BN>(kv, v, ks, k0, skv, 1.0f);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NT; ++c) {
      const float* p0 = &pw[g * LP + c * 8 + t];
      const unsigned pa[4] = {fa_tf32(p0[0]), fa_tf32(p0[8 * LP]), fa_tf32(p0[4]), fa_tf32(p0[8 * LP + 4])};
      const float* v0 = &kv[(c * 8 + t) * LD + g];
#pragma unroll
      for (int n = 0; n < DT; ++n) fa_mma_tf32(o[n], pa, fa_tf32(v0[n * 8]), fa_tf32(v0[4 * LD + n * 8]));
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= sq) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    float* yr = y + b * yb + h * yh + (fa_i64)rows[r] * ys;
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      yr[n * 8 + 2 * t] = o[n][2 * r] * inv;
      yr[n * 8 + 2 * t + 1] = o[n][2 * r + 1] * inv;
    }
  }
}
#endif
"""
