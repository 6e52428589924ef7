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

#include "kernels_trees.c" /* tree ensembles: after kernels_gemm.c, whose pool shares their rows out */
