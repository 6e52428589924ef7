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
#define QC_PIXELS 256 /* a convolution's block of output pixels */

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
    QC_DYNAMIC_QUANTIZE, /* x (float32), n, y (uint8), scale (float32), zp (uint8) */
    QC_BINARY,       /* see qc_binary */
    QC_RELU,         /* x, y, n (float32) */
    QC_CAST,         /* x, x_kind (0 int8, 1 uint8, 4 int32), n, y (float32) */
    QC_SOFTMAX_F32,  /* x, y, rows, n: ep_softmax */
    QC_DYNAMIC_MATMUL, /* a, M, K, bc (int16), N, b_scale, bias or 0, y: ep_dynamic_qmatmul */
    QC_MAXPOOL_F32,  /* qc_maxpool's words, then whether the windows tile the image (see qc_maxpool_f32) */
};

static inline void *qc_at(char *const *slots, int64_t ref) {
    const int64_t slot = ref >> QC_SLOT_SHIFT;
    if (!slot) return (void *)(intptr_t)ref;
    return slots[slot - 1] + (ref & (((int64_t)1 << QC_SLOT_SHIFT) - 1));
}

/* (float(x) - zp) * scale: DequantizeLinear per tensor (ops_quant.py: the cast, the subtraction, the product,
 * each in float32). */
static HOT __attribute__((optimize("fp-contract=off"))) void qc_dequantize(const void *x, int kind, int64_t n, float *y,
                                                                      float zp, float scale) {
    for (int64_t i = 0; i < n; i++) y[i] = ((float)q8_at(x, kind, i) - zp) * scale;
}

/* One output row of a window tap: dst[ow] = x[plane + ih * W + ow * SW + off] - x_zp where that cell is inside the
 * image, 0 (the zero point, centered) in the padding; the bounds worked out once per row, not per cell. */
static inline void im2col_row(const void *x, int kind, int32_t x_zp, int64_t plane, int64_t ih, int64_t H, int64_t W,
                              int64_t off, int64_t SW, int64_t OW, int16_t *dst) {
    int64_t lo = 0, hi = 0; /* the outputs [lo, hi) whose cell ow * SW + off is in [0, W) */
    if (ih >= 0 && ih < H) {
        lo = off < 0 ? (-off + SW - 1) / SW : 0;
        hi = W - off <= 0 ? 0 : (W - off + SW - 1) / SW;
        lo = lo < OW ? lo : OW;
        hi = hi < OW ? hi : OW;
        hi = hi > lo ? hi : lo;
    }
    for (int64_t ow = 0; ow < lo; ow++) dst[ow] = 0;
    const int64_t base = plane + ih * W + off; /* + ow * SW: in the image for ow in [lo, hi) */
    if (kind == 0 && SW == 1) /* unit strides apart: loops the compiler vectorizes */
        for (int64_t ow = lo; ow < hi; ow++) dst[ow] = (int16_t)(((const int8_t *)x)[base + ow] - x_zp);
    else if (SW == 1)
        for (int64_t ow = lo; ow < hi; ow++) dst[ow] = (int16_t)(((const uint8_t *)x)[base + ow] - x_zp);
    else if (kind == 0)
        for (int64_t ow = lo; ow < hi; ow++) dst[ow] = (int16_t)(((const int8_t *)x)[base + ow * SW] - x_zp);
    else
        for (int64_t ow = lo; ow < hi; ow++) dst[ow] = (int16_t)(((const uint8_t *)x)[base + ow * SW] - x_zp);
    for (int64_t ow = hi; ow < OW; ow++) dst[ow] = 0;
}

/* QLinearConv of N images, one group after another: the window copy (im2col) of x minus its zero point as int16
 * (padding gives 0: the zero point, centered), the exact int32 product with the centered weights (M x K, K =
 * C/G * KH * KW), then per output channel float32(acc + bias) * mult[m], rounded half to even, plus the output
 * zero point, saturated (the NumPy path: an exact float accumulator, the bias added exactly, one rounding).
 * Words: x, x_kind, x_zp, w, bias (int32) or 0, mult, y, y_kind, N, C, H, W, M, KH, KW, SH, SW, PH, PW, DH, DW,
 * OH, OW, G, and where x's zero point is a value of the chain (ConvInteger after DynamicQuantizeLinear) its place
 * (else 0). Floats: y_zp, lo, hi. y_kind 4: the int32 accumulator as it is (ConvInteger; no bias, no mult). */
