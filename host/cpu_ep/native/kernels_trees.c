/* Tree ensembles of ai.onnx.ml (host/cpu_ep/ops_ml_trees.py), #included at the end of
 * kernels_quant.c (so at the end of kernels.c, after the pool of kernels_gemm.c) and hashed with it by
 * build_info.
 *
 * ep_tree_leaves: the leaf each row reaches in each tree of a Forest (its flattened node table: per
 * node a feature, a float32 threshold, a mode code, the true and false next nodes, whether a missing
 * value goes the true way; leaves point to themselves). The same decisions as Forest._walk makes with
 * NumPy: comparisons in float32, NaN fails every comparison but NEQ, and goes the true way where the
 * node says so. Modes are ops_ml_trees.MODES' codes; the caller sends no BRANCH_MEMBER node (6) and
 * checked every feature id against the row width. ep_tree_sums adds the reached leaves' weights instead
 * (SUM and AVERAGE over float32 weights), tree after tree for each row (onnxruntime's order).
 *
 * One walk waits on each level's loads in turn; TREE_LANES rows walk a tree together, one step each in
 * turn, so that their loads overlap (as NumPy's cursor walk overlaps those of thousands of cursors); a
 * batch of fewer rows has TREE_LANES trees walk each row together instead.
 * Rows go in blocks of TREE_BLOCK: each block walks every tree (a tree's nodes stay in cache while its
 * rows walk it; a forest's whole table, hundreds of KB, does not), and with `threads` > 1 the pool
 * shares the blocks out. Every output is the one a single walk per (row, tree) computes. */

#define TREE_LANES 8
#define TREE_BLOCK 256

enum { TREE_LEQ, TREE_LT, TREE_GTE, TREE_GT, TREE_EQ, TREE_NEQ, TREE_MEMBER, TREE_LEAF };

typedef struct {
    const int64_t *feature;
    const float *threshold;
    const uint8_t *mode;
    const int64_t *true_next, *false_next;
    const uint8_t *missing_true;
} TreeNodes;

/* One step from interior node n (mode m) for the value v of the row. */
INLINE int64_t tree_next(const TreeNodes *t, int64_t n, uint8_t m, float v) {
    float th = t->threshold[n];
    int go;
    switch (m) {
    case TREE_LEQ: go = v <= th; break;
    case TREE_LT: go = v < th; break;
    case TREE_GTE: go = v >= th; break;
    case TREE_GT: go = v > th; break;
    case TREE_EQ: go = v == th; break;
    default: go = v != th; break; /* TREE_NEQ */
    }
    go |= t->missing_true[n] & (v != v);
    /* both loaded and masked: a branch on `go` here is mispredicted half the time on real data */
    int64_t yes = t->true_next[n], no = t->false_next[n];
    return no + ((yes - no) & -(int64_t)go);
}

/* The leaf `row` reaches from node n. */
INLINE int64_t tree_leaf(const TreeNodes *t, const float *row, int64_t n) {
    for (uint8_t m; (m = t->mode[n]) != TREE_LEAF;) n = tree_next(t, n, m, row[t->feature[n]]);
    return n;
}

/* leaf[r - r0] = the leaf rows r0..r1-1 reach from `root`, TREE_LANES rows at a time: `depth` steps each
 * (the tree's depth), without a test per step (a leaf steps to itself). */
static void tree_walk_rows(const TreeNodes *t, const float *x, int64_t width, int64_t r0, int64_t r1, int64_t root,
                           int64_t depth, int64_t *leaf) {
    int64_t r = r0;
    for (; r + TREE_LANES <= r1; r += TREE_LANES) {
        int64_t n[TREE_LANES];
        const float *row = x + r * width;
        for (int l = 0; l < TREE_LANES; l++) n[l] = root;
        for (int64_t d = 0; d < depth; d++)
            for (int l = 0; l < TREE_LANES; l++)
                n[l] = tree_next(t, n[l], t->mode[n[l]], row[l * width + t->feature[n[l]]]);
        for (int l = 0; l < TREE_LANES; l++) leaf[r + l - r0] = n[l];
    }
    for (; r < r1; r++) leaf[r - r0] = tree_leaf(t, x + r * width, root);
}

typedef struct {
    TreeNodes t;
    const float *x;
    int64_t rows, width, trees, targets;
    const int64_t *roots, *depths;
    const float *weights; /* NULL: leaves wanted */
    int64_t *leaves;
    float *sums;
} TreeJob;

/* The leaves or sums of row r: TREE_LANES trees walk it together (a batch too small for lanes of rows),
 * each for its own tree's depth at most; the weights are still added tree after tree. */
