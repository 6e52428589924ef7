/* Tree ensembles of ai.onnx.ml (host/cpu_ep/ops_ml_trees.py), #included at the end of
 * kernels_rows.c (so at the end of kernels.c) and hashed with it by build_info.
 *
 * ep_tree_leaves: the leaf each row reaches in each tree of a Forest (its flattened node table: per
 * node a feature, a float32 threshold, a mode code, the true and false next nodes, whether a missing
 * value goes the true way; leaves point to themselves). The same decisions as Forest._walk makes with
 * NumPy: comparisons in float32, NaN fails every comparison but NEQ, and goes the true way where the
 * node says so. Modes are ops_ml_trees.MODES' codes; the caller sends no BRANCH_MEMBER node (6) and
 * checked every feature id against the row width. Each (row, tree) is one walk down from the root,
 * which at one row replaces the NumPy path's dozen array operations per level. */

enum { TREE_LEQ, TREE_LT, TREE_GTE, TREE_GT, TREE_EQ, TREE_NEQ, TREE_MEMBER, TREE_LEAF };

void ep_tree_leaves(const float *x, int64_t rows, int64_t width, const int64_t *feature, const float *threshold,
                    const uint8_t *mode, const int64_t *true_next, const int64_t *false_next,
                    const uint8_t *missing_true, const int64_t *roots, int64_t trees, int64_t *leaves) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * width;
        for (int64_t t = 0; t < trees; t++) {
            int64_t n = roots[t];
            for (;;) {
                uint8_t m = mode[n];
                if (m == TREE_LEAF) break;
                float v = row[feature[n]], th = threshold[n];
                int go;
                switch (m) {
                case TREE_LEQ: go = v <= th; break;
                case TREE_LT: go = v < th; break;
                case TREE_GTE: go = v >= th; break;
                case TREE_GT: go = v > th; break;
                case TREE_EQ: go = v == th; break;
                default: go = v != th; break; /* TREE_NEQ */
                }
                go |= missing_true[n] && v != v;
                n = go ? true_next[n] : false_next[n];
            }
            leaves[r * trees + t] = n;
        }
    }
}
