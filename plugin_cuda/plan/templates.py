"""CUDA C templates of the generated kernels that are too long to read inside a function
(str.format fields; doubled braces are C braces)."""

from __future__ import annotations

__all__ = ["TILED_GEMM"]

# codegen.tiled_gemm_kernel: out[m, n] = epilogue(alpha * A @ B) in T x T tiles (T = {t}), 16-deep
# k slices in shared memory, the next one prefetched into registers; {r_} x {r_} outputs a thread.
# {cva} / {cvb}: the float conversion of A's / B's elements ("" for float32, "to_f" for half types).
TILED_GEMM = """extern "C" __global__ void __launch_bounds__(256) {name}({decls}) {{
  __shared__ float As[16][{t4}];
  __shared__ float Bs[16][{t4}];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int row0 = blockIdx.y * {t}, col0 = blockIdx.x * {t};
  float acc[{r_}][{r_}];
#pragma unroll
  for (int r = 0; r < {r_}; ++r)
#pragma unroll
    for (int c = 0; c < {r_}; ++c) acc[r][c] = 0.0f;
  // The next k slice is read from global memory into registers while this one is multiplied.
  float ra[{r_}], rb[{r_}];
#pragma unroll
  for (int l = 0; l < {r_}; ++l) {{
    const int e = tid + l * 256;
    const int gm = row0 + (e >> 4), ak = e & 15;
    ra[l] = (gm < {m_dim} && ak < {k_dim}) ? {cva}({pa}[gm * {k_dim} + ak]) : 0.0f;
    const int bk = e >> {shift}, gn = col0 + (e & {tmask});
    rb[l] = (bk < {k_dim} && gn < {n_dim}) ? {cvb}({pb}[bk * {n_dim} + gn]) : 0.0f;
  }}
  for (int k0 = 0; k0 < {k_dim}; k0 += 16) {{
#pragma unroll
    for (int l = 0; l < {r_}; ++l) {{
      const int e = tid + l * 256;
      As[e & 15][e >> 4] = ra[l];
      Bs[e >> {shift}][e & {tmask}] = rb[l];
    }}
    __syncthreads();
    if (k0 + 16 < {k_dim}) {{
#pragma unroll
      for (int l = 0; l < {r_}; ++l) {{
        const int e = tid + l * 256;
        const int gm = row0 + (e >> 4), gk = k0 + 16 + (e & 15);
        ra[l] = (gm < {m_dim} && gk < {k_dim}) ? {cva}({pa}[gm * {k_dim} + gk]) : 0.0f;
        const int hk = k0 + 16 + (e >> {shift}), gn = col0 + (e & {tmask});
        rb[l] = (hk < {k_dim} && gn < {n_dim}) ? {cvb}({pb}[hk * {n_dim} + gn]) : 0.0f;
      }}
    }}
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {{
      float a[{r_}], b[{r_}];
#pragma unroll
      for (int r = 0; r < {r_}; ++r) a[r] = As[kk][ty + 16 * r];
#pragma unroll
      for (int c = 0; c < {r_}; ++c) b[c] = Bs[kk][tx + 16 * c];
#pragma unroll
      for (int r = 0; r < {r_}; ++r)
#pragma unroll
        for (int c = 0; c < {r_}; ++c) acc[r][c] += a[r] * b[c];
    }}
    __syncthreads();
  }}
#pragma unroll
  for (int r = 0; r < {r_}; ++r) {{
#pragma unroll
    for (int c = 0; c < {r_}; ++c) {{
      const int m = row0 + ty + 16 * r, n = col0 + tx + 16 * c;
      if (m < {m_dim} && n < {n_dim}) {{
        const int i = m * {n_dim} + n;
        const float g0 = {scaled};
        {epilogue}
      }}
    }}
  }}
}}
"""
