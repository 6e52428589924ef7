"""Tree ensembles of ai.onnx.ml: TreeEnsembleClassifier, TreeEnsembleRegressor (1..3) and
TreeEnsemble (5).

Every tree of a node is flattened into one table of nodes (leaves point to themselves), so the walk
is vectorized over rows and trees at once: one step moves every (row, tree) cursor one level down,
for as many steps as the deepest tree has levels. No Python loop runs per row or per tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel
from host.cpu_ep.ml_common import POST_TRANSFORMS, class_labels, post_transform
from host.cpu_ep.ml_tree_classes import ClassRules, many_labels, two_labels
from host.cpu_ep.registry import register
from host.runtime import threads

ML = "ai.onnx.ml"
MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "BRANCH_MEMBER", "LEAF")
_LEAF = 7
_MEMBER = 6
_BLOCK = 1 << 16  # (row, tree) cursors walked at once
# Up to this many (row, node) decisions, all nodes are decided at once (_decided) instead of walked.
_DECIDE_ALL_CELLS = 1 << 16
_COMPARE = (np.less_equal, np.less, np.greater_equal, np.greater, np.equal, np.not_equal)
# Rows per thread of the compiled walk: below, a worker's start costs more than its share saves.
_ROWS_PER_THREAD = 512


def _threads(rows: int) -> int:
    """Threads for a compiled walk over `rows` rows: the run's bound (threads.POOLS), one per _ROWS_PER_THREAD."""
    if rows < 2 * _ROWS_PER_THREAD:
        return 1  # the common small batch: without asking the pools
    return max(1, min(threads.POOLS.share(), rows // _ROWS_PER_THREAD))


@dataclass
class Forest:
    """The flattened trees: per node its feature, threshold, mode code (MODES), children and
    whether a missing value (NaN) goes the true way; `weights` (nodes, targets) is zero except at
    leaves, `has_weight` marks the (leaf, target) pairs the model names (for MIN/MAX)."""

    feature: np.ndarray
    threshold: np.ndarray
    mode: np.ndarray
    true_next: np.ndarray
    false_next: np.ndarray
    missing_true: np.ndarray
    roots: np.ndarray
    weights: np.ndarray
    has_weight: np.ndarray
    members: dict  # node index -> array of member values (BRANCH_MEMBER)
    depth: int = 0

    def __post_init__(self):
        self.depth = _depth(self)
        branch = self.mode[self.mode != _LEAF]
        self.single_mode = int(branch[0]) if branch.size and (branch == branch[0]).all() else -1
        self.any_missing_true = bool(self.missing_true.any())
        self.thresholds32 = self.threshold.astype(np.float32)
        self.children = np.stack([self.true_next, self.false_next], axis=1).reshape(-1).astype(np.intp)
        self.feature = self.feature.astype(np.intp)
        self.roots = self.roots.astype(np.intp)
        # One comparison serves every node (_decided); feature ids are checked there against the row width.
        self.decide_all = 0 <= self.single_mode != _MEMBER and not (self.feature < 0).any()
        self._by_feature = _ByFeature.of(self) if self.decide_all else None
        self._compiled = _CompiledWalk.of(self)

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """(rows, trees) indices of the leaf each row reaches in each tree: the compiled walk where it
        serves (float32 rows wide enough, no MEMBER splits), else NumPy's (`_numpy_leaves`)."""
        walked = self._compiled.leaves(x) if self._compiled is not None else None
        return walked if walked is not None else self._numpy_leaves(x)

    def scores(self, x: np.ndarray, how: str) -> np.ndarray:
        """aggregate(leaves(x), how), summed in C where it serves (SUM, AVERAGE over float32 weights)."""
        if how in ("SUM", "AVERAGE") and self._compiled is not None:
            sums = self._compiled.sums(x)
            if sums is not None:
                return sums / len(self.roots) if how == "AVERAGE" else sums
        return self.aggregate(self.leaves(x), how)

    def _numpy_leaves(self, x: np.ndarray) -> np.ndarray:
        """Forest.leaves in NumPy: in blocks of rows small enough for the cursors to stay in cache."""
        n = x.shape[0]
        if self.decide_all and n * len(self.mode) <= _DECIDE_ALL_CELLS:
            return self._decided(x)
        out = np.empty((n, len(self.roots)), dtype=np.intp)
        step = max(1, _BLOCK // max(1, len(self.roots)))
        for start in range(0, n, step):
            out[start:start + step] = self._walk(x[start:start + step])
        return out

    def _decided(self, x: np.ndarray) -> np.ndarray:
        """The walk for a few rows (batch 1): every interior node's branch is decided for each row in
        a few array operations, then each level costs one gather of the cursors (a walk of the
        cursors alone costs about eight small operations per level, which dominate at one row).
        The nodes are renumbered (`_ByFeature`): interior nodes by feature, so each row's values
        per node are one np.repeat of its features rather than a gather, then the leaves."""
        order = self._by_feature
        if x.shape[1] < order.width:
            return self._walk(x)  # too few features: the walk raises its own error
        values = np.repeat(x[:, :order.counts.size], order.counts, axis=1)  # (rows, interior nodes)
        thresholds = order.thresholds32 if x.dtype == np.float32 else order.thresholds
        go_true = _COMPARE[self.single_mode](values, thresholds)
        if self.any_missing_true:
            go_true |= order.missing_true & np.isnan(values)
        # the next node per (row, node); leaves (after the interior nodes) point to themselves
        chosen = np.where(go_true, order.true_next, order.false_next)
        idx = order.roots
        if x.shape[0] == 1:
            following = np.concatenate([chosen[0], order.leaves])
            for _ in range(self.depth):
                idx = following.take(idx)
            return order.nodes.take(idx)[None, :]
        following = np.concatenate([chosen, np.broadcast_to(order.leaves, (x.shape[0], order.leaves.size))], axis=1)
        row_base = (np.arange(x.shape[0], dtype=np.intp) * following.shape[1])[:, None]
        flat = following.reshape(-1)
        for _ in range(self.depth):
            idx = flat.take(row_base + idx)
        return order.nodes.take(idx)

    def _walk(self, x: np.ndarray) -> np.ndarray:
        n, width = x.shape
        idx = np.repeat(self.roots[None, :], n, axis=0)
        row_base = (np.arange(n, dtype=np.intp) * width)[:, None]
        flat = np.ascontiguousarray(x).reshape(-1)
        thresholds = self.thresholds32 if x.dtype == np.float32 else self.threshold
        for _ in range(self.depth):
            values = flat.take(row_base + self.feature.take(idx))
            go_true = self._compare(values, thresholds.take(idx), idx)
            if self.any_missing_true:
                go_true |= self.missing_true.take(idx) & np.isnan(values)
            # children[2 * node] is the true child, children[2 * node + 1] the false one.
            idx = self.children.take(2 * idx + ~go_true)
        return idx

    def _compare(self, values, thresholds, idx) -> np.ndarray:
        if self.single_mode >= 0 and self.single_mode != _MEMBER:
            return _COMPARE[self.single_mode](values, thresholds)
        modes = self.mode[idx]
        out = np.zeros(values.shape, dtype=bool)
        for code in np.unique(modes):
            where = modes == code
            if code == _MEMBER:
                out[where] = [v in self.members[i] for v, i in zip(values[where], idx[where])]
            elif code != _LEAF:
                out[where] = _COMPARE[code](values[where], thresholds[where])
        return out

    def aggregate(self, leaves: np.ndarray, how: str) -> np.ndarray:
        """(rows, targets) float64 scores from the reached leaves: SUM, AVERAGE, MIN or MAX over trees."""
        if how in ("SUM", "AVERAGE"):
            # take: cheaper to call than fancy indexing, which dominates at one row
            if self.weights.shape[1] == 1:
                scores = self.weights.reshape(-1).take(leaves).sum(axis=1)[:, None]
            else:
                scores = self.weights.take(leaves, axis=0).sum(axis=1)
            return scores / len(self.roots) if how == "AVERAGE" else scores
        w, has = self.weights[leaves], self.has_weight[leaves]
        fill = np.inf if how == "MIN" else -np.inf
        pick = np.where(has, w, fill)
        scores = pick.min(axis=1) if how == "MIN" else pick.max(axis=1)
        return np.where(has.any(axis=1), scores, 0.0)


class _CompiledWalk:
    """Forest.leaves through the CPU kernels library (ep_tree_leaves, native/kernels_trees.c): one
    walk per (row, tree) in C, the same decisions as Forest._walk. The node table is kept in the types
    the C function reads; `width` is the row width the NumPy walk needs (it reads every node's
    feature, leaves' included), so narrower rows go to NumPy and get its error."""

    def __init__(self, forest: Forest):
        self.arrays = [np.ascontiguousarray(a, dtype=t) for a, t in (
            (forest.feature, np.int64), (forest.thresholds32, np.float32), (forest.mode, np.uint8),
            (forest.true_next, np.int64), (forest.false_next, np.int64), (forest.missing_true, np.uint8),
            (forest.roots, np.int64), (_tree_depths(forest), np.int64))]
        # weights summed by ep_tree_sums: float32 ones only (those of ai.onnx.ml 1-3's float lists)
        self.weights = np.ascontiguousarray(forest.weights) if forest.weights.dtype == np.float32 else None
        self.arrays += [] if self.weights is None else [self.weights]
        self.pointers = [native.ptr(a) for a in self.arrays]  # constant: made once, not per run
        self.trees = len(forest.roots)
        # The constant middle of each call's arguments (the node table, roots, depths, tree count, weights)
        self._table = (*self.pointers[:8], self.trees)
        self._weights = () if self.weights is None else (self.pointers[8], self.weights.shape[1])
        self.width = int(forest.feature.max()) + 1 if forest.feature.size else 0

    @classmethod
    def of(cls, forest: Forest) -> _CompiledWalk | None:
        if (forest.mode == _MEMBER).any() or (forest.feature < 0).any() or not forest.roots.size:
            return None
        try:
            return cls(forest)
        except ValueError:  # a cycle: the NumPy walk reports it
            return None

    def leaves(self, x: np.ndarray) -> np.ndarray | None:
        lib = native.LIB
        if lib is None or x.dtype != np.float32 or x.shape[1] < self.width:
            return None
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        rows = x.shape[0]
        out = np.empty((rows, self.trees), dtype=np.int64)
        ptr = native.ptr
        lib.ep_tree_leaves(ptr(x), rows, x.shape[1], *self._table, ptr(out), _threads(rows))
        return out

    def sums(self, x: np.ndarray) -> np.ndarray | None:
        """(rows, targets) float32 sums of the reached leaves' weights, added tree by tree; None where
        the compiled walk does not serve."""
        lib = native.LIB
        if lib is None or self.weights is None or x.dtype != np.float32 or x.shape[1] < self.width:
            return None
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        rows = x.shape[0]
        out = np.empty((rows, self._weights[1]), dtype=np.float32)
        ptr = native.ptr
        lib.ep_tree_sums(ptr(x), rows, x.shape[1], *self._table, *self._weights, ptr(out), _threads(rows))
        return out

    def class0(self, x: np.ndarray, finish: tuple) -> tuple[np.ndarray, np.ndarray]:
        """(label indices or int64 labels, float32 scores) of TreeEnsembleClassifier's class-0-only binary
        models (ep_tree_class0, the sums and _class0_only's finish in one call) for float32 C-contiguous rows
        at least `width` wide; `finish`: (base pointer or NULL, all weights >= 0, int64 labels or NULL)."""
        rows = x.shape[0]
        scores = np.empty((rows, 2), dtype=np.float32)
        labels = np.empty(rows, dtype=np.int64)
        ptr = native.ptr
        native.LIB.ep_tree_class0(ptr(x), rows, x.shape[1], *self._table, self._weights[0], *finish, ptr(scores),
                                  ptr(labels), _threads(rows))
        return labels, scores


@dataclass
class _ByFeature:
    """The forest's nodes renumbered for Forest._decided: the interior nodes in order of their
    feature (stable), then the leaves. Node `i` here is `nodes[i]` of the forest; `counts[f]`
    interior nodes read feature f; thresholds, missing directions and children (in the new
    numbering) are per interior node; `leaves` holds the leaves' new numbers; `width`: the features
    a row needs (as the walk reads them, leaves included)."""

    nodes: np.ndarray
    counts: np.ndarray
    thresholds: np.ndarray
    thresholds32: np.ndarray
    missing_true: np.ndarray
    true_next: np.ndarray
    false_next: np.ndarray
    roots: np.ndarray
    leaves: np.ndarray
    width: int

    @classmethod
    def of(cls, forest: Forest) -> _ByFeature:
        interior = np.flatnonzero(forest.mode != _LEAF)
        interior = interior[np.argsort(forest.feature[interior], kind="stable")]
        nodes = np.concatenate([interior, np.flatnonzero(forest.mode == _LEAF)])
        new_id = np.empty_like(nodes)
        new_id[nodes] = np.arange(nodes.size)
        counts = np.bincount(forest.feature[interior], minlength=1) if interior.size else np.zeros(0, np.intp)
        width = int(forest.feature.max()) + 1 if forest.feature.size else 0
        return cls(nodes, counts, forest.threshold[interior], forest.thresholds32[interior],
                   forest.missing_true[interior], new_id[forest.true_next[interior]],
                   new_id[forest.false_next[interior]], new_id[forest.roots],
                   np.arange(interior.size, nodes.size, dtype=np.intp), width)


def _tree_depths(forest: Forest) -> np.ndarray:
    """Per tree, the interior nodes on its longest path from the root: the steps of the compiled walk
    (a leaf steps to itself, so a shorter path just stays at its leaf). A cycle is a model error."""
    depths = np.zeros(len(forest.roots), dtype=np.int64)
    nodes, owner = forest.roots, np.arange(len(forest.roots))
    level, limit = 0, len(forest.mode) + 1
    while True:
        inner = forest.mode[nodes] != _LEAF
        nodes, owner = nodes[inner], owner[inner]
        if nodes.size == 0:
            return depths
        level += 1
        if level > limit:
            raise ValueError("the trees have a cycle (a node is its own descendant)")
        depths[owner] = level
        pairs = np.unique(np.stack([np.concatenate([owner, owner]),
                                    np.concatenate([forest.true_next[nodes], forest.false_next[nodes]])]), axis=1)
        owner, nodes = pairs[0], pairs[1]


def _depth(forest: Forest) -> int:
    """Levels of the deepest tree, walking all trees level by level; a cycle is a model error."""
    frontier, depth = forest.roots, 0
    limit = len(forest.mode) + 1
    while True:
        frontier = frontier[forest.mode[frontier] != _LEAF]
        if frontier.size == 0:
            return depth
        depth += 1
        if depth > limit:
            raise ValueError("the trees have a cycle (a node is its own descendant)")
        frontier = np.unique(np.concatenate([forest.true_next[frontier], forest.false_next[frontier]]))


def _tensor_or_list(kernel: OpKernel, name: str, default=None):
    """An attribute given as a list of floats or, from opset 3, as `name`_as_tensor (doubles)."""
    tensor = kernel.attr(name + "_as_tensor", None)
    if tensor is not None:
        return np.asarray(tensor, dtype=np.float64).reshape(-1)
    value = kernel.attr(name, default)
    return None if value is None else np.asarray(value, dtype=np.float64)


def forest_v1(kernel: OpKernel, prefix: str, n_targets: int) -> Forest:
    """The Forest of TreeEnsembleClassifier/Regressor attributes (`prefix` 'class' or 'target')."""
    tree_ids = np.asarray(kernel.attr_ints("nodes_treeids"), dtype=np.int64)
    node_ids = np.asarray(kernel.attr_ints("nodes_nodeids"), dtype=np.int64)
    n = len(tree_ids)
    keys = tree_ids * (int(node_ids.max(initial=0)) + 1) + node_ids
    stride = int(node_ids.max(initial=0)) + 1
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    if np.unique(keys).size != n:
        raise kernel.bad_attr("nodes_nodeids", "repeated (tree, node) ids", "one entry per (tree id, node id)")

    def locate(trees, nodes, what):
        k = np.asarray(trees, dtype=np.int64) * stride + np.asarray(nodes, dtype=np.int64)
        pos = np.searchsorted(sorted_keys, k).clip(0, n - 1)
        if not (sorted_keys[pos] == k).all():
            raise kernel.bad_attr(what, "an id of no node", "ids of nodes listed in nodes_nodeids")
        return order[pos]

    modes_attr = kernel.attr("nodes_modes")
    bad = sorted(set(modes_attr) - set(MODES))
    if bad:
        raise kernel.bad_attr("nodes_modes", bad, "one of " + ", ".join(MODES))
    mode = np.asarray([MODES.index(m) for m in modes_attr], dtype=np.uint8)
    leaf = mode == _LEAF
    index = np.arange(n)
    true_next = np.where(leaf, index, locate(tree_ids, np.where(leaf, node_ids, kernel.attr_ints("nodes_truenodeids")),
                                             "nodes_truenodeids"))
    false_next = np.where(leaf, index, locate(tree_ids, np.where(leaf, node_ids,
                                                                 kernel.attr_ints("nodes_falsenodeids")),
                                              "nodes_falsenodeids"))
    missing = kernel.attr_ints("nodes_missing_value_tracks_true", None) or [0] * n
    # A tree's root is its first node in the list, as onnxruntime takes it.
    _, first = np.unique(tree_ids, return_index=True)
    roots = np.sort(first)
    weights = np.zeros((n, n_targets))
    has = np.zeros((n, n_targets), dtype=bool)
    w_nodes = locate(kernel.attr_ints(prefix + "_treeids"), kernel.attr_ints(prefix + "_nodeids"), prefix + "_nodeids")
    w_targets = np.asarray(kernel.attr_ints(prefix + "_ids"), dtype=np.int64)
    if w_targets.size and (w_targets.min() < 0 or w_targets.max() >= n_targets):
        raise kernel.bad_attr(prefix + "_ids", int(w_targets.max()), f"ids in [0, {n_targets})")
    np.add.at(weights, (w_nodes, w_targets), _tensor_or_list(kernel, prefix + "_weights"))
    has[w_nodes, w_targets] = True
    if kernel.attr(prefix + "_weights_as_tensor", None) is None:
        weights = weights.astype(np.float32)  # onnxruntime sums float weights in float32 (labels at 0.5 hinge on it)
    return Forest(np.asarray(kernel.attr_ints("nodes_featureids"), dtype=np.int64),
                  _tensor_or_list(kernel, "nodes_values", [0.0] * n), mode, true_next, false_next,
                  np.asarray(missing, dtype=bool), roots, weights, has, {})


def _base_values(kernel: OpKernel) -> np.ndarray | None:
    """base_values in onnxruntime's type: float32 as a list of floats, float64 as a tensor."""
    base = _tensor_or_list(kernel, "base_values")
    if base is None or kernel.attr("base_values_as_tensor", None) is not None:
        return base
    return base.astype(np.float32)


def _features(x: np.ndarray) -> np.ndarray:
    """Rows of features: a vector is one row; integers are compared as floats."""
    x = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


@register("TreeEnsembleRegressor", domain=ML, since=1, until=4)
class TreeEnsembleRegressor(OpKernel):
    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.n_targets = self.attr_int("n_targets", 1, lo=1)
        self.aggregate = self.attr_str("aggregate_function", "SUM", choices=("SUM", "AVERAGE", "MIN", "MAX"))
        self.post = self.attr_str("post_transform", "NONE", choices=POST_TRANSFORMS)
        self.forest = forest_v1(self, "target", self.n_targets)
        self.base = _base_values(self)

    def _run(self, x):
        x = _features(x)
        scores = self.forest.scores(x, self.aggregate)
        if self.base is not None:
            scores = scores + self.base
        return (post_transform(self.post, scores).astype(np.float32),)


@register("TreeEnsembleClassifier", domain=ML, since=1, until=4)
class TreeEnsembleClassifier(OpKernel):
    """Scores per class, then labels and scores by onnxruntime's rules (ml_tree_classes: its
    conventions for two labels, base values and classes no reached leaf names)."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.labels = class_labels(self)
        if self.labels is None:
            raise self.bad_attr("classlabels_int64s", None, "classlabels_int64s or classlabels_strings")
        self.post = self.attr_str("post_transform", "NONE", choices=POST_TRANSFORMS)
        n_classes = max(len(self.labels), 2)
        self.forest = forest_v1(self, "class", n_classes)
        self.base = _base_values(self)
        self.rules = ClassRules.of(self.labels, self.post, self.base, self.attr_ints("class_ids"),
                                   _tensor_or_list(self, "class_weights"), self.forest.has_weight,
                                   self.forest.mode == _LEAF)
        self._class0 = self._class0_call()

    def _class0_call(self) -> tuple | None:
        """ep_tree_class0's last arguments where it serves this model, else None: the converters' binary
        forests and boosting (ml_tree_classes._class0_only's case) untransformed, over float32 weights and
        at most one float32 base value. At one row, the finish's NumPy steps cost as much as the walk."""
        rules, compiled = self.rules, self.forest._compiled
        if (compiled is None or compiled.weights is None or compiled.weights.shape[1] != 2 or self.post != "NONE"
                or len(self.labels) != 2 or not rules.binary_case or rules.scored[:2] != [True, False]):
            return None
        if self.base is not None and (self.base.size != 1 or self.base.dtype != np.float32):
            return None
        base = native.NULL if self.base is None else native.ptr(self.base)
        table = native.ptr(self.labels) if self.labels.dtype == np.int64 else native.NULL
        return (base, int(rules.all_positive), table)

    def _run(self, x):
        finish = self._class0
        if (finish is not None and native.LIB is not None and type(x) is np.ndarray and x.dtype == native.F32
                and x.ndim == 2 and x.shape[0] and x.shape[1] >= self.forest._compiled.width and x.flags.c_contiguous):
            labels, scores = self.forest._compiled.class0(x, finish)
            return (labels if self.labels.dtype != object else self.labels.take(labels), scores)
        x = _features(x)
        if self.rules.row_free:  # which classes a row scores is the model's: no leaves needed
            sums, scored = self.forest.scores(x, "SUM"), self.rules.scored
        else:
            leaves = self.forest.leaves(x)
            sums = self.forest.aggregate(leaves, "SUM")
            scored = [self.rules.has(c, self.forest.has_weight, leaves) for c in range(len(self.labels))]
        if len(self.labels) == 1:
            return self._one_label(sums)
        if len(self.labels) == 2:
            return two_labels(self.rules, sums, scored[0], scored[1])
        return many_labels(self.rules, sums, scored)

    def _one_label(self, scores):
        """One label: the second column stands for "not it"."""
        if self.base is not None:
            scores = scores + (self.base if self.base.size > 1 else self.base[0])
        scores = post_transform(self.post, scores)
        labels = np.where(scores.argmax(axis=1) == 1, self.labels[0], 0)
        return (labels, scores.astype(np.float32))


AGGREGATES_V5 = ("AVERAGE", "SUM", "MIN", "MAX")
POST_TRANSFORMS_V5 = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")


def forest_v5(kernel: OpKernel) -> Forest:
    """The Forest of TreeEnsemble-5: interior nodes first, then one node per leaf."""
    splits = np.asarray(kernel.attr("nodes_splits"), dtype=np.float64).reshape(-1)
    n = splits.size
    leaf_weights = np.asarray(kernel.attr("leaf_weights"), dtype=np.float64).reshape(-1)
    leaf_targets = np.asarray(kernel.attr_ints("leaf_targetids"), dtype=np.int64)
    n_leaves = leaf_weights.size
    total = n + n_leaves
    modes = np.asarray(kernel.attr("nodes_modes"), dtype=np.uint8).reshape(-1)
    if modes.size and modes.max() > _MEMBER:
        raise kernel.bad_attr("nodes_modes", int(modes.max()), "codes 0..6 (LEQ, LT, GTE, GT, EQ, NEQ, MEMBER)")
    index = np.arange(total)

    def child(ids, leaf_flags):
        ids = np.asarray(kernel.attr_ints(ids), dtype=np.int64)
        flags = np.asarray(kernel.attr_ints(leaf_flags), dtype=bool)
        return np.where(flags, ids + n, ids)

    true_next = np.concatenate([child("nodes_truenodeids", "nodes_trueleafs"), index[n:]])
    false_next = np.concatenate([child("nodes_falsenodeids", "nodes_falseleafs"), index[n:]])
    missing = kernel.attr_ints("nodes_missing_value_tracks_true", None) or [0] * n
    n_targets = kernel.attr_int("n_targets", lo=1)
    weights = np.zeros((total, n_targets))
    weights[n + np.arange(n_leaves), leaf_targets] = leaf_weights
    has = np.zeros((total, n_targets), dtype=bool)
    has[n + np.arange(n_leaves), leaf_targets] = True
    members = _members(kernel, modes)
    pad = np.zeros(n_leaves)
    return Forest(np.concatenate([kernel.attr_ints("nodes_featureids"), pad]).astype(np.int64),
                  np.concatenate([splits, pad]), np.concatenate([modes, np.full(n_leaves, _LEAF, np.uint8)]),
                  true_next, false_next, np.concatenate([np.asarray(missing, dtype=bool), pad.astype(bool)]),
                  np.asarray(kernel.attr_ints("tree_roots"), dtype=np.int64), weights, has, members)


def _members(kernel: OpKernel, modes: np.ndarray) -> dict:
    """BRANCH_MEMBER nodes -> their sets: membership_values lists them in node order, NaN-separated."""
    values = kernel.attr("membership_values", None)
    if values is None:
        return {}
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    cuts = np.flatnonzero(np.isnan(values))
    groups = np.split(values, cuts)
    groups = [g[~np.isnan(g)] for g in groups]
    return {int(i): set(g.tolist()) for i, g in zip(np.flatnonzero(modes == _MEMBER), groups)}


@register("TreeEnsemble", domain=ML, since=5)
class TreeEnsemble(OpKernel):
    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.aggregate = AGGREGATES_V5[self.attr_int("aggregate_function", 1, lo=0, hi=3)]
        self.post = POST_TRANSFORMS_V5[self.attr_int("post_transform", 0, lo=0, hi=4)]
        self.forest = forest_v5(self)

    def _run(self, x):
        feats = _features(x)
        scores = self.forest.aggregate(self.forest.leaves(feats), self.aggregate)
        return (post_transform(self.post, scores).astype(x.dtype if x.dtype.kind == "f" else np.float32),)