static HOT __attribute__((optimize("fp-contract=off"))) int qc_conv(char *const *slots, const int64_t *w,
                                                              const float *f) {
    const void *x = qc_at(slots, w[1]);
    const int x_kind = (int)w[2];
    const int32_t x_zp = w[25] ? q8_at(qc_at(slots, w[25]), x_kind, 0) : (int32_t)w[3];
    const int16_t *wts = qc_at(slots, w[4]);
    const int32_t *bias = w[5] ? qc_at(slots, w[5]) : NULL;
    const float *mult = qc_at(slots, w[6]);
    void *y = qc_at(slots, w[7]);
    const int y_kind = (int)w[8];
    const int64_t N = w[9], C = w[10], H = w[11], W = w[12], M = w[13], KH = w[14], KW = w[15], SH = w[16],
                  SW = w[17], PH = w[18], PW = w[19], DH = w[20], DW = w[21], OH = w[22], OW = w[23], G = w[24];
    const int64_t Cg = C / G, Mg = M / G, K = Cg * KH * KW, P = OH * OW;
    int16_t *col = malloc(sizeof(int16_t) * (size_t)(K * P + 1));
    int32_t *acc = malloc(sizeof(int32_t) * (size_t)(Mg * QC_PIXELS));
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
                        for (int64_t oh = 0; oh < OH; oh++)
                            im2col_row(x, x_kind, x_zp, plane, oh * SH - PH + kh * DH, H, W, kw * DW - PW, SW, OW,
                                       row + oh * OW);
                    }
                }
            }
            /* QC_PIXELS output pixels at a time for every channel of the group: each piece of a window row is
             * read once for all of them while it is in L1 */
            for (int64_t p0 = 0; p0 < P; p0 += QC_PIXELS) {
                const int64_t pn = P - p0 < QC_PIXELS ? P - p0 : QC_PIXELS;
                for (int64_t i = 0; i < Mg * QC_PIXELS; i++) acc[i] = 0;
                for (int64_t k = 0; k < K; k++) {
                    const int16_t *cr = col + k * P + p0;
                    for (int64_t mg = 0; mg < Mg; mg++) {
                        const int32_t wv = wts[(g * Mg + mg) * K + k];
                        int32_t *ar = acc + mg * QC_PIXELS;
                        for (int64_t p = 0; p < pn; p++) ar[p] += wv * (int32_t)cr[p];
                    }
                }
                for (int64_t mg = 0; mg < Mg; mg++) {
                    const int64_t m = g * Mg + mg, out = (n * M + m) * P + p0;
                    const int32_t *ar = acc + mg * QC_PIXELS;
                    if (y_kind == 4) { /* ConvInteger: the accumulator itself */
                        memcpy((int32_t *)y + out, ar, sizeof(int32_t) * (size_t)pn);
                        continue;
                    }
                    const int64_t b = bias ? bias[m] : 0;
                    for (int64_t p = 0; p < pn; p++)
                        q8_put(y, y_kind, out + p, rintf((float)((int64_t)ar[p] + b) * mult[m]) + f[0], f[1], f[2]);
                }
            }
        }
    }
    free(col);
    free(acc);
    return 0;
}

/* MaxPool of 8-bit codes over planes of H x W: the largest code of each window's cells inside the image (the
 * padding never wins). Words: x, kind, planes, H, W, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW, y. */
