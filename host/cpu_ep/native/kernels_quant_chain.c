/* Quantized nodes in a row as one call (host/cpu_ep/quant_chain.py): at one row a quantized model's time is
 * the Python around each node, not its arithmetic. #included by kernels_quant.c, hashed with kernels.c by
 * build_info.
 *
 * A chain is a program of n_ops records, QC_WORDS int64 words each (the op code, then its operands, below)
 * and QC_FLOATS floats each. An operand is a reference: an absolute address (a constant the program holds:
 * centered weights, multipliers, tables) when below 2^56, else (slot + 1) << 56 | byte offset into one of
 * the call's buffers: slots 0..3 the chain's inputs, 4 its output, 5 the scratch that holds its inner
 * values. Every op does the NumPy path's operations in its order and precision (the chain's results are
 * the nodes' results bit for bit); quant_chain.py checks shapes, types and sizes when it writes the program.
 * Returns 0, or 1 when scratch memory is short (nothing usable written: the nodes then run one by one). */

#define QC_WORDS 32
#define QC_FLOATS 8
#define QC_SLOT_SHIFT 56

enum {
    QC_QUANTIZE = 1, /* x (float32), y, n, kind | scale, zp, lo, hi: ep_quantize's divide */
    QC_DEQUANTIZE,   /* x, x_kind, n, y (float32) | zp, scale: (float(x) - zp) * scale */
    QC_CONV,         /* see qc_conv */
    QC_MAXPOOL,      /* see qc_maxpool */
    QC_ADD,          /* a, a_kind, n, b, b_kind, period, y, y_kind | ratio_a, ratio_b, fixed, lo, hi */
    QC_GLOBAL_AVG,   /* x, x_kind, planes, size, zp_sum, y, y_kind | scale, y_zp, lo, hi */
    QC_MATMUL,       /* a, a_kind, M, K, a_zp, bc (int16), N, mult, y, y_kind, bias (int32) or 0 | y_zp, lo, hi */
    QC_SOFTMAX,      /* x, x_kind, rows, n, table, y, y_kind | steps, y_zp, lo, hi */
    QC_COPY,         /* x, y, bytes */
};

static inline void *qc_at(char *const *slots, int64_t ref) {
    const int64_t slot = ref >> QC_SLOT_SHIFT;
    if (!slot) return (void *)(intptr_t)ref;
    return slots[slot - 1] + (ref & (((int64_t)1 << QC_SLOT_SHIFT) - 1));
}

/* (float(x) - zp) * scale: DequantizeLinear per tensor (ops_quant.py: the cast, the subtraction, the product,
 * each in float32). */
static __attribute__((optimize("fp-contract=off"))) void qc_dequantize(const void *x, int kind, int64_t n, float *y,
                                                                      float zp, float scale) {
    for (int64_t i = 0; i < n; i++) y[i] = ((float)q8_at(x, kind, i) - zp) * scale;
}

/* QLinearConv of N images, one group after another: the window copy (im2col) of x minus its zero point as int16
 * (padding gives 0: the zero point, centered), the exact int32 product with the centered weights (M x K, K =
 * C/G * KH * KW), then per output channel float32(acc + bias) * mult[m], rounded half to even, plus the output
 * zero point, saturated (the NumPy path: an exact float accumulator, the bias added exactly, one rounding).
 * Words: x, x_kind, x_zp, w, bias (int32) or 0, mult, y, y_kind, N, C, H, W, M, KH, KW, SH, SW, PH, PW, DH, DW,
 * OH, OW, G. Floats: y_zp, lo, hi. */
