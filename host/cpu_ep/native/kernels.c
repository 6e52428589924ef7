/* Compiled float32 kernels of ephost's CPU EP (docs/cpu_ep.md, "Third pass").
 *
 * Built by build.py into build/lib/libephost_cpu_kernels.so and opened by host/cpu_ep/native in cffi
 * ABI mode. Every function takes plain pointers to C-contiguous float32 buffers the caller checked;
 * nothing here allocates the outputs or raises: a return value other than 0 (only where a scratch
 * buffer must be allocated) makes the caller run its NumPy path.
 *
 * No -ffast-math: NaN and Inf propagate as NumPy's ufuncs propagate them (clamps are written as
 * comparisons that a NaN fails). exp and erf are polynomial approximations written so that the
 * compiler can vectorize them (libm's are scalar calls): within a few ulp of float32 libm.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr and RTLD_NODELETE (kernels_pool.c) */
#endif
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef EPHOST_CPU_SOURCE_HASH
#define EPHOST_CPU_SOURCE_HASH "unknown"
#endif

/* The hot loops get an AVX-512 and an AVX2+FMA clone, picked at load time (GCC's ifunc); other
 * compilers and targets build the one portable version. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT
#endif
#define INLINE static inline __attribute__((always_inline))

const char *ep_source_hash(void) { return EPHOST_CPU_SOURCE_HASH; }

/* -- elementwise math --------------------------------------------------------------------------- */

/* exp(x): Cephes' expf (range reduction by ln 2, degree-6 polynomial, 2^n from the exponent bits).
 * Overflow gives inf, x below -87.3 gives 0, NaN gives NaN. Written for GCC's vectorizer: n is rounded
 * with the 1.5 * 2^23 trick, whose bits also hold n as an integer (conversions between float and int
 * after a select keep GCC's loop scalar, and floorf is a call without -ffast-math). */
INLINE float ep_exp(float x) {
    float xc = x > 88.7228391116729996f ? 88.7228391116729996f : x;
    xc = xc < -87.3365447505531f ? -87.3365447505531f : xc;
    union { float f; int32_t i; } k, scale;
    k.f = xc * 1.44269504088896341f + 12582912.0f; /* round(xc / ln 2) in the low mantissa bits */
    float n = k.f - 12582912.0f;
    int32_t ni = k.i - 0x4B400000;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    /* 2^n as 2^(n-1) * 2 when n > 0: n reaches 128 just below the overflow threshold. */
    int32_t dec = ni > 0 ? 1 : 0;
    float up = ni > 0 ? 2.0f : 1.0f;
    scale.i = (ni - dec + 127) << 23;
    float y = p * scale.f * up;
    y = x > 88.7228391116729996f ? INFINITY : y;
    return x < -87.3365447505531f ? 0.0f : y;
}

/* erf(x): Eigen's float32 rational approximation on [-4, 4] (erf(+-4) rounds to +-1 in float32). */
INLINE float ep_erf(float x) {
    float xc = x > 4.0f ? 4.0f : x;
    xc = xc < -4.0f ? -4.0f : xc;
    float x2 = xc * xc;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 + -2.10102402082508e-06f;
    p = p * x2 + -5.69250639462346e-05f;
    p = p * x2 + -7.34990630326855e-04f;
    p = p * x2 + -2.95459980854025e-03f;
    p = p * x2 + -1.60960333262415e-02f;
    p = p * xc;
    float q = -1.45660718464996e-05f;
    q = q * x2 + -2.13374055278905e-04f;
    q = q * x2 + -1.68282697438203e-03f;
    q = q * x2 + -7.37332916720468e-03f;
    q = q * x2 + -1.42647390514189e-02f;
    float r = p / q; /* can overshoot +-1 by an ulp: 1 + erf(x) must not go negative in GELU */
    r = r > 1.0f ? 1.0f : r;
    return r < -1.0f ? -1.0f : r;
}

/* Epilogue programs: up to 6 steps, 4 bits each, lowest first; applied in order after the bias. */
enum {
    EP_END = 0, EP_RELU = 1, EP_GELU = 2, EP_GELU_TANH = 3, EP_HARD_SWISH = 4, EP_HARD_SIGMOID = 5,
    EP_SIGMOID = 6, EP_ADD = 7, EP_SILU = 8, EP_MUL = 9
};