static void tree_row_by_tree_lanes(const TreeJob *j, int64_t r) {
    const float *row = j->x + r * j->width;
    float *out = j->weights ? j->sums + r * j->targets : NULL;
    int64_t i = 0;
    for (; i + TREE_LANES <= j->trees; i += TREE_LANES) {
        int64_t n[TREE_LANES], depth = 0;
        for (int l = 0; l < TREE_LANES; l++) {
            n[l] = j->roots[i + l];
            depth = j->depths[i + l] > depth ? j->depths[i + l] : depth;
        }
        for (int64_t d = 0; d < depth; d++) /* a lane past its tree's depth stays at its leaf */
            for (int l = 0; l < TREE_LANES; l++)
                n[l] = tree_next(&j->t, n[l], j->t.mode[n[l]], row[j->t.feature[n[l]]]);
        for (int l = 0; l < TREE_LANES; l++) {
            if (!out) {
                j->leaves[r * j->trees + i + l] = n[l];
                continue;
            }
            const float *w = j->weights + n[l] * j->targets;
            for (int64_t k = 0; k < j->targets; k++) out[k] += w[k];
        }
    }
    for (; i < j->trees; i++) {
        int64_t n = tree_leaf(&j->t, row, j->roots[i]);
        if (!out) {
            j->leaves[r * j->trees + i] = n;
            continue;
        }
        const float *w = j->weights + n * j->targets;
        for (int64_t k = 0; k < j->targets; k++) out[k] += w[k];
    }
}

static void tree_unit(const void *arg, int unit) {
    const TreeJob *j = (const TreeJob *)arg;
    int64_t r0 = (int64_t)unit * TREE_BLOCK, r1 = r0 + TREE_BLOCK < j->rows ? r0 + TREE_BLOCK : j->rows;
    int64_t leaf[TREE_BLOCK];
    if (j->weights)
        for (int64_t q = r0 * j->targets; q < r1 * j->targets; q++) j->sums[q] = 0.0f;
    if (r1 - r0 < TREE_LANES) {
        for (int64_t r = r0; r < r1; r++) tree_row_by_tree_lanes(j, r);
        return;
    }
    for (int64_t i = 0; i < j->trees; i++) {
        tree_walk_rows(&j->t, j->x, j->width, r0, r1, j->roots[i], j->depths[i], leaf);
        if (!j->weights) {
            for (int64_t r = r0; r < r1; r++) j->leaves[r * j->trees + i] = leaf[r - r0];
            continue;
        }
        for (int64_t r = r0; r < r1; r++) {
            const float *w = j->weights + leaf[r - r0] * j->targets;
            float *out = j->sums + r * j->targets;
            for (int64_t k = 0; k < j->targets; k++) out[k] += w[k];
        }
    }
}

static void tree_run(TreeJob *j, int threads) {
    int units = (int)((j->rows + TREE_BLOCK - 1) / TREE_BLOCK);
    pool_run(tree_unit, j, units, threads - 1);
}

void ep_tree_leaves(const float *x, int64_t rows, int64_t width, const int64_t *feature, const float *threshold,
                    const uint8_t *mode, const int64_t *true_next, const int64_t *false_next,
                    const uint8_t *missing_true, const int64_t *roots, const int64_t *depths, int64_t trees,
                    int64_t *leaves, int threads) {
    TreeJob j = {{feature, threshold, mode, true_next, false_next, missing_true}, x, rows, width, trees, 0, roots,
                 depths, NULL, leaves, NULL};
    tree_run(&j, threads);
}

/* sums[r, k] = the sum over trees of weights[leaf, k] (weights: nodes x targets, float32), added tree
 * after tree in float32 (onnxruntime's order) instead of the leaves. */
void ep_tree_sums(const float *x, int64_t rows, int64_t width, const int64_t *feature, const float *threshold,
                  const uint8_t *mode, const int64_t *true_next, const int64_t *false_next,
                  const uint8_t *missing_true, const int64_t *roots, const int64_t *depths, int64_t trees,
                  const float *weights, int64_t targets, float *sums, int threads) {
    TreeJob j = {{feature, threshold, mode, true_next, false_next, missing_true}, x, rows, width, trees, targets,
                 roots, depths, weights, NULL, sums};
    tree_run(&j, threads);
}

/* TreeEnsembleClassifier's two labels for the converters' binary models, untransformed
 * (ml_tree_classes._class0_only: every leaf scores class 0, at most one base value): ep_tree_sums into
 * scores (rows x 2: weights has two columns, the second all zero), then per row s = the class-0 sum
 * (+ *base), columns [1 - s, s] where every weight is >= 0 (label index s > 0.5), else [-s, s] (s > 0).
 * The same float32 operations as the NumPy finish; labels: the int64 labels (label_out gets labels[index])
 * or NULL (the index). */
void ep_tree_class0(const float *x, int64_t rows, int64_t width, const int64_t *feature, const float *threshold,
                    const uint8_t *mode, const int64_t *true_next, const int64_t *false_next,
                    const uint8_t *missing_true, const int64_t *roots, const int64_t *depths, int64_t trees,
                    const float *weights, const float *base, int all_positive, const int64_t *labels,
                    float *scores, int64_t *label_out, int threads) {
    ep_tree_sums(x, rows, width, feature, threshold, mode, true_next, false_next, missing_true, roots, depths, trees,
                 weights, 2, scores, threads);
    for (int64_t r = 0; r < rows; r++) {
        float *out = scores + 2 * r, s = out[0];
        if (base) s = s + *base;
        int64_t index = all_positive ? s > 0.5f : s > 0.0f; /* NaN: false, as NumPy's comparison */
        label_out[r] = labels ? labels[index] : index;
        out[0] = all_positive ? 1.0f - s : -s;
        out[1] = s;
    }
}

#include "kernels_ml.c" /* linear classifiers (and a Scaler before one) in one call */
