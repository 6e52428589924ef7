/* Row-wise kernels over the last axis (Softmax, LogSoftmax), #included at the end of kernels.c: they
 * use its ep_exp and lane helpers, and build_info hashes this file with it. */

/* y = softmax(x) (log_form 0) or log_softmax(x) (1) over each of `rows` rows of n; y may be x.
 * Each row's maximum is taken first (exp(x - max) cannot overflow); a row holding NaN, +inf, or only
 * -inf gives NaN, as NumPy's x - max(x) makes it. The sum is divided, not multiplied by its inverse,
 * as the NumPy path does. */
HOT void ep_softmax(const float *x, float *y, int64_t rows, int n, int log_form) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * n;
        float *yi = y + i * n;
        float top = lane_max(xi, n);
        int has_nan = 0, j;
        for (j = 0; j < n; j++) has_nan |= xi[j] != xi[j];
        if (has_nan) top = NAN; /* the comparisons above skip NaN; NumPy's maximum keeps it */
        if (log_form) {
            float lsum[LANES] = {0};
            j = 0;
            for (; j + LANES <= n; j += LANES)
                for (int l = 0; l < LANES; l++) lsum[l] += ep_exp(xi[j + l] - top);
            for (; j < n; j++) lsum[0] += ep_exp(xi[j] - top);
            float shift = top + logf(lane_total(lsum));
            for (j = 0; j < n; j++) yi[j] = xi[j] - shift;
        } else {
            for (j = 0; j < n; j++) yi[j] = ep_exp(xi[j] - top);
            float total = lane_sum(yi, n);
            for (j = 0; j < n; j++) yi[j] /= total;
        }
    }
}

