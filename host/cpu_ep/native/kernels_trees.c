/* Tree ensembles of ai.onnx.ml (host/cpu_ep/ops_ml_trees.py), #included at the end of
 * kernels_rows.c (so at the end of kernels.c) and hashed with it by build_info.
 *
 * ep_tree_leaves: the leaf each row reaches in each tree of a Forest (its flattened node table: per
 * node a feature, a float32 threshold, a mode code, the true and false next nodes, whether a missing
 * value goes the true way; leaves point to themselves). The same decisions as Forest._walk makes with
 * NumPy: comparisons in float32, NaN fails every comparison but NEQ, and goes the true way where the
 * node says so. Modes are ops_ml_trees.MODES' codes; the caller sends no BRANCH_MEMBER node (6) and
 * checked every feature id against the row width. Each (row, tree) is one walk down from the root,
 * which at one row replaces the NumPy path's dozen array operations per level. ep_tree_sums adds the
 * reached leaves' weights instead (SUM and AVERAGE over float32 weights). One walk waits on each
 * level's loads in turn, where NumPy's cursor walk overlaps those of thousands of cursors: the caller
 * sends batches up to _COMPILED_MAX_ROWS rows only. */

enum { TREE_LEQ, TREE_LT, TREE_GTE, TREE_GT, TREE_EQ, TREE_NEQ, TREE_MEMBER, TREE_LEAF };

typedef struct {
    const int64_t *feature;
    const float *threshold;
    const uint8_t *mode;
    const int64_t *true_next, *false_next;
    const uint8_t *missing_true;
} TreeNodes;

/* The leaf `row` reaches from node n. */
INLINE int64_t tree_leaf(const TreeNodes *t, const float *row, int64_t n) {
    for (;;) {
        uint8_t m = t->mode[n];
        if (m == TREE_LEAF) return n;
        float v = row[t->feature[n]], th = t->threshold[n];
        int go;
        switch (m) {
        case TREE_LEQ: go = v <= th; break;
        case TREE_LT: go = v < th; break;
        case TREE_GTE: go = v >= th; break;
        case TREE_GT: go = v > th; break;
        case TREE_EQ: go = v == th; break;
        default: go = v != th; break; /* TREE_NEQ */
        }
        go |= t->missing_true[n] && v != v;
        n = go ? t->true_next[n] : t->false_next[n];
    }
}

void ep_tree_leaves(const float *x, int64_t rows, int64_t width, const int64_t *feature, const float *threshold,
                    const uint8_t *mode, const int64_t *true_next, const int64_t *false_next,
                    const uint8_t *missing_true, const int64_t *roots, int64_t trees, int64_t *leaves) {
    TreeNodes t = {feature, threshold, mode, true_next, false_next, missing_true};
    /* tree after tree, every row through it: a tree's nodes stay in cache while the rows walk it (a
     * forest's whole table, hundreds of KB, does not) */
    for (int64_t i = 0; i < trees; i++)
        for (int64_t r = 0; r < rows; r++) leaves[r * trees + i] = tree_leaf(&t, x + r * width, roots[i]);
}

/* sums[r, k] = the sum over trees of weights[leaf, k] (weights: nodes x targets, float32), added tree
 * after tree in float32 (onnxruntime's order) instead of the leaves. */
void ep_tree_sums(const float *x, int64_t rows, int64_t width, const int64_t *feature, const float *threshold,
                  const uint8_t *mode, const int64_t *true_next, const int64_t *false_next,
                  const uint8_t *missing_true, const int64_t *roots, int64_t trees, const float *weights,
                  int64_t targets, float *sums) {
    TreeNodes t = {feature, threshold, mode, true_next, false_next, missing_true};
    for (int64_t j = 0; j < rows * targets; j++) sums[j] = 0.0f;
    for (int64_t i = 0; i < trees; i++) /* tree-major, as ep_tree_leaves; each row's sum still goes tree by tree */
        for (int64_t r = 0; r < rows; r++) {
            const float *w = weights + tree_leaf(&t, x + r * width, roots[i]) * targets;
            float *out = sums + r * targets;
            for (int64_t k = 0; k < targets; k++) out[k] += w[k];
        }
}
