/* A GEMM over a packed weight, for products too large for gemm_core's small tiles; #included at the end of
 * kernels.c (it uses its vf type, Epilogue and epilogue), hashed with it by build_info.
 *
 * B (K x N, a bound initializer) is packed once by ep_pack_b into panels of PNR columns: panel p holds
 * rows 0..K-1 of columns p*PNR.. as K contiguous rows of PNR floats (zero past N). The product walks K in
 * blocks of PKC rows (a block of one panel, PKC * PNR floats = 32 KiB, stays in L1 while every row tile of A
 * goes over it) and computes tiles of PMR rows x PNR columns with their 2 * PMR sums in vector registers
 * (24 of AVX-512's 32; the AVX2 clone spills some), each k step loading 2 vectors of B and broadcasting PMR
 * floats of A. The first K block stores its sums, the others add theirs; after the last one the tile gets
 * the bias and the epilogue program. Sums run in order over k within a block, blocks in order: each output
 * is the same in-order dot product at any M. */

#include "kernels_pool.c" /* the workers that share a product */

#define PNR 32
#define PMR 12
#define PKC 256
#define PMC 384 /* a multiple of PMR */

/* Packed size in floats of a K x N weight. */
int64_t ep_packed_b_size(int K, int N) { return (int64_t)K * ((N + PNR - 1) / PNR) * PNR; }

/* Element (k, n) of B at B[k * sk + n * sn]: (N, 1) for a row-major K x N weight, (1, K) for its transpose. */
void ep_pack_b(const float *B, float *Bp, int K, int N, int64_t sk, int64_t sn) {
    int panels = (N + PNR - 1) / PNR;
    for (int p = 0; p < panels; p++) {
        float *dst = Bp + (size_t)p * K * PNR;
        int j0 = p * PNR, cols = N - j0 < PNR ? N - j0 : PNR;
        for (int k = 0; k < K; k++) {
            float *row = dst + (size_t)k * PNR;
            for (int j = 0; j < PNR; j++) row[j] = j < cols ? B[k * sk + (j0 + j) * sn] : 0.0f;
        }
    }
}