static HOT __attribute__((optimize("fp-contract=off"))) int qc_conv(char *const *slots, const int64_t *w,
                                                              const float *f) {
    const void *x = qc_at(slots, w[1]);
    const int x_kind = (int)w[2];
    const int32_t x_zp = (int32_t)w[3];
    const int16_t *wts = qc_at(slots, w[4]);
    const int32_t *bias = w[5] ? qc_at(slots, w[5]) : NULL;
    const float *mult = qc_at(slots, w[6]);
    void *y = qc_at(slots, w[7]);
    const int y_kind = (int)w[8];
    const int64_t N = w[9], C = w[10], H = w[11], W = w[12], M = w[13], KH = w[14], KW = w[15], SH = w[16],
                  SW = w[17], PH = w[18], PW = w[19], DH = w[20], DW = w[21], OH = w[22], OW = w[23], G = w[24];
    const int64_t Cg = C / G, Mg = M / G, K = Cg * KH * KW, P = OH * OW;
    int16_t *col = malloc(sizeof(int16_t) * (size_t)(K * P + 1));
    int32_t *acc = malloc(sizeof(int32_t) * (size_t)(P + 1));
    if (!col || !acc) {
        free(col);
        free(acc);
        return 1;
    }
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < G; g++) {
            for (int64_t c = 0; c < Cg; c++) {
                const int64_t plane = (n * C + g * Cg + c) * H * W;
                for (int64_t kh = 0; kh < KH; kh++) {
                    for (int64_t kw = 0; kw < KW; kw++) {
                        int16_t *row = col + ((c * KH + kh) * KW + kw) * P;
                        for (int64_t oh = 0; oh < OH; oh++) {
                            const int64_t ih = oh * SH - PH + kh * DH;
                            for (int64_t ow = 0; ow < OW; ow++) {
                                const int64_t iw = ow * SW - PW + kw * DW;
                                const int inside = ih >= 0 && ih < H && iw >= 0 && iw < W;
                                row[oh * OW + ow] = inside ? (int16_t)(q8_at(x, x_kind, plane + ih * W + iw) - x_zp) : 0;
                            }
                        }
                    }
                }
            }
            for (int64_t mg = 0; mg < Mg; mg++) {
                const int64_t m = g * Mg + mg;
                const int16_t *wr = wts + m * K;
                for (int64_t p = 0; p < P; p++) acc[p] = 0;
                for (int64_t k = 0; k < K; k++) {
                    const int32_t wv = wr[k];
                    const int16_t *cr = col + k * P;
                    for (int64_t p = 0; p < P; p++) acc[p] += wv * (int32_t)cr[p];
                }
                const int64_t out = (n * M + m) * P;
                const int64_t b = bias ? bias[m] : 0;
                for (int64_t p = 0; p < P; p++)
                    q8_put(y, y_kind, out + p, rintf((float)((int64_t)acc[p] + b) * mult[m]) + f[0], f[1], f[2]);
            }
        }
    }
    free(col);
    free(acc);
    return 0;
}

/* MaxPool of 8-bit codes over planes of H x W: the largest code of each window's cells inside the image (the
 * padding never wins). Words: x, kind, planes, H, W, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW, y. */
static void qc_maxpool(char *const *slots, const int64_t *w) {
    const void *x = qc_at(slots, w[1]);
    const int kind = (int)w[2];
    const int64_t planes = w[3], H = w[4], W = w[5], KH = w[6], KW = w[7], SH = w[8], SW = w[9], PH = w[10],
                  PW = w[11], DH = w[12], DW = w[13], OH = w[14], OW = w[15];
    void *y = qc_at(slots, w[16]);
    for (int64_t c = 0; c < planes; c++) {
        for (int64_t oh = 0; oh < OH; oh++) {
            for (int64_t ow = 0; ow < OW; ow++) {
                int32_t top = kind == 0 ? -128 : 0;
                for (int64_t kh = 0; kh < KH; kh++) {
                    const int64_t ih = oh * SH - PH + kh * DH;
                    if (ih < 0 || ih >= H) continue;
                    for (int64_t kw = 0; kw < KW; kw++) {
                        const int64_t iw = ow * SW - PW + kw * DW;
                        if (iw < 0 || iw >= W) continue;
                        const int32_t v = q8_at(x, kind, (c * H + ih) * W + iw);
                        top = v > top ? v : top;
                    }
                }
                const int64_t i = (c * OH + oh) * OW + ow;
                if (kind == 0)
                    ((int8_t *)y)[i] = (int8_t)top;
                else
                    ((uint8_t *)y)[i] = (uint8_t)top;
            }
        }
    }
}