typedef struct {
    unsigned prog;      /* steps */
    const float *res;   /* EP_ADD's or EP_MUL's operand, laid out as the output */
    size_t res_ld;      /* its row stride */
    float alpha, beta;  /* EP_HARD_SIGMOID's parameters */
} Epilogue;

/* One step over v[0..n); `res` is EP_ADD's or EP_MUL's row. Branch-free bodies so the loops vectorize. */
INLINE void step(float *v, int n, unsigned code, const float *res, float alpha, float beta) {
    switch (code) {
    case EP_RELU:
        for (int j = 0; j < n; j++) v[j] = v[j] < 0.0f ? 0.0f : v[j];  /* NaN stays NaN, as np.maximum */
        break;
    case EP_GELU:
        for (int j = 0; j < n; j++) {
            float x = v[j];
            float t = ep_erf(x * 0.70710678118654752f) + 1.0f;
            v[j] = t * x * 0.5f;
        }
        break;
    case EP_GELU_TANH:  /* 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)) */
        for (int j = 0; j < n; j++) {
            float x = v[j];
            float t = (x * x * (-2.0f * 0.7978845608028654f * 0.044715f) + -2.0f * 0.7978845608028654f) * x;
            v[j] = x / (ep_exp(t) + 1.0f);
        }
        break;
    case EP_HARD_SWISH:
        for (int j = 0; j < n; j++) {
            float g = v[j] * (1.0f / 6.0f) + 0.5f;
            g = g < 0.0f ? 0.0f : g;
            g = g > 1.0f ? 1.0f : g;
            v[j] = v[j] * g;
        }
        break;
    case EP_HARD_SIGMOID:
        for (int j = 0; j < n; j++) {
            float g = v[j] * alpha + beta;
            g = g < 0.0f ? 0.0f : g;
            v[j] = g > 1.0f ? 1.0f : g;
        }
        break;
    case EP_SIGMOID:
        for (int j = 0; j < n; j++) v[j] = 1.0f / (ep_exp(-v[j]) + 1.0f);
        break;
    case EP_ADD:
        for (int j = 0; j < n; j++) v[j] += res[j];
        break;
    case EP_SILU:  /* x * sigmoid(x), the sigmoid rounded first as the two nodes round it */
        for (int j = 0; j < n; j++) v[j] = v[j] * (1.0f / (ep_exp(-v[j]) + 1.0f));
        break;
    case EP_MUL:
        for (int j = 0; j < n; j++) v[j] *= res[j];
        break;
    default:
        break;
    }
}

INLINE void epilogue(float *v, int n, const Epilogue *e, size_t row) {
    for (unsigned prog = e->prog; prog; prog >>= 4)
        step(v, n, prog & 15u, e->res ? e->res + row * e->res_ld : NULL, e->alpha, e->beta);
}

/* Sums in 16 lanes, added up at the end: the lanes are independent, so the loop vectorizes without
 * reassociating (no -ffast-math); as accurate as NumPy's pairwise float32 sums at these lengths. */
#define LANES 16

INLINE float lane_total(const float *lane) {
    float t = 0.0f;
    for (int l = 0; l < LANES; l++) t += lane[l];
    return t;
}