/* acc (R x PNR, row stride ldc) (+)= A[rows, k0:k0+kc] @ Bp block; R is a constant where inlined. */
INLINE void packed_tile(const float *A, int lda, const float *Bp, int kc, float *C, int ldc, int R, int first,
                        int cols) {
    vf c[PMR][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = (vf){0};
    for (int k = 0; k < kc; k++) {
        vf b0 = *(const vf *)(Bp + (size_t)k * PNR), b1 = *(const vf *)(Bp + (size_t)k * PNR + 16);
        for (int r = 0; r < R; r++) {
            float a = A[(size_t)r * lda + k];
            c[r][0] += a * b0;
            c[r][1] += a * b1;
        }
    }
    if (cols == PNR) {
        for (int r = 0; r < R; r++) {
            vf *out = (vf *)(C + (size_t)r * ldc);
            if (first) {
                out[0] = c[r][0];
                out[1] = c[r][1];
            } else {
                out[0] += c[r][0];
                out[1] += c[r][1];
            }
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        float t[PNR];
        *(vf *)t = c[r][0];
        *(vf *)(t + 16) = c[r][1];
        float *out = C + (size_t)r * ldc;
        for (int j = 0; j < cols; j++) out[j] = first ? t[j] : out[j] + t[j];
    }
}

INLINE void packed_rows(const float *A, int lda, const float *Bp, int kc, float *C, int ldc, int R, int first,
                        int cols) {
    switch (R) { /* constant row counts: the sums stay in registers */
    case 12: packed_tile(A, lda, Bp, kc, C, ldc, 12, first, cols); break;
    case 8: packed_tile(A, lda, Bp, kc, C, ldc, 8, first, cols); break;
    case 4: packed_tile(A, lda, Bp, kc, C, ldc, 4, first, cols); break;
    case 2: packed_tile(A, lda, Bp, kc, C, ldc, 2, first, cols); break;
    default: packed_tile(A, lda, Bp, kc, C, ldc, 1, first, cols); break;
    }
}

typedef struct {
    const float *A, *Bp, *bias, *res;
    float *C;
    int M, K, N, p0, p1;
    unsigned prog;
    float alpha, beta;
} PackedJob;

/* Panels p0..p1-1 of C (their columns of every row): the whole product when they are all of them. */
INLINE void packed_panels(const PackedJob *j) {
    const float *A = j->A, *Bp = j->Bp, *bias = j->bias, *res = j->res;
    float *C = j->C;
    int M = j->M, K = j->K, N = j->N;
    for (int m0 = 0; m0 < M; m0 += PMC) { /* PMC rows of A's K block (384 KiB) stay in L2 over every panel */
        int mc = M - m0 < PMC ? M - m0 : PMC;
        for (int k0 = 0; k0 < K; k0 += PKC) {
            int kc = K - k0 < PKC ? K - k0 : PKC, first = k0 == 0, last = k0 + kc == K;
            for (int p = j->p0; p < j->p1; p++) {
                int j0 = p * PNR, cols = N - j0 < PNR ? N - j0 : PNR;
                const float *bp = Bp + (size_t)p * K * PNR + (size_t)k0 * PNR;
                for (int i0 = m0; i0 < m0 + mc;) {
                    int left = m0 + mc - i0;
                    int R = left >= 12 ? 12 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                    float *c = C + (size_t)i0 * N + j0;
                    packed_rows(A + (size_t)i0 * K + k0, K, bp, kc, c, N, R, first, cols);
                    if (last) {
                        Epilogue e = {j->prog, res ? res + j0 : NULL, (size_t)N, j->alpha, j->beta};
                        for (int r = 0; r < R; r++) {
                            float *row = c + (size_t)r * N;
                            if (bias)
                                for (int q = 0; q < cols; q++) row[q] += bias[j0 + q];
                            epilogue(row, cols, &e, (size_t)(i0 + r));
                        }
                    }
                    i0 += R;
                }
            }
        }
    }
}

/* The panels of one unit: units cut the panels into `units` near-equal runs. */
typedef struct {
    PackedJob whole;
    int units;
} PackedUnits;

HOT static void packed_unit(const void *arg, int unit) {
    const PackedUnits *u = arg;
    int panels = (u->whole.N + PNR - 1) / PNR;
    PackedJob j = u->whole;
    j.p0 = (int)((int64_t)panels * unit / u->units);
    j.p1 = (int)((int64_t)panels * (unit + 1) / u->units);
    packed_panels(&j);
}

#define PACKED_UNITS_PER_THREAD 4 /* small enough that a late worker's share is picked up by the others */
#define PACKED_UNIT_PANELS 2      /* at least: a unit reuses each block of A over its panels */

/* C (M x N) = prog(A (M x K) @ B + bias), B given packed (ep_pack_b); bias NULL or N floats; res as in
 * ep_gemm (laid out as C). `threads` > 1 lets up to threads-1 workers of the pool (kernels_pool.c) share
 * the product with the calling thread, in units of whole panels. Every output is computed by one thread in
 * the same order, so the result is the same at any thread count. */
HOT void ep_gemm_packed(const float *A, const float *Bp, const float *bias, float *C, int M, int K, int N,
                        unsigned prog, const float *res, float alpha, float beta, int threads) {
    int panels = (N + PNR - 1) / PNR;
    PackedUnits u = {{A, Bp, bias, res, C, M, K, N, 0, panels, prog, alpha, beta}, 1};
    if (threads > 1) {
        u.units = threads * PACKED_UNITS_PER_THREAD;
        if (u.units > panels / PACKED_UNIT_PANELS) u.units = panels / PACKED_UNIT_PANELS;
        if (u.units < 1) u.units = 1;
    }
    pool_run(packed_unit, &u, u.units, threads - 1);
}

/* Batched C[i] (M x N) = A[i] (M x K) @ B[i] (K x N) over `batch` products, as MatMul over stacked
 * matrices (attention's q k^T and p v, often strided views of a Split's or Transpose's output). Product i
 * has batch indices (i / inner, i % inner): A[i] at A + (i / inner) * sa1 + (i % inner) * sa2 with row
 * stride lda (its rows contiguous), B[i] likewise at sb1, sb2 with element (k, n) at k * bk + n * bn; C is
 * contiguous. A block or B block not laid out as gemm_core reads it (rows of K, of N) is first copied
 * into a contiguous scratch block. Each product is gemm_core's (the small tiles: the caller checked
 * native.gemm_fits per product). Returns 1 (nothing written) without scratch memory. */
HOT int ep_matmul_batched(const float *A, const float *B, float *C, int batch, int inner, int M, int K, int N,
                          int64_t sa1, int64_t sa2, int64_t lda, int64_t sb1, int64_t sb2, int64_t bk, int64_t bn) {
    int a_direct = lda == K, b_direct = bn == 1 && bk == N;
    float *scratch = malloc(sizeof(float) * ((a_direct ? 0 : (size_t)M * K) + (b_direct ? 0 : (size_t)K * N) + 1));
    if (!scratch) return 1;
    float *as = scratch, *bs = scratch + (a_direct ? 0 : (size_t)M * K);
    for (int i = 0; i < batch; i++) {
        const float *a = A + (i / inner) * sa1 + (i % inner) * sa2;
        const float *b = B + (i / inner) * sb1 + (i % inner) * sb2;
        if (!a_direct) {
            for (int m = 0; m < M; m++) memcpy(as + (size_t)m * K, a + m * lda, sizeof(float) * (size_t)K);
            a = as;
        }
        if (!b_direct) {
            if (bn == 1)
                for (int k = 0; k < K; k++) memcpy(bs + (size_t)k * N, b + k * bk, sizeof(float) * (size_t)N);
            else
                for (int n = 0; n < N; n++) /* reads along k: contiguous for a transposed view */
                    for (int k = 0; k < K; k++) bs[(size_t)k * N + n] = b[k * bk + n * bn];
            b = bs;
        }
        gemm_core(a, b, NULL, 0, C + (size_t)i * M * N, M, K, N);
    }
    free(scratch);
    return 0;
}

/* Consecutive layers (an MLP at a small batch, fusion_stack.py) in one call: layer l is ep_gemm over the
 * previous layer's output (the same product and epilogue program as the layer's own call), B (k[l] x n[l])
 * and bias (n[l], or 0 for none) at the addresses in w[l] and bias[l]. The layers between the first and
 * the last write to two scratch blocks in turn. Returns 1 (nothing written) when scratch cannot be had. */
HOT int ep_gemm_stack(int layers, const float *x, float *y, int rows, const int *k, const int *n, const int64_t *w,
                      const int64_t *bias, const unsigned *prog) {
    int widest = 1;
    for (int l = 0; l + 1 < layers; l++) widest = n[l] > widest ? n[l] : widest;
    float *scratch = malloc(sizeof(float) * (size_t)rows * (size_t)widest * 2);
    if (!scratch) return 1;
    const float *in = x;
    for (int l = 0; l < layers; l++) {
        float *out = l == layers - 1 ? y : scratch + (size_t)(l % 2) * rows * widest;
        const float *b = (const float *)(intptr_t)bias[l];
        ep_gemm(in, NULL, (const float *)(intptr_t)w[l], b, b ? 1 : 0, out, rows, k[l], n[l], prog[l], NULL, 0.0f,
                0.0f);
        in = out;
    }
    free(scratch);
    return 0;
}
