/* The end of every quantizing kernel (ops_quant.Saturate): y = saturate(rint(x op scale) + zero_point)
 * in one pass over float32 values, instead of five NumPy calls; #included at the end of kernels.c, hashed
 * with it by build_info.
 *
 * The operations are NumPy's, in its order and in float32: x * scale or x / scale (op 1 or 2; 0: none),
 * rounding half to even (rintf in the default rounding mode, as np.rint), the zero point added, the result
 * clamped to [lo, hi] and converted. A NaN gives 0, as NumPy's conversion of a NaN gives on x86-64 for
 * these types. kind: 0 int8, 1 uint8, 2 int16, 3 uint16 (the bounds are exact in float32 for each). */

#define QUANT_LOOP(T)                                                                                         \
    for (int64_t i = 0; i < n; i++) {                                                                        \
        float v = x[i];                                                                                      \
        if (op == 1)                                                                                         \
            v = v * scale;                                                                                   \
        else if (op == 2)                                                                                    \
            v = v / scale;                                                                                   \
        v = rintf(v) + zero_point;                                                                           \
        v = v < lo ? lo : v > hi ? hi : v;                                                                   \
        ((T *)y)[i] = v == v ? (T)v : (T)0;                                                                  \
    }

HOT void ep_quantize(const float *x, void *y, int64_t n, int op, float scale, float zero_point, float lo, float hi,
                     int kind) {
    switch (kind) {
    case 0: QUANT_LOOP(int8_t) break;
    case 1: QUANT_LOOP(uint8_t) break;
    case 2: QUANT_LOOP(int16_t) break;
    default: QUANT_LOOP(uint16_t) break;
    }
}

/* acc[n] = sum_k qa[k] * bc[k * N + n]: one row of the small integer GEMMs below, exact in int32 (|qa| and
 * |bc| <= 255). */
static inline void int_row_product(const int32_t *qa, const int16_t *bc, int K, int N, int32_t *acc) {
    for (int n = 0; n < N; n++) acc[n] = 0;
    for (int k = 0; k < K; k++) {
        const int32_t q = qa[k];
        const int16_t *br = bc + (size_t)k * N;
        for (int n = 0; n < N; n++) acc[n] += q * (int32_t)br[n];
    }
}

/* DynamicQuantizeLinear's scale and zero point of the count values at a (the range including 0, in float32, as
 * the NumPy path computes them); 1 (nothing written) for a NaN or an infinity. */
static HOT __attribute__((optimize("fp-contract=off"))) int dynamic_params(const float *a, int64_t count,
                                                                           float *scale_out, float *zp_out) {
    float lo = 0.0f, hi = 0.0f;
    for (int64_t i = 0; i < count; i++) {
        const float v = a[i];
        if (v != v) return 1;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    const float range = hi - lo;
    if (!isfinite(range)) return 1;
    float scale = range / 255.0f, zp = 0.0f;
    if (scale == 0.0f) {
        scale = 1.0f; /* an all-zero A: any scale maps it to the zero point */
    } else {
        zp = rintf(-(lo / scale));
        zp = zp < 0.0f ? 0.0f : zp > 255.0f ? 255.0f : zp;
    }
    *scale_out = scale;
    *zp_out = zp;
    return 0;
}

/* DynamicQuantizeMatMul (ops_quant_ms.py) in one call, for small products where NumPy's per-call costs are
 * most of the time: A (M x K) quantized to uint8 as DynamicQuantizeLinear does (the range including 0, the
 * scale (hi - lo) / 255 and the zero point rint(-lo / scale) clamped to [0, 255], in float32: the NumPy
 * path's operations, which ops_quant.dynamic_params reproduces in doubles), then the exact integer product with the
 * centered B (K x N, B minus its zero point, int16), then y = float(acc) * (a_scale * b_scale[n]) + bias[n].
 * No FMA contraction: the scale's product and the bias's sum are two roundings, as in NumPy. Returns 1
 * (nothing written) when A holds a NaN or an infinity (the NumPy path gives what NumPy gives) or memory is
 * short. */
HOT __attribute__((optimize("fp-contract=off"))) int ep_dynamic_qmatmul(
    const float *a, int64_t M, int K, const int16_t *bc, int N, const float *b_scale, const float *bias, float *y) {
    float scale, zp;
    if (dynamic_params(a, M * (int64_t)K, &scale, &zp)) return 1;
    int32_t *buf = malloc(sizeof(int32_t) * ((size_t)K + (size_t)N));
    if (!buf) return 1;
    int32_t *qa = buf, *acc = buf + K;
    for (int64_t m = 0; m < M; m++) {
        const float *ar = a + m * K;
        for (int k = 0; k < K; k++) {
            float q = rintf(ar[k] / scale) + zp;
            q = q < 0.0f ? 0.0f : q > 255.0f ? 255.0f : q;
            qa[k] = (int32_t)q - (int32_t)zp;
        }
        int_row_product(qa, bc, K, N, acc);
        float *yr = y + m * N;
        for (int n = 0; n < N; n++) {
            const float v = (float)acc[n] * (scale * b_scale[n]);
            yr[n] = bias ? v + bias[n] : v;
        }
    }
    free(buf);
    return 0;
}

/* An 8-bit value of kind 0 (int8) or 1 (uint8) at x[i], as an int32. */
static inline int32_t q8_at(const void *x, int kind, int64_t i) {
    return kind == 0 ? (int32_t)((const int8_t *)x)[i] : (int32_t)((const uint8_t *)x)[i];
}

/* v (rounded and offset by the caller) clamped to [lo, hi] and stored as kind 0 (int8) or 1 (uint8) at y[i]:
 * ep_quantize's end for one value (a NaN gives 0). */
static inline void q8_put(void *y, int kind, int64_t i, float v, float lo, float hi) {
    v = v < lo ? lo : v > hi ? hi : v;
    if (kind == 0)
        ((int8_t *)y)[i] = v == v ? (int8_t)v : 0;
    else
        ((uint8_t *)y)[i] = v == v ? (uint8_t)v : 0;
}

/* QLinearMatMul (ops_quant.py) for small products in one call: A (M x K, int8 or uint8, a per-tensor zero
 * point) times the centered B (K x N int16: B minus its zero point), the exact int32 sums, then the NumPy
 * path's requantization: float(acc) * multiplier[n] (a_scale * b_scale / y_scale in float32), rounded half to
 * even, plus the output zero point, saturated; QGemm's int32 bias (a quantized chain's) added to acc first.
 * Returns 1 (nothing written) when memory is short. */
static HOT __attribute__((optimize("fp-contract=off"))) int qlinear_matmul_bias(
    const void *a, int a_kind, int64_t M, int K, int32_t a_zp, const int16_t *bc, int N, const int32_t *bias,
    const float *mult, float y_zp, float lo, float hi, int y_kind, void *y) {
    int32_t *buf = malloc(sizeof(int32_t) * ((size_t)K + (size_t)N));
    if (!buf) return 1;
    int32_t *qa = buf, *acc = buf + K;
    for (int64_t m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) qa[k] = q8_at(a, a_kind, m * K + k) - a_zp;
        int_row_product(qa, bc, K, N, acc);
        for (int n = 0; n < N; n++) {
            /* with a bias: float32 of the exact sum (the NumPy path adds it in float64, then rounds once) */
            const float v = bias ? (float)((int64_t)acc[n] + bias[n]) : (float)acc[n];
            q8_put(y, y_kind, m * N + n, rintf(v * mult[n]) + y_zp, lo, hi);
        }
    }
    free(buf);
    return 0;
}