INLINE float lane_sum(const float *x, int n) {
    float lane[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += x[j + l];
    for (; j < n; j++) lane[0] += x[j];
    return lane_total(lane);
}

/* The largest of x[0..n) in lanes (-inf for none; NaN is skipped by the comparisons). */
INLINE float lane_max(const float *x, int n) {
    float lane[LANES];
    for (int l = 0; l < LANES; l++) lane[l] = -INFINITY;
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
    for (; j < n; j++) lane[0] = x[j] > lane[0] ? x[j] : lane[0];
    float top = -INFINITY;
    for (int l = 0; l < LANES; l++) top = lane[l] > top ? lane[l] : top;
    return top;
}

INLINE float lane_dot(const float *a, const float *b, int n) {
    float lane[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += a[j + l] * b[j + l];
    for (; j < n; j++) lane[0] += a[j] * b[j];
    return lane_total(lane);
}

/* sum((x - c)^2) */
INLINE float sum_sq_dev(const float *x, float c, int n) {
    float lane[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            float d = x[j + l] - c;
            lane[l] += d * d;
        }
    for (; j < n; j++) lane[0] += (x[j] - c) * (x[j] - c);
    return lane_total(lane);
}

/* y[i] = prog(x[i] + bias[i % n]) over rows x n (bias may be NULL); y may be x. */
HOT void ep_bias_act(const float *x, const float *bias, float *y, int rows, int n, unsigned prog,
                     const float *res, float alpha, float beta) {
    Epilogue e = {prog, res, (size_t)n, alpha, beta};
    for (int i = 0; i < rows; i++) {
        const float *xi = x + (size_t)i * n;
        float *yi = y + (size_t)i * n;
        if (bias)
            for (int j = 0; j < n; j++) yi[j] = xi[j] + bias[j];
        else if (yi != xi)
            memcpy(yi, xi, sizeof(float) * (size_t)n);
        epilogue(yi, n, &e, (size_t)i);
    }
}

/* -- GEMM ------------------------------------------------------------------------------------------ */

#define NR 32 /* output columns per tile: two 16-float vectors per row (tile_full) */

/* C[R x NR] tile at (i0, j0) = A[i0.., :] B[:, j0..]; R is a constant where inlined. */
/* GCC vector extensions: the tile's sums stay in registers whatever the auto-vectorizer would pick (it
 * vectorizes these loops across k with shuffles for some row counts); lowered to what the clone has. */
typedef float vf __attribute__((vector_size(64), aligned(4), may_alias));

INLINE void tile_full(const float *A, const float *B, float *acc, int R, int K, int N, int i0, int j0) {
    vf c[8][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = (vf){0};
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * N + j0;
        vf b0 = *(const vf *)b, b1 = *(const vf *)(b + 16);
        for (int r = 0; r < R; r++) {
            float a = A[(size_t)(i0 + r) * K + k];
            c[r][0] += a * b0;
            c[r][1] += a * b1;
        }
    }
    for (int r = 0; r < R; r++) {
        *(vf *)(acc + r * NR) = c[r][0];
        *(vf *)(acc + r * NR + 16) = c[r][1];
    }
}

/* The right-edge tile: `cols` < NR columns, one row at a time (when no scratch can be had). */
INLINE void tile_edge(const float *A, const float *B, float *acc, int K, int N, int i, int j0, int cols) {
    for (int j = 0; j < cols; j++) acc[j] = 0.0f;
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * N + j0;
        float a = A[(size_t)i * K + k];
        for (int j = 0; j < cols; j++) acc[j] += a * b[j];
    }
}

INLINE void store(float *C, const float *acc, int rows, int cols, int ld_acc, int N, int i0, int j0,
                  const float *bias, int bias_kind) {
    for (int r = 0; r < rows; r++) {
        float *c = C + (size_t)(i0 + r) * N + j0;
        const float *a = acc + r * ld_acc;
        if (bias_kind == 1)
            for (int j = 0; j < cols; j++) c[j] = a[j] + bias[j0 + j];
        else if (bias_kind == 2) {
            float b = bias[i0 + r];
            for (int j = 0; j < cols; j++) c[j] = a[j] + b;
        } else
            for (int j = 0; j < cols; j++) c[j] = a[j];
    }
}

/* One row's outputs at columns j0..j0+4*NR: eight 16-float sums (tile_full keeps two per row, and a
 * lone row's product then waits on the latency of its two dependent chains: 4x fewer multiply-adds per
 * cycle on a batch-1 layer). The same in-order sum over k for each output as tile_full's. */
INLINE void row_wide(const float *A, const float *B, float *acc, int K, int N, int i, int j0) {
    vf c[8];
    for (int v = 0; v < 8; v++) c[v] = (vf){0};
    const float *a = A + (size_t)i * K;
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * N + j0;
        float x = a[k];
        for (int v = 0; v < 8; v++) c[v] += x * *(const vf *)(b + 16 * v);
    }
    for (int v = 0; v < 8; v++) *(vf *)(acc + 16 * v) = c[v];
}

/* C = A B + bias; the caller runs the epilogue over the whole of C afterwards (once over M*N elements
 * costs less than once per tile row on these small outputs). Rows past the last whole 4-row tile take
 * row_wide across the columns first. */