/* QLinearGlobalAveragePool (channels first): per plane the exact sum minus the zero point's share, then
 * float32(sum) * scale (x_scale / (y_scale * size) in float32), rounded half to even, plus the output zero
 * point, saturated. Words: x, x_kind, planes, size, zp_sum, y, y_kind. Floats: scale, y_zp, lo, hi. */
static __attribute__((optimize("fp-contract=off"))) void qc_global_avg(char *const *slots, const int64_t *w,
                                                                      const float *f) {
    const void *x = qc_at(slots, w[1]);
    const int kind = (int)w[2];
    const int64_t planes = w[3], size = w[4], zp_sum = w[5];
    void *y = qc_at(slots, w[6]);
    for (int64_t c = 0; c < planes; c++) {
        int64_t sum = 0;
        for (int64_t i = 0; i < size; i++) sum += q8_at(x, kind, c * size + i);
        q8_put(y, (int)w[7], c, rintf((float)(sum - zp_sum) * f[0]) + f[1], f[2], f[3]);
    }
}

static int qc_step(char *const *slots, const int64_t *w, const float *f) {
    switch (w[0]) {
    case QC_QUANTIZE:
        ep_quantize(qc_at(slots, w[1]), qc_at(slots, w[2]), w[3], 2, f[0], f[1], f[2], f[3], (int)w[4]);
        return 0;
    case QC_DEQUANTIZE:
        qc_dequantize(qc_at(slots, w[1]), (int)w[2], w[3], qc_at(slots, w[4]), f[0], f[1]);
        return 0;
    case QC_CONV:
        return qc_conv(slots, w, f);
    case QC_MAXPOOL:
        qc_maxpool(slots, w);
        return 0;
    case QC_ADD:
        ep_qlinear_add(qc_at(slots, w[1]), (int)w[2], w[3], qc_at(slots, w[4]), (int)w[5], w[6], f[0], f[1], f[2],
                       f[3], f[4], (int)w[8], qc_at(slots, w[7]));
        return 0;
    case QC_GLOBAL_AVG:
        qc_global_avg(slots, w, f);
        return 0;
    case QC_MATMUL:
        return qlinear_matmul_bias(qc_at(slots, w[1]), (int)w[2], w[3], (int)w[4], (int32_t)w[5],
                                   qc_at(slots, w[6]), (int)w[7], w[11] ? qc_at(slots, w[11]) : NULL,
                                   qc_at(slots, w[8]), f[0], f[1], f[2], (int)w[10], qc_at(slots, w[9]));
    case QC_SOFTMAX:
        return ep_qlinear_softmax(qc_at(slots, w[1]), (int)w[2], w[3], w[4], qc_at(slots, w[5]), f[0], f[1], f[2],
                                  f[3], (int)w[7], qc_at(slots, w[6]));
    case QC_COPY:
        memcpy(qc_at(slots, w[2]), qc_at(slots, w[1]), (size_t)w[3]);
        return 0;
    default:
        return 1;
    }
}

int ep_quant_chain(const void *prog, const void *fprog, int n_ops, const void *in0, const void *in1,
                   const void *in2, const void *in3, void *out, void *scratch) {
    char *const slots[6] = {(char *)in0, (char *)in1, (char *)in2, (char *)in3, (char *)out, (char *)scratch};
    const int64_t *words = prog;
    const float *floats = fprog;
    for (int i = 0; i < n_ops; i++)
        if (qc_step(slots, words + (int64_t)i * QC_WORDS, floats + (int64_t)i * QC_FLOATS)) return 1;
    return 0;
}