HOT int ep_qlinear_matmul(const void *a, int a_kind, int64_t M, int K, int32_t a_zp, const int16_t *bc, int N,
                          const float *mult, float y_zp, float lo, float hi, int y_kind, void *y) {
    return qlinear_matmul_bias(a, a_kind, M, K, a_zp, bc, N, NULL, mult, y_zp, lo, hi, y_kind, y);
}

/* com.microsoft QLinearAdd (ops_quant_ms.py) in one pass, MLAS's form in the NumPy path's order:
 * ((float(a) * ratio_a + fixed) + float(b) * ratio_b), rounded half to even, saturated (the output zero point
 * is inside `fixed`). B repeats with period `b_period` along A's elements (the same shape: n; a bias over the
 * last axis: its length). */
HOT __attribute__((optimize("fp-contract=off"))) void ep_qlinear_add(
    const void *a, int a_kind, int64_t n, const void *b, int b_kind, int64_t b_period, float ratio_a, float ratio_b,
    float fixed, float lo, float hi, int y_kind, void *y) {
    /* B's period at a time: no division per element (8 channels of 32x32: 29 -> 7 us) */
    for (int64_t start = 0; start < n; start += b_period) {
        const int64_t end = start + b_period < n ? start + b_period : n;
        for (int64_t i = start; i < end; i++) {
            const float va = (float)q8_at(a, a_kind, i) * ratio_a + fixed;
            const float vb = (float)q8_at(b, b_kind, i - start) * ratio_b;
            q8_put(y, y_kind, i, rintf(va + vb), lo, hi);
        }
    }
}

/* NumPy's float32 sum of n contiguous values (its pairwise_sum: a plain loop under 8 values, eight running
 * sums up to 128, halves above), so that a sum here has the bits of `x.sum(axis=-1)` over a contiguous row. */
static float numpy_pairwise_sum(const float *a, int64_t n) {
    if (n < 8) {
        float res = -0.0f;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return numpy_pairwise_sum(a, n2) + numpy_pairwise_sum(a + n2, n - n2);
}

/* com.microsoft QLinearSoftmax (ops_quant_ms.py) over the last axis of `rows` contiguous rows of n 8-bit codes,
 * in the NumPy path's float32 operations: e = table[max code - code] (exp(-d * x_scale)), p = e * steps / sum(e),
 * rounded half to even, plus the output zero point, saturated. Returns 1 (nothing written) when memory is
 * short. */
HOT __attribute__((optimize("fp-contract=off"))) int ep_qlinear_softmax(
    const void *x, int x_kind, int64_t rows, int64_t n, const float *table, float steps, float y_zp, float lo,
    float hi, int y_kind, void *y) {
    float *e = malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (!e) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * n;
        int32_t top = q8_at(x, x_kind, base);
        for (int64_t i = 1; i < n; i++) {
            const int32_t c = q8_at(x, x_kind, base + i);
            top = c > top ? c : top;
        }
        for (int64_t i = 0; i < n; i++) e[i] = table[top - q8_at(x, x_kind, base + i)];
        const float total = numpy_pairwise_sum(e, n);
        for (int64_t i = 0; i < n; i++) q8_put(y, y_kind, base + i, rintf(e[i] * steps / total) + y_zp, lo, hi);
    }
    free(e);
    return 0;
}

#include "kernels_quant_chain.c" /* quantized nodes in a row as one call */

#include "kernels_trees.c" /* tree ensembles: after kernels_gemm.c, whose pool shares their rows out */