INLINE void gemm_core(const float *A, const float *B, const float *bias, int bias_kind, float *C, int M, int K,
                      int N) {
    float acc[8 * NR];
    int jfull = N - N % NR, m8 = M - M % 8, mfull = M - M % 4;
    for (int j0 = 0; j0 < jfull; j0 += NR) {
        /* 8-row tiles keep 16 sums in registers: enough independent multiply-adds to cover their latency
         * on both FMA ports (a 4-row tile's 8 chains left them half idle); the sums over k are the same. */
        int i0 = 0;
        for (; i0 < m8; i0 += 8) {
            tile_full(A, B, acc, 8, K, N, i0, j0);
            store(C, acc, 8, NR, NR, N, i0, j0, bias, bias_kind);
        }
        for (; i0 < mfull; i0 += 4) {
            tile_full(A, B, acc, 4, K, N, i0, j0);
            store(C, acc, 4, NR, NR, N, i0, j0, bias, bias_kind);
        }
    }
    for (int i = mfull; i < M; i++) {
        int j0 = 0;
        for (; j0 + 4 * NR <= jfull; j0 += 4 * NR) {
            row_wide(A, B, acc, K, N, i, j0);
            store(C, acc, 1, 4 * NR, 4 * NR, N, i, j0, bias, bias_kind);
        }
        for (; j0 < jfull; j0 += NR) {
            tile_full(A, B, acc, 1, K, N, i, j0);
            store(C, acc, 1, NR, NR, N, i, j0, bias, bias_kind);
        }
    }
    if (jfull == N) return;
    int cols = N - jfull;
    /* The last columns copied into a zero-padded (K, NR) block, so that they take the full tiles too. */
    float *bp = malloc(sizeof(float) * (size_t)K * NR);
    if (!bp) {
        for (int i = 0; i < M; i++) {
            tile_edge(A, B, acc, K, N, i, jfull, cols);
            store(C, acc, 1, cols, NR, N, i, jfull, bias, bias_kind);
        }
        return;
    }
    for (int k = 0; k < K; k++) {
        float *row = bp + (size_t)k * NR;
        for (int j = 0; j < NR; j++) row[j] = j < cols ? B[(size_t)k * N + jfull + j] : 0.0f;
    }
    int i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        tile_full(A, bp, acc, 4, K, NR, i0, 0);
        store(C, acc, 4, cols, NR, N, i0, jfull, bias, bias_kind);
    }
    for (; i0 < M; i0++) {
        tile_full(A, bp, acc, 1, K, NR, i0, 0);
        store(C, acc, 1, cols, NR, N, i0, jfull, bias, bias_kind);
    }
    free(bp);
}

/* C (M x N) = prog(A (M x K) @ B (K x N) + bias), all row-major and contiguous. bias_kind: 0 none,
 * 1 a vector over columns (length N), 2 a vector over rows (length M: a convolution's bias). Each
 * output is a plain in-order dot product over k.
 * AT, when given, is A transposed (K x M): a narrow output (N < NR columns: a pointwise convolution
 * over a few pixels) with more rows is then computed as C^T = B^T A^T and transposed back. */
HOT void ep_gemm(const float *A, const float *AT, const float *B, const float *bias, int bias_kind, float *C, int M,
                 int K, int N, unsigned prog, const float *res, float alpha, float beta) {
    Epilogue e = {prog, res, 0, alpha, beta}; /* over C as one row: res is laid out as C */
    if (AT && N < NR && M > N) {
        float *bt = malloc(sizeof(float) * (size_t)N * ((size_t)K + M));
        if (bt) {
            float *ct = bt + (size_t)N * K;
            for (int k = 0; k < K; k++)
                for (int j = 0; j < N; j++) bt[(size_t)j * K + k] = B[(size_t)k * N + j];
            gemm_core(bt, AT, NULL, 0, ct, N, K, M);
            for (int i = 0; i < M; i++) {
                float *c = C + (size_t)i * N;
                for (int j = 0; j < N; j++) c[j] = ct[(size_t)j * M + i];
                if (bias_kind == 1)
                    for (int j = 0; j < N; j++) c[j] += bias[j];
                else if (bias_kind == 2)
                    for (int j = 0; j < N; j++) c[j] += bias[i];
            }
            free(bt);
            epilogue(C, M * N, &e, 0);
            return;
        }
    }
    gemm_core(A, B, bias, bias_kind, C, M, K, N);
    epilogue(C, M * N, &e, 0);
}

