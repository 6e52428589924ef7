"""CUDA C of the tensor-core flash attention kernel for float16 and bfloat16 (mma.sync m16n8k16,
float32 accumulation), in the style of FlashAttention-2.

One block of 4 warps computes BM = 64 query rows (16 per warp) of one (batch, query head). Each
warp keeps its Q rows as A fragments in registers; K and V tiles of 64 keys pass through one
shared buffer (V transposed, so that its B fragments are 32-bit loads). S = Q K^T is one m16n8k16 MMA per (8 keys, 16 head columns); the softmax is online
in float32 on the accumulators (a row's values live in the 4 threads of a quad: 2 shuffles); the
probabilities are rounded to the input type and reused in registers as the A fragments of O += P V
(an accumulator's layout is the A layout of the next MMA), so P never touches shared memory.
Needs sm_80 or newer (bfloat16 MMA); the SIMT kernel (flash_source.py) is the fallback.

Where no GPU compiles it (a CPU test shim), `__CUDA_ARCH__` is undefined and the MMA is the shim's
`fa_mma_host`: the test checks the fragment bookkeeping against NumPy.
"""

from __future__ import annotations

__all__ = ["BLOCK_Q_MMA", "BODY_MMA"]

BLOCK_Q_MMA = 64

BODY_MMA = r"""
#if !defined(EPHOST_FLASH_MMA_BODY) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#define EPHOST_FLASH_MMA_BODY
__device__ __forceinline__ unsigned short fa_bits(fa_f16, float v) { fa_f16 h; fa_put(&h, v); return h.b; }
__device__ __forceinline__ unsigned short fa_bits(fa_bf16, float v) { fa_bf16 h; fa_put(&h, v); return h.b; }
// Two values as one 32-bit register of the MMA operands: `lo` in the low half.
template <typename T>
__device__ __forceinline__ unsigned fa_pack(float lo, float hi) {
  return (unsigned)fa_bits(T(), lo) | ((unsigned)fa_bits(T(), hi) << 16);
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ void fa_mma(fa_f16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void fa_mma(fa_bf16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
template <typename T>
__device__ __forceinline__ void fa_mma(T, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  fa_mma_host(T(), c, a, b0, b1);
}
#endif

// Rows [r0, r0 + ROWS) of a (rows, D) slab of 16-bit values, row stride `ld` elements, into shared
// memory with row stride LD = D + 8 (conflict-free fragment loads); rows past `n`: zeros.
template <int D, int ROWS>
__device__ __forceinline__ void fa_load16(unsigned short* dst, const unsigned short* __restrict__ src, fa_i64 ld,
                                          int r0, int n) {
  constexpr int LD = D + 8, W = D / 2;  // 32-bit words per row
  if ((((unsigned long long)src) & 15) == 0 && (ld & 7) == 0) {  // rows in 16-byte pieces
    constexpr int W8 = D / 8;
    for (int e = threadIdx.x; e < ROWS * W8; e += 128) {
      const int r = e / W8, w = e - r * W8;
      uint4 x = {0u, 0u, 0u, 0u};
      if (r0 + r < n) x = *(const uint4*)(src + (fa_i64)(r0 + r) * ld + 8 * w);
      *(uint4*)&dst[r * LD + 8 * w] = x;
    }
    return;
  }
  for (int e = threadIdx.x; e < ROWS * W; e += 128) {
    const int r = e / W, w = e - r * W;
    unsigned v = 0u;
    if (r0 + r < n) {
      const unsigned short* p = src + (fa_i64)(r0 + r) * ld + 2 * w;
      v = (unsigned)p[0] | ((unsigned)p[1] << 16);
    }
    *(unsigned*)&dst[r * LD + 2 * w] = v;
  }
}

// The same rows transposed: dst[d * LDV + r] (LDV = ROWS + 8), so that the B fragments of P V (two
// consecutive keys of one column) are 32-bit loads. Consecutive threads take consecutive rows, which
// keeps the 16-bit stores free of bank conflicts.
template <int D, int ROWS>
__device__ __forceinline__ void fa_load16_t(unsigned short* dst, const unsigned short* __restrict__ src, fa_i64 ld,
                                            int r0, int n) {
  constexpr int LDV = ROWS + 8;
  if ((((unsigned long long)src) & 15) == 0 && (ld & 7) == 0) {
    for (int e = threadIdx.x; e < ROWS * (D / 8); e += 128) {
      const int r = e % ROWS, w = e / ROWS;
      uint4 x = {0u, 0u, 0u, 0u};
      if (r0 + r < n) x = *(const uint4*)(src + (fa_i64)(r0 + r) * ld + 8 * w);
      const unsigned u[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        dst[(8 * w + 2 * i) * LDV + r] = (unsigned short)(u[i] & 0xffffu);
        dst[(8 * w + 2 * i + 1) * LDV + r] = (unsigned short)(u[i] >> 16);
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < ROWS * D; e += 128) {
    const int r = e % ROWS, d = e / ROWS;
    dst[d * LDV + r] = r0 + r < n ? src[(fa_i64)(r0 + r) * ld + d] : (unsigned short)0;
  }
}

template <typename T, int D>
__device__ __forceinline__ void fa_tile_mma(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const void* __restrict__ mask,
    T* __restrict__ y, fa_i64 qb, fa_i64 qh, fa_i64 qs, fa_i64 kb, fa_i64 kh, fa_i64 ks, fa_i64 yb, fa_i64 yh,
    fa_i64 ys, fa_i64 mb, fa_i64 mh, fa_i64 mi, int mask_kind, int mask_len, int group, int sq, int skv,
    int causal, float scale, float softcap) {
  constexpr int BM = 64, BN = 64, LD = D + 8, LDV = BN + 8, KC = D / 16, NT = BN / 8, DT = D / 8;
  constexpr int KV = BN * LD > D * LDV ? BN * LD : D * LDV;  // a K tile, then the V tile transposed
  __shared__ __align__(16) unsigned short qt[BM * LD];
  __shared__ __align__(16) unsigned short kv[KV];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, hk = h / group;
  const unsigned short* K = (const unsigned short*)k + b * kb + hk * kh;
  const unsigned short* V = (const unsigned short*)v + b * kb + hk * kh;
  fa_load16<D, BM>(qt, (const unsigned short*)q + b * qb + h * qh, qs, q0, sq);
  __syncthreads();
  unsigned qa[KC][4];  // this warp's 16 rows of Q as A fragments
  const int wr = warp * 16;
#pragma unroll
  for (int c = 0; c < KC; ++c) {
    const unsigned short* r0 = &qt[(wr + g) * LD + c * 16 + 2 * t];
    const unsigned short* r8 = r0 + 8 * LD;
    qa[c][0] = *(const unsigned*)r0; qa[c][1] = *(const unsigned*)r8;
    qa[c][2] = *(const unsigned*)(r0 + 8); qa[c][3] = *(const unsigned*)(r8 + 8);
  }
  int kv_end = skv;
  if (causal) kv_end = min(kv_end, q0 + BM);
  if (mask_kind) kv_end = min(kv_end, mask_len);
  const int rows[2] = {q0 + wr + g, q0 + wr + g + 8};
  const void* mrow[2];
  fa_mask_rows(mrow, mask, mask_kind, b * mb + h * mh, mi, rows, sq);
  float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int c = 0; c < DT; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
  for (int k0 = 0; k0 < kv_end; k0 += BN) {
    __syncthreads();  // the previous V tile is read
    fa_load16<D, BN>(kv, K, ks, k0, skv);
    __syncthreads();
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const unsigned short* kr = &kv[(n * 8 + g) * LD + c * 16 + 2 * t];
        fa_mma(T(), s[n], qa[c], *(const unsigned*)kr, *(const unsigned*)(kr + 8));
      }
    }
    fa_quad_softmax<NT, DT>(s, o, m, l, rows, mrow, k0, t, kv_end, causal, mask_kind, scale, softcap);
    __syncthreads();  // every warp is done with the K tile: the buffer takes the V tile
    fa_load16_t<D, BN>(kv, V, ks, k0, skv);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < BN / 16; ++c) {
      // P's keys 16 c .. 16 c + 15 as an A fragment: the accumulators of n = 2 c and 2 c + 1.
      const unsigned pa[4] = {fa_pack<T>(s[2 * c][0], s[2 * c][1]), fa_pack<T>(s[2 * c][2], s[2 * c][3]),
                              fa_pack<T>(s[2 * c + 1][0], s[2 * c + 1][1]),
                              fa_pack<T>(s[2 * c + 1][2], s[2 * c + 1][3])};
#pragma unroll
      for (int n = 0; n < DT; ++n) {  // B: keys 16 c + 2 t, + 1 (and + 8, + 9) of column 8 n + g
        const unsigned short* vp = &kv[(n * 8 + g) * LDV + c * 16 + 2 * t];
        fa_mma(T(), o[n], pa, *(const unsigned*)vp, *(const unsigned*)(vp + 8));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= sq) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    T* yr = y + b * yb + h * yh + (fa_i64)rows[r] * ys;
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      fa_put(yr + n * 8 + 2 * t, o[n][2 * r] * inv);
      fa_put(yr + n * 8 + 2 * t + 1, o[n][2 * r + 1] * inv);
    }
  }
}
#endif
"""