#define QC_MAXPOOL_LOOP(T, LOWEST)                                                                            \
    for (int64_t c = 0; c < planes; c++) {                                                                   \
        const T *xp = (const T *)x + c * H * W;                                                              \
        T *yp = (T *)y + c * OH * OW;                                                                        \
        for (int64_t oh = 0; oh < OH; oh++) {                                                                \
            for (int64_t ow = 0; ow < OW; ow++) {                                                            \
                T top = LOWEST;                                                                              \
                for (int64_t kh = 0; kh < KH; kh++) {                                                        \
                    const int64_t ih = oh * SH - PH + kh * DH;                                               \
                    if (ih < 0 || ih >= H) continue;                                                         \
                    for (int64_t kw = 0; kw < KW; kw++) {                                                    \
                        const int64_t iw = ow * SW - PW + kw * DW;                                           \
                        if (iw < 0 || iw >= W) continue;                                                     \
                        const T v = xp[ih * W + iw];                                                         \
                        top = v > top ? v : top;                                                             \
                    }                                                                                        \
                }                                                                                            \
                yp[oh * OW + ow] = top;                                                                      \
            }                                                                                                \
        }                                                                                                    \
    }

static HOT void qc_maxpool(char *const *slots, const int64_t *w) {
    const void *x = qc_at(slots, w[1]);
    const int64_t planes = w[3], H = w[4], W = w[5], KH = w[6], KW = w[7], SH = w[8], SW = w[9], PH = w[10],
                  PW = w[11], DH = w[12], DW = w[13], OH = w[14], OW = w[15];
    void *y = qc_at(slots, w[16]);
    if (w[2] == 0) {
        QC_MAXPOOL_LOOP(int8_t, -128)
    } else {
        QC_MAXPOOL_LOOP(uint8_t, 0)
    }
}

/* np.maximum(a, b) on float32: b where they are equal (so max(-0, +0) is +0, max(+0, -0) is -0), a NaN of a
 * first, then of b. */
static inline float numpy_max(float a, float b) { return (a > b || a != a) ? a : b; }

/* MaxPool of float32 planes in the NumPy path's order of np.maximum (which decides a tie of -0 and +0 and which
 * NaN wins): where the windows tile the image (ops_pool._tile_max: kernel = strides, no padding, whole tiles)
 * each column of a window first, top to bottom, then the columns left to right; otherwise the window's taps
 * row by row over the image padded with -inf. Words: as qc_maxpool's, then the tiling flag. */
static HOT void qc_maxpool_f32(char *const *slots, const int64_t *w) {
    const float *x = qc_at(slots, w[1]);
    const int64_t planes = w[3], H = w[4], W = w[5], KH = w[6], KW = w[7], SH = w[8], SW = w[9], PH = w[10],
                  PW = w[11], DH = w[12], DW = w[13], OH = w[14], OW = w[15];
    float *y = qc_at(slots, w[16]);
    const int tiles = (int)w[17];
    for (int64_t c = 0; c < planes; c++) {
        const float *xp = x + c * H * W;
        for (int64_t oh = 0; oh < OH; oh++) {
            for (int64_t ow = 0; ow < OW; ow++) {
                float top = 0.0f;
                if (tiles) {
                    for (int64_t kw = 0; kw < KW; kw++) {
                        const float *cell = xp + (oh * KH) * W + ow * KW + kw;
                        float col = cell[0];
                        for (int64_t kh = 1; kh < KH; kh++) col = numpy_max(col, cell[kh * W]);
                        top = kw ? numpy_max(top, col) : col;
                    }
                } else {
                    for (int64_t kh = 0; kh < KH; kh++) {
                        const int64_t ih = oh * SH - PH + kh * DH;
                        for (int64_t kw = 0; kw < KW; kw++) {
                            const int64_t iw = ow * SW - PW + kw * DW;
                            const float v = ih >= 0 && ih < H && iw >= 0 && iw < W ? xp[ih * W + iw] : -INFINITY;
                            top = kh || kw ? numpy_max(top, v) : v;
                        }
                    }
                }
                y[(c * OH + oh) * OW + ow] = top;
            }
        }
    }
}

/* QLinearGlobalAveragePool (channels first): per plane the exact sum minus the zero point's share, then
 * float32(sum) * scale (x_scale / (y_scale * size) in float32), rounded half to even, plus the output zero
 * point, saturated. Words: x, x_kind, planes, size, zp_sum, y, y_kind. Floats: scale, y_zp, lo, hi. */