/* -- normalization --------------------------------------------------------------------------------- */

/* LayerNormalization over rows x n (x + skip when skip is given; that sum goes to `sum` when given):
 * y = (s - mean) / sqrt(var + eps) * scale + bias (bias may be NULL). mean and inv_std (per row) are
 * written when given. */
HOT void ep_layernorm(const float *x, const float *skip, const float *scale, const float *bias, float *y,
                      float *sum, float *mean_out, float *inv_std_out, int rows, int n, float eps) {
    for (int i = 0; i < rows; i++) {
        const float *xi = x + (size_t)i * n;
        float *yi = y + (size_t)i * n;
        if (skip) {
            const float *si = skip + (size_t)i * n;
            for (int j = 0; j < n; j++) yi[j] = xi[j] + si[j];
            if (sum) memcpy(sum + (size_t)i * n, yi, sizeof(float) * (size_t)n);
            xi = yi;
        }
        float mean = lane_sum(xi, n) / (float)n;
        float std = sqrtf(sum_sq_dev(xi, mean, n) / (float)n + eps);
        for (int j = 0; j < n; j++) yi[j] = (xi[j] - mean) / std * scale[j];
        if (bias)
            for (int j = 0; j < n; j++) yi[j] += bias[j];
        if (mean_out) mean_out[i] = mean;
        if (inv_std_out) inv_std_out[i] = 1.0f / std;
    }
}

/* RMSNormalization over rows x n: y = x / sqrt(mean(x^2) + eps) * scale. */
HOT void ep_rmsnorm(const float *x, const float *scale, float *y, int rows, int n, float eps) {
    for (int i = 0; i < rows; i++) {
        const float *xi = x + (size_t)i * n;
        float *yi = y + (size_t)i * n;
        float rms = sqrtf(lane_dot(xi, xi, n) / (float)n + eps);
        for (int j = 0; j < n; j++) yi[j] = xi[j] / rms * scale[j];
    }
}

/* -- rotary embedding ------------------------------------------------------------------------------ */

/* Halves layout over whole heads: x (B, H, S, D), element (b, h, s, d) at b*xs[0] + h*xs[1] + s*xs[2] + d;
 * y likewise by ys (contiguous (B, H, S, D), or (B, S, H*D) for the 3-D form); cos/sin (B or 1, S, D/2)
 * (cs_batch = 0 when shared): y[:half] = x1 cos - x2 sin, y[half:] = x1 sin + x2 cos. */
HOT void ep_rotary_halves(const float *x, const int64_t *xs, const float *cos_c, const float *sin_c, float *y,
                          const int64_t *ys, int B, int H, int S, int D, int64_t cs_batch) {
    int half = D / 2;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int s = 0; s < S; s++) {
                const float *x1 = x + b * xs[0] + h * xs[1] + s * xs[2], *x2 = x1 + half;
                float *y1 = y + b * ys[0] + h * ys[1] + s * ys[2], *y2 = y1 + half;
                const float *c = cos_c + b * cs_batch + (size_t)s * half;
                const float *sn = sin_c + b * cs_batch + (size_t)s * half;
                for (int j = 0; j < half; j++) {
                    y1[j] = x1[j] * c[j] - x2[j] * sn[j];
                    y2[j] = x1[j] * sn[j] + x2[j] * c[j];
                }
            }
}

/* -- convolution ----------------------------------------------------------------------------------- */

typedef struct {
    int C, H, W;        /* input channels and size of one image */
    int M, KH, KW;      /* output channels, kernel */
    int SH, SW, PH, PW, DH, DW;  /* strides, padding before, dilations */
    int OH, OW;         /* output size */
} ConvGeom;

/* Depthwise over a small output (few columns): channels last, so the innermost loop runs over channels,
 * not over a handful of output columns. The input is copied padded as (Hp, Wp, C), the taps as (KH*KW, C);
 * the (pixels, C) result is transposed back. Returns 1 when scratch cannot be allocated. */
