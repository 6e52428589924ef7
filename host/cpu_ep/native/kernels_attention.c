/* Attention over whole heads; #included at the end of kernels.c (after kernels_gemm.c: it uses gemm_core,
 * ep_exp, lane_sum and the pool), hashed with it by build_info.
 *
 * softmax(q k^T * scale + mask [+ causal]) v for every (batch, head): per head, the scores as one small
 * GEMM, the softmax row by row, the weighted sum as a second GEMM (the GEMM tiles keep their sums in
 * registers; row-at-a-time loops were bound by stores). Heads are independent: with `threads` > 1 the pool
 * (kernels_pool.c) shares them out in units of whole heads, each unit with its own scratch, so every output
 * is the one the single-threaded loop computes.
 * Element (b, h, s, d) of q is q[b*qs[0] + h*qs[1] + s*qs[2] + d] (likewise k, v, y with their strides;
 * the feature axis is contiguous). mask: NULL, additive float (mask_kind 1) or boolean bytes
 * (mask_kind 2: true attends), element (b, h, s, t) at b*ms[0] + h*ms[1] + s*ms[2] + t*ms[3] (0 where it
 * broadcasts). causal: key t > query s is masked. A row with no attendable key gives zeros. */

typedef struct {
    const float *q, *k, *v;
    const void *mask;
    float *y;
    int mask_kind, B, H, S, T, D, DV, R, causal, units;
    const int64_t *qs, *ks, *vs, *ys, *ms;
    float scale;
    int prescaled; /* q was multiplied by scale as it was copied (no mask to add before the scale) */
    int failed; /* a unit could not allocate its scratch (atomic) */
} AttentionJob;

/* Scale, mask and causal part of one row of scores as whole-row loops (each vectorizes), then the softmax
 * (the maximum in lanes). */
INLINE void attention_row(const AttentionJob *j, float *p, int b, int h, int s) {
    int T = j->T;
    int64_t mo = b * j->ms[0] + h * j->ms[1] + s * j->ms[2];
    if (!j->prescaled)
        for (int t = 0; t < T; t++) p[t] *= j->scale;
    if (j->mask_kind == 1) {
        const float *mr = (const float *)j->mask + mo;
        if (j->ms[3] == 1)
            for (int t = 0; t < T; t++) p[t] += mr[t];
        else
            for (int t = 0; t < T; t++) p[t] += mr[0];
    } else if (j->mask_kind == 2) {
        const uint8_t *mr = (const uint8_t *)j->mask + mo;
        for (int t = 0; t < T; t++) p[t] = mr[t * j->ms[3]] ? p[t] : -INFINITY;
    }
    if (j->causal)
        for (int t = s + 1; t < T; t++) p[t] = -INFINITY;
    float top = lane_max(p, T);
    if (top == -INFINITY) { /* nothing to attend to: zeros */
        for (int t = 0; t < T; t++) p[t] = 0.0f;
        return;
    }
    for (int t = 0; t < T; t++) p[t] = ep_exp(p[t] - top); /* apart from the sum: it vectorizes */
    float inv = 1.0f / lane_sum(p, T); /* one division a row: vdivps over the row cost a sixth of the softmax */
    for (int t = 0; t < T; t++) p[t] *= inv;
}

/* Heads (b, h) numbered b * H + h in [bh0, bh1). R: query heads per key/value head (grouped-query
 * attention): query head h reads kv head h / R. Keys and value features are padded with zeros to whole
 * tiles (TP, DP columns): both GEMMs then run full tiles only; the padding scores are 0 and meet zero value
 * rows, so they add nothing. Returns 1 (nothing written) when scratch cannot be allocated. */