static HOT __attribute__((optimize("fp-contract=off"))) void qc_global_avg(char *const *slots, const int64_t *w,
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

/* DynamicQuantizeLinear: the scale and zero point of x's range (dynamic_params), x quantized to uint8 with them.
 * Returns 1 for a NaN or an infinity in x (the NumPy path decides those). */
static HOT __attribute__((optimize("fp-contract=off"))) int qc_dynamic_quantize(char *const *slots, const int64_t *w) {
    const float *x = qc_at(slots, w[1]);
    float scale, zp;
    if (dynamic_params(x, w[2], &scale, &zp)) return 1;
    ep_quantize(x, qc_at(slots, w[3]), w[2], 2, scale, zp, 0.0f, 255.0f, 1);
    *(float *)qc_at(slots, w[4]) = scale;
    *(uint8_t *)qc_at(slots, w[5]) = (uint8_t)zp;
    return 0;
}

/* Add (op 1) or Mul (op 2) of float32 a and b broadcast to y's dims (rank <= 6, each operand's element strides
 * per axis, 0 where it repeats): one IEEE operation per element, as NumPy's. Words: op, a, b, y, then dims[6],
 * a_strides[6], b_strides[6]. */
static HOT __attribute__((optimize("fp-contract=off"))) void qc_binary(char *const *slots, const int64_t *w) {
    const float *a = qc_at(slots, w[2]), *b = qc_at(slots, w[3]);
    float *y = qc_at(slots, w[4]);
    const int64_t *d = w + 5, *sa = w + 11, *sb = w + 17;
    const int add = w[1] == 1;
    int64_t i = 0;
    for (int64_t i0 = 0; i0 < d[0]; i0++)
        for (int64_t i1 = 0; i1 < d[1]; i1++)
            for (int64_t i2 = 0; i2 < d[2]; i2++)
                for (int64_t i3 = 0; i3 < d[3]; i3++)
                    for (int64_t i4 = 0; i4 < d[4]; i4++) {
                        const int64_t oa = i0 * sa[0] + i1 * sa[1] + i2 * sa[2] + i3 * sa[3] + i4 * sa[4];
                        const int64_t ob = i0 * sb[0] + i1 * sb[1] + i2 * sb[2] + i3 * sb[3] + i4 * sb[4];
                        for (int64_t i5 = 0; i5 < d[5]; i5++, i++) {
                            const float va = a[oa + i5 * sa[5]], vb = b[ob + i5 * sb[5]];
                            y[i] = add ? va + vb : va * vb;
                        }
                    }
}

/* np.maximum(x, 0) on float32: a NaN passes as it is, -0 gives +0 (NumPy's result on x86-64). */
static HOT void qc_relu(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];
        y[i] = (v > 0.0f || v != v) ? v : 0.0f;
    }
}

static HOT void qc_cast(const void *x, int kind, int64_t n, float *y) {
    if (kind == 4)
        for (int64_t i = 0; i < n; i++) y[i] = (float)((const int32_t *)x)[i];
    else
        for (int64_t i = 0; i < n; i++) y[i] = (float)q8_at(x, kind, i);
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
    case QC_MAXPOOL_F32:
        qc_maxpool_f32(slots, w);
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
    case QC_DYNAMIC_QUANTIZE:
        return qc_dynamic_quantize(slots, w);
    case QC_BINARY:
        qc_binary(slots, w);
        return 0;
    case QC_RELU:
        qc_relu(qc_at(slots, w[1]), qc_at(slots, w[2]), w[3]);
        return 0;
    case QC_CAST:
        qc_cast(qc_at(slots, w[1]), (int)w[2], w[3], qc_at(slots, w[4]));
        return 0;
    case QC_SOFTMAX_F32:
        ep_softmax(qc_at(slots, w[1]), qc_at(slots, w[2]), w[3], (int)w[4], 0);
        return 0;
    case QC_DYNAMIC_MATMUL:
        return ep_dynamic_qmatmul(qc_at(slots, w[1]), w[2], (int)w[3], qc_at(slots, w[4]), (int)w[5],
                                  qc_at(slots, w[6]), w[7] ? qc_at(slots, w[7]) : NULL, qc_at(slots, w[8]));
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