INLINE int depthwise_channels_last(const float *x, const float *w, float *y, const ConvGeom *g) {
    int C = g->C;
    int hp = (g->OH - 1) * g->SH + (g->KH - 1) * g->DH + 1, wp = (g->OW - 1) * g->SW + (g->KW - 1) * g->DW + 1;
    size_t n_in = (size_t)hp * wp * C, n_w = (size_t)g->KH * g->KW * C, n_out = (size_t)g->OH * g->OW * C;
    float *xp = calloc(n_in + n_w + n_out, sizeof(float));
    if (!xp) return 1;
    float *wt = xp + n_in, *out = wt + n_w;
    for (int c = 0; c < C; c++) {
        for (int t = 0; t < g->KH * g->KW; t++) wt[(size_t)t * C + c] = w[(size_t)c * g->KH * g->KW + t];
        for (int ih = 0; ih < g->H; ih++) {
            int r = ih + g->PH;
            if (r >= hp) break;
            for (int iw = 0; iw < g->W; iw++) {
                int col = iw + g->PW;
                if (col >= wp) break;
                xp[((size_t)r * wp + col) * C + c] = x[((size_t)c * g->H + ih) * g->W + iw];
            }
        }
    }
    for (int oh = 0; oh < g->OH; oh++)
        for (int ow = 0; ow < g->OW; ow++) {
            float *o = out + ((size_t)oh * g->OW + ow) * C;
            for (int i = 0; i < g->KH; i++)
                for (int j = 0; j < g->KW; j++) {
                    const float *xr = xp + ((size_t)(oh * g->SH + i * g->DH) * wp + ow * g->SW + j * g->DW) * C;
                    const float *wr = wt + (size_t)(i * g->KW + j) * C;
                    for (int c = 0; c < C; c++) o[c] += wr[c] * xr[c];
                }
        }
    for (int c = 0; c < C; c++)
        for (int p = 0; p < g->OH * g->OW; p++) y[(size_t)c * g->OH * g->OW + p] = out[(size_t)p * C + c];
    free(xp);
    return 0;
}

/* Phase planes of one zero-padded channel: plane q holds the padded image's columns q, q + SW, q + 2 SW,
 * ..., so that the input columns ow * SW + col (col = j * DW) of the output columns ow are the contiguous
 * run plane[col % SW][row][ow + col / SW ...]. Each plane row is `wq` long (zeros past the image: vector
 * loads may read up to 16 floats beyond the last output). Rows are the padded image's rows [0, hp). */
typedef struct {
    int hp, wq;
} Phases;

INLINE Phases phase_shape(const ConvGeom *g) {
    int wp = (g->OW - 1) * g->SW + (g->KW - 1) * g->DW + 1;
    Phases ph = {(g->OH - 1) * g->SH + (g->KH - 1) * g->DH + 1, (wp + g->SW - 1) / g->SW + 16};
    return ph;
}

INLINE void fill_phases(const float *xc, const ConvGeom *g, Phases ph, float *planes) {
    memset(planes, 0, sizeof(float) * (size_t)g->SW * ph.hp * ph.wq);
    const int sw = g->SW, pw = g->PW, w = g->W;
    for (int q = 0; q < sw; q++) {
        /* padded column u * SW + q is input column u * SW + q - PW: the u inside the image, no branch */
        int lo = pw - q > 0 ? (pw - q + sw - 1) / sw : 0;
        int hi = (w - 1 + pw - q) / sw + 1;
        if (hi > ph.wq - 16) hi = ph.wq - 16;
        for (int ih = 0; ih < g->H && ih + g->PH < ph.hp; ih++) {
            const float *xr = xc + (size_t)ih * w;
            float *dst = planes + ((size_t)q * ph.hp + ih + g->PH) * ph.wq;
            if (sw == 1)
                memcpy(dst + lo, xr + lo - pw, sizeof(float) * (size_t)(hi > lo ? hi - lo : 0));
            else
                for (int u = lo; u < hi; u++) dst[u] = xr[u * sw + q - pw];
        }
    }
}