HOT static int attention_heads(const AttentionJob *j, int bh0, int bh1) {
    int S = j->S, T = j->T, D = j->D, DV = j->DV, H = j->H, R = j->R;
    int TP = (T + NR - 1) / NR * NR, DP = (DV + NR - 1) / NR * NR;
    size_t n = (size_t)S * D + (size_t)D * TP + (size_t)TP * DP + (size_t)S * TP + (size_t)S * DP;
    float *qh = malloc(n * sizeof(float));
    if (!qh) return 1;
    float *kt = qh + (size_t)S * D, *vh = kt + (size_t)D * TP, *sc = vh + (size_t)TP * DP, *yh = sc + (size_t)S * TP;
    /* Only the padding must be zero (the copies below write the rest for every head): key columns T..TP
     * of kt, and value rows T..TP and columns DV..DP of vh. Zeroing all of the scratch (calloc) cost more
     * than a head's two GEMMs at seq 128. */
    if (TP > T)
        for (int d = 0; d < D; d++) memset(kt + (size_t)d * TP + T, 0, sizeof(float) * (size_t)(TP - T));
    if (TP > T || DP > DV) memset(vh, 0, sizeof(float) * (size_t)TP * DP);
    const int64_t *qs = j->qs, *ks = j->ks, *vs = j->vs, *ys = j->ys;
    for (int bh = bh0; bh < bh1; bh++) {
        int b = bh / H, h = bh % H;
        for (int s = 0; s < S; s++) {
            const float *qr = j->q + b * qs[0] + h * qs[1] + s * qs[2];
            float *qd = qh + (size_t)s * D;
            if (j->prescaled)
                for (int d = 0; d < D; d++) qd[d] = qr[d] * j->scale;
            else
                memcpy(qd, qr, sizeof(float) * (size_t)D);
        }
        const float *kb = j->k + b * ks[0] + (h / R) * ks[1];
        /* k^T in blocks of 16 keys x 16 features: reads and writes stay within a few cache lines each */
        for (int t0 = 0; t0 < T; t0 += 16)
            for (int d0 = 0; d0 < D; d0 += 16) {
                int t1 = t0 + 16 < T ? t0 + 16 : T, d1 = d0 + 16 < D ? d0 + 16 : D;
                for (int d = d0; d < d1; d++)
                    for (int t = t0; t < t1; t++) kt[(size_t)d * TP + t] = kb[t * ks[2] + d];
            }
        for (int t = 0; t < T; t++)
            memcpy(vh + (size_t)t * DP, j->v + b * vs[0] + (h / R) * vs[1] + t * vs[2], sizeof(float) * (size_t)DV);
        gemm_core(qh, kt, NULL, 0, sc, S, D, TP);
        for (int s = 0; s < S; s++) attention_row(j, sc + (size_t)s * TP, b, h, s);
        gemm_core(sc, vh, NULL, 0, yh, S, TP, DP);
        for (int s = 0; s < S; s++)
            memcpy(j->y + b * ys[0] + h * ys[1] + s * ys[2], yh + (size_t)s * DP, sizeof(float) * (size_t)DV);
    }
    free(qh);
    return 0;
}

static void attention_unit(const void *arg, int unit) {
    AttentionJob *j = (AttentionJob *)arg;
    int heads = j->B * j->H;
    if (attention_heads(j, (int)((int64_t)heads * unit / j->units), (int)((int64_t)heads * (unit + 1) / j->units)))
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
}

/* The whole attention (above), on the calling thread and up to threads-1 pool workers. Returns 1 when a
 * unit's scratch could not be allocated (the output is then incomplete: the caller takes its own path). */
HOT int ep_attention(const float *q, const float *k, const float *v, const void *mask, int mask_kind, float *y,
                     int B, int H, int S, int T, int D, int DV, int R, const int64_t *qs, const int64_t *ks,
                     const int64_t *vs, const int64_t *ys, const int64_t *ms, float scale, int causal, int threads) {
    /* The scale goes into the copy of q (one pass fewer per row of scores) where it is a power of two, so
     * that (q * scale) . k is exactly (q . k) * scale; other scales multiply the scores as before. */
    int exponent;
    int prescaled = frexpf(scale, &exponent) == 0.5f;
    AttentionJob j = {q, k, v, mask, y, mask_kind, B, H, S, T, D, DV, R, causal, 1, qs, ks, vs, ys, ms, scale,
                      prescaled, 0};
    if (threads > 1) j.units = threads * 2 < B * H ? threads * 2 : B * H;
    if (j.units < 1) j.units = 1;
    pool_run(attention_unit, &j, j.units, threads - 1);
    return j.failed;
}
