/* Linear classifiers of ai.onnx.ml in one call (host/cpu_ep/ops_ml_linear.py, and a Scaler before one:
 * host/cpu_ep/ml_chain.py). #included at the end of kernels_trees.c, hashed with kernels.c by build_info.
 *
 * At one row a scaler + logistic regression pipeline costs a few multiply-adds; its time was the Python
 * around each NumPy step (the scaling, the GEMM's pointers, the label's comparison and gather, the two score
 * columns). ep_ml_linear does those steps with the same float32 operations in the same order: the Scaler's
 * (x - offset) * scale, the GEMM by ep_gemm itself (the LinearClassifier kernel's compiled GEMM), then the
 * binary model's label and score columns, so its results are the nodes' results bit for bit. The post
 * transforms (exp) stay with NumPy: its float32 exp is not the C library's. */

/* What ep_ml_linear writes after the GEMM (ops_ml_linear.LinearClassifier's cases). */
enum {
    ML_SCORES,       /* the (rows, n) scores; no label (the caller's post transform and argmax follow) */
    ML_ONE_MINUS,    /* n == 1, the score s: columns [1 - s, s], label index s > 0 */
    ML_NEGATED,      /* n == 2, the GEMM gives [-s, s] (negated coefficients): as they are, label index s > 0 */
    ML_NEGATED_FLIP, /* as ML_NEGATED, written negated ([s, -s]): the first step of the caller's logistic */
    ML_SCORES_FLIP,  /* as ML_SCORES, written negated (the same first step) */
};

#define ML_STACK_FLOATS 4096 /* scratch on the stack up to this many floats (16 KB), else malloc */

/* The rows [r0, r1)'s labels and score columns from their GEMM output g (rows x n). */
static void ml_finish(const float *g, int64_t r0, int64_t r1, int mode, const int64_t *labels, float *scores,
                      int64_t *label_out) {
    for (int64_t r = r0; r < r1; r++) {
        const float *gr = g + (r - r0) * (mode == ML_ONE_MINUS ? 1 : 2);
        float *out = scores + 2 * r;
        float s = mode == ML_ONE_MINUS ? gr[0] : gr[1];
        int64_t index = s > 0.0f; /* NaN: false, labels[0], as NumPy's comparison */
        label_out[r] = labels ? labels[index] : index;
        if (mode == ML_ONE_MINUS) {
            out[0] = 1.0f - s;
            out[1] = s;
        } else if (mode == ML_NEGATED_FLIP) {
            out[0] = -gr[0];
            out[1] = -gr[1];
        }
    }
}

/* scores (and label_out) of rows x (k features) through a linear classifier: coef (k x n), intercepts (n).
 * offset / scale, when offset is given: a Scaler first, (x - offset) * scale in float32, each a vector over
 * the features (step 1) or one value (step 0). `block`: rows per GEMM (the kernel's native.gemm_fits
 * blocks). labels: the int64 class labels (label_out gets labels[index]), or NULL (label_out gets the index).
 * The GEMM writes straight into scores but in ML_ONE_MINUS (one column in, two out). Returns 0, or 1 when
 * scratch memory is short (nothing usable written: the caller runs its NumPy path). */
int ep_ml_linear(const float *x, int64_t rows, int k, const float *offset, int offset_step, const float *scale,
                 int scale_step, const float *coef, const float *intercepts, int n, int64_t block, int mode,
                 const int64_t *labels, float *scores, int64_t *label_out) {
    if (block < 1) block = 1;
    if (block > rows) block = rows;
    const int64_t scaled = offset ? block * k : 0, gemm_out = mode == ML_ONE_MINUS ? block : 0;
    float stack[ML_STACK_FLOATS], *buf = stack;
    if (scaled + gemm_out > ML_STACK_FLOATS) {
        buf = malloc(sizeof(float) * (size_t)(scaled + gemm_out));
        if (!buf) return 1;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t r1 = r0 + block < rows ? r0 + block : rows, m = r1 - r0;
        const float *a = x + r0 * k;
        if (offset) {
            for (int64_t i = 0; i < m; i++)
                for (int j = 0; j < k; j++)
                    buf[i * k + j] = (a[i * k + j] - offset[j * offset_step]) * scale[j * scale_step];
            a = buf;
        }
        float *g = mode == ML_ONE_MINUS ? buf + scaled : scores + r0 * n;
        ep_gemm(a, NULL, coef, intercepts, 1, g, (int)m, k, n, 0, NULL, 0.0f, 0.0f);
        if (mode == ML_SCORES_FLIP)
            for (int64_t i = 0; i < m * n; i++) g[i] = -g[i];
        else if (mode != ML_SCORES)
            ml_finish(g, r0, r1, mode, labels, scores, label_out);
    }
    if (buf != stack) free(buf);
    return 0;
}

/* LOGISTIC's last steps over e = exp(-scores) (NumPy's exp, between ep_ml_linear and this call; rows x n,
 * n > 1): e = 1 / (e + 1) in place (logistic_in_place's add and reciprocal), then label_out[r] = labels[the
 * row's argmax] as NumPy's argmax picks it: the first maximum, or the first NaN. */
void ep_ml_logistic_labels(float *e, int64_t rows, int n, const int64_t *labels, int64_t *label_out) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = e + r * n;
        for (int j = 0; j < n; j++) row[j] = 1.0f / (row[j] + 1.0f);
        int best = 0;
        for (int j = 1; j < n && row[best] == row[best]; j++)
            if (row[j] > row[best] || row[j] != row[j]) best = j;
        label_out[r] = labels[best];
    }
}