/* Depthwise 2-D convolution of one image (group = C = M). Outputs of 8 columns or more: per channel, its
 * phase planes, then 16 output columns at a time summed over the taps in one vector (contiguous loads,
 * no bounds); narrower outputs: channels last. Then bias and the epilogue. Returns 1 when scratch cannot
 * be allocated. */
HOT int ep_depthwise2d(const float *x, const float *w, const float *bias, float *y, const ConvGeom *g,
                       unsigned prog, const float *res, float alpha, float beta) {
    Epilogue e = {prog, res, 0, alpha, beta};
    size_t plane = (size_t)g->OH * g->OW;
    if (g->OW < 8) {
        if (depthwise_channels_last(x, w, y, g)) return 1;
    } else {
        Phases ph = phase_shape(g);
        float *planes = malloc(sizeof(float) * (size_t)g->SW * ph.hp * ph.wq);
        if (!planes) return 1;
        int tap_off[64]; /* per kernel column j: its phase plane and offset, (j DW % SW) * hp * wq + j DW / SW */
        if (g->KW > 64) {
            free(planes);
            return 1;
        }
        for (int j = 0; j < g->KW; j++) tap_off[j] = (j * g->DW % g->SW) * ph.hp * ph.wq + j * g->DW / g->SW;
        /* the geometry in locals: stores through y could alias *g, which the loops would then reload */
        const int kh = g->KH, kw = g->KW, sh = g->SH, dh = g->DH, oh_n = g->OH, ow_n = g->OW;
        for (int c = 0; c < g->C; c++) {
            fill_phases(x + (size_t)c * g->H * g->W, g, ph, planes);
            const float *wc = w + (size_t)c * kh * kw;
            float *yc = y + (size_t)c * plane;
            for (int oh = 0; oh < oh_n; oh++)
                for (int ow0 = 0; ow0 < ow_n; ow0 += 16) {
                    vf acc = {0};
                    for (int i = 0; i < kh; i++) {
                        const float *rowp = planes + (size_t)(oh * sh + i * dh) * ph.wq + ow0;
                        for (int j = 0; j < kw; j++) acc += wc[i * kw + j] * *(const vf *)(rowp + tap_off[j]);
                    }
                    float *dst = yc + (size_t)oh * ow_n + ow0;
                    if (ow_n - ow0 >= 16) {
                        *(vf *)dst = acc;
                    } else {
                        float out[16];
                        *(vf *)out = acc;
                        memcpy(dst, out, sizeof(float) * (size_t)(ow_n - ow0));
                    }
                }
        }
        free(planes);
    }
    if (bias)
        for (int c = 0; c < g->C; c++) {
            float *yc = y + (size_t)c * plane;
            for (size_t p = 0; p < plane; p++) yc[p] += bias[c];
        }
    epilogue(y, (int)(plane * g->C), &e, 0); /* res is laid out as y */
    return 0;
}

/* One-group 2-D convolution of one image: the window copy (C*KH*KW, OH*OW) into a scratch buffer (rows of
 * the channel's phase planes: zeros on padding), then W (M, C*KH*KW) times it with the bias per output
 * channel and the epilogue. Returns 1 when scratch cannot be allocated. */
HOT int ep_conv2d(const float *x, const float *w, const float *wt_given, const float *bias, float *y, const ConvGeom *g,
                  unsigned prog, const float *res, float alpha, float beta) {
    int taps = g->C * g->KH * g->KW, pixels = g->OH * g->OW;
    Phases ph = phase_shape(g);
    size_t n_planes = (size_t)g->SW * ph.hp * ph.wq;
    float *cols = malloc(sizeof(float) * ((size_t)taps * pixels + n_planes));
    if (!cols) return 1;
    float *planes = cols + (size_t)taps * pixels;
    for (int c = 0; c < g->C; c++) {
        fill_phases(x + (size_t)c * g->H * g->W, g, ph, planes);
        for (int i = 0; i < g->KH; i++)
            for (int j = 0; j < g->KW; j++) {
                float *row = cols + ((size_t)(c * g->KH + i) * g->KW + j) * pixels;
                int col = j * g->DW;
                for (int oh = 0; oh < g->OH; oh++) {
                    const float *src = planes + ((size_t)(col % g->SW) * ph.hp + oh * g->SH + i * g->DH) * ph.wq
                                       + col / g->SW;
                    memcpy(row + (size_t)oh * g->OW, src, sizeof(float) * (size_t)g->OW);
                }
            }
    }
    /* A narrow output (few pixels, more channels) goes through ep_gemm's transposed scheme, with the weights
     * transposed (taps x M): `wt_given` when the caller keeps them so (bound weights: ViT's patch embedding
     * transposed 48 KiB of weights at every call), else transposed here. */
    int narrow = pixels < NR && g->M > pixels;
    float *wt = narrow && !wt_given ? malloc(sizeof(float) * (size_t)taps * g->M) : NULL;
    if (wt)
        for (int m = 0; m < g->M; m++)
            for (int t = 0; t < taps; t++) wt[(size_t)t * g->M + m] = w[(size_t)m * taps + t];
    ep_gemm(w, narrow && wt_given ? wt_given : wt, cols, bias, bias ? 2 : 0, y, g->M, taps, pixels, prog, res, alpha,
            beta);
    free(wt);
    free(cols);
    return 0;
}

/* Squeeze-and-excitation over N images of C channels x HW pixels:
 * y = x * gate(W2 relu(W1 mean(x) + b1) + b2) per channel; W1 (R, C), W2 (C, R); b1, b2 may be NULL;
 * gate is EP_HARD_SIGMOID (alpha, beta) or EP_SIGMOID. Returns 1 when scratch cannot be allocated. */
HOT int ep_squeeze_excite(const float *x, float *y, int N, int C, int HW, const float *w1, const float *b1,
                          const float *w2, const float *b2, int R, unsigned gate, float alpha, float beta) {
    float *pooled = malloc(sizeof(float) * ((size_t)C * 2 + R));
    if (!pooled) return 1;
    float *g = pooled + C, *hid = g + C;
    for (int n = 0; n < N; n++) {
        const float *xn = x + (size_t)n * C * HW;
        float *yn = y + (size_t)n * C * HW;
        for (int c = 0; c < C; c++) {
            const float *xc = xn + (size_t)c * HW;
            pooled[c] = lane_sum(xc, HW) / (float)HW;
        }
        for (int r = 0; r < R; r++) {
            float s = lane_dot(w1 + (size_t)r * C, pooled, C);
            s += b1 ? b1[r] : 0.0f;
            hid[r] = s < 0.0f ? 0.0f : s;
        }
        for (int c = 0; c < C; c++) {
            g[c] = lane_dot(w2 + (size_t)c * R, hid, R) + (b2 ? b2[c] : 0.0f);
        }
        step(g, C, gate, NULL, alpha, beta);
        for (int c = 0; c < C; c++) {
            const float *xc = xn + (size_t)c * HW;
            float *yc = yn + (size_t)c * HW;
            float gc = g[c];
            for (int i = 0; i < HW; i++) yc[i] = xc[i] * gc;
        }
    }
    free(pooled);
    return 0;
}

/* float16 <-> float32 for the CPU EP's half-precision nodes (host/cpu_ep/half.py): NumPy converts an
 * element at a time (~3 ns each); with F16C (x86-64-v3) the compiler's _Float16 conversions are vector
 * instructions, IEEE round-to-nearest-even, NaN/Inf/subnormals as NumPy has them. Returns 0 when this
 * compiler has no _Float16 (the caller then uses NumPy), 1 when it converted. */
#ifdef __FLT16_MAX__
HOT int ep_f16_to_f32(const void *src, void *dst, int64_t n) {
    const _Float16 *s = src;
    float *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = (float)s[i];
    return 1;
}

HOT int ep_f32_to_f16(const void *src, void *dst, int64_t n) {
    const float *s = src;
    _Float16 *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = (_Float16)s[i];
    return 1;
}
#else
int ep_f16_to_f32(const void *src, void *dst, int64_t n) { (void)src; (void)dst; (void)n; return 0; }
int ep_f32_to_f16(const void *src, void *dst, int64_t n) { (void)src; (void)dst; (void)n; return 0; }
#endif
#include "kernels_rows.c" /* Softmax, LogSoftmax */
#include "kernels_gemm.c" /* the packed GEMM */
#include "kernels_attention.c" /* attention over whole heads */
#include "kernels_quant.c" /* the quantizing kernels' last step */
