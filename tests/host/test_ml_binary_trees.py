"""Two-label TreeEnsembleClassifier against onnxruntime: skl2onnx's binary models, and hand-built
models for every combination onnxruntime's binary rules tell apart (host/cpu_ep/ml_tree_classes.py):
which class ids the leaves score (one weight per leaf or two, on some leaves only), the signs of the
weights, 0, 1 or 2 base values, every post transform, integer and string labels."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

import host

skl2onnx = pytest.importorskip("skl2onnx", reason="skl2onnx converts the scikit-learn models (test extra)")
pytest.importorskip("sklearn", reason="scikit-learn trains the models (test extra)")

from sklearn.ensemble import ExtraTreesClassifier, GradientBoostingClassifier, RandomForestClassifier  # noqa: E402
from sklearn.tree import DecisionTreeClassifier  # noqa: E402

RNG = np.random.RandomState(3)
X = RNG.rand(300, 4).astype(np.float32)
Y = (X[:, 0] + X[:, 1] + 0.3 * RNG.rand(300) > 1.1).astype(np.int64)
POSTS = ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"]


def _run_both(model, x: np.ndarray):
    data = model.SerializeToString()
    expected = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"X": x})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = host.InferenceSession(data).run(None, {"X": x})
    return expected, got


def _assert_labels_equal(expected: np.ndarray, got: np.ndarray):
    assert got.shape == expected.shape
    if expected.dtype.kind in "OUS":
        assert got.dtype == object and got.tolist() == expected.tolist()
    else:
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


SKLEARN = {
    "random_forest": lambda: RandomForestClassifier(7, max_depth=5, random_state=0),
    "extra_trees": lambda: ExtraTreesClassifier(5, max_depth=4, random_state=0),
    "gradient_boosting": lambda: GradientBoostingClassifier(n_estimators=8, max_depth=3, random_state=0),
    "decision_tree": lambda: DecisionTreeClassifier(max_depth=4, random_state=0),
}
LABELS = {"ints_0_1": [0, 1], "ints_7_3": [7, 3], "strings": ["no", "yes"]}


@pytest.mark.parametrize("labels", LABELS, ids=str)
@pytest.mark.parametrize("estimator", SKLEARN, ids=str)
def test_sklearn_binary_classifier_matches_onnxruntime_and_sklearn(estimator, labels):
    names = np.array(LABELS[labels], dtype=object if labels == "strings" else np.int64)
    fitted = SKLEARN[estimator]().fit(X, names[Y])
    model = skl2onnx.to_onnx(fitted, X[:1], options={id(fitted): {"zipmap": False}},
                             target_opset={"": 17, "ai.onnx.ml": 3})
    for rows in (X[:1], X):  # one row (the few-rows walk) and 300
        expected, got = _run_both(model, rows)
        _assert_labels_equal(expected[0], got[0])
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)
    assert got[0].tolist() == fitted.predict(X).tolist()


# -- hand-built: two trees of depth 2 (4 leaves each) on two features ------------------------------

LEAF_WEIGHTS = {"positive": [0.05, 0.3, 0.12, 0.25, 0.2, 0.4, 0.1, 0.35],
                "mixed": [-0.4, 0.3, 0.2, -0.1, 0.5, -0.6, 0.15, 0.25]}
# which class ids each leaf scores: one weight per leaf (class 0 or 1), two, or class 1 on half the leaves
SCORED = {"class0": lambda leaf: [0], "class1": lambda leaf: [1], "both": lambda leaf: [0, 1],
          "class1_on_some": lambda leaf: [0, 1] if leaf % 2 else [0]}
BASES = {"none": None, "one": [0.15], "two": [-0.1, 0.2]}


def _tree_classifier(post: str, labels: list, scored: str, weights: str, base) -> object:
    nodes = dict(nodes_treeids=[], nodes_nodeids=[], nodes_featureids=[], nodes_values=[], nodes_modes=[],
                 nodes_truenodeids=[], nodes_falsenodeids=[])
    classes = dict(class_treeids=[], class_nodeids=[], class_ids=[], class_weights=[])
    leaf = 0
    for tree in range(2):
        # node 0 splits feature `tree`, nodes 1 and 2 the other feature, nodes 3..6 are leaves
        for node, (feature, value, true, false) in enumerate([(tree, 0.5, 1, 2), (1 - tree, 0.3, 3, 4),
                                                              (1 - tree, 0.7, 5, 6)] + [(0, 0.0, 0, 0)] * 4):
            nodes["nodes_treeids"].append(tree)
            nodes["nodes_nodeids"].append(node)
            is_leaf = node >= 3
            nodes["nodes_featureids"].append(0 if is_leaf else feature)
            nodes["nodes_values"].append(0.0 if is_leaf else value)
            nodes["nodes_modes"].append("LEAF" if is_leaf else "BRANCH_LEQ")
            nodes["nodes_truenodeids"].append(0 if is_leaf else true)
            nodes["nodes_falsenodeids"].append(0 if is_leaf else false)
            if is_leaf:
                for class_id in SCORED[scored](leaf):
                    classes["class_treeids"].append(tree)
                    classes["class_nodeids"].append(node)
                    classes["class_ids"].append(class_id)
                    classes["class_weights"].append(LEAF_WEIGHTS[weights][(leaf + 3 * class_id) % 8])
                leaf += 1
    kw = {"classlabels_strings" if isinstance(labels[0], str) else "classlabels_int64s": labels}
    if base is not None:
        kw["base_values"] = base
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml",
                            post_transform=post, **nodes, **classes, **kw)
    label_type = TensorProto.STRING if isinstance(labels[0], str) else TensorProto.INT64
    graph = helper.make_graph([node], "binary_trees", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor_value_info("label", label_type, [None]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])


# A grid of points on both sides of every split, plus a missing value.
GRID = np.array(list(itertools.product([0.1, 0.4, 0.6, 0.9], [0.2, 0.5, 0.8])) + [[np.nan, 0.2]], dtype=np.float32)
CASES = list(itertools.product(POSTS, SCORED, LEAF_WEIGHTS, BASES))


@pytest.mark.parametrize("labels", [[3, 7], ["neg", "pos"]], ids=["ints", "strings"])
@pytest.mark.parametrize(("post", "scored", "weights", "base"), CASES, ids=["-".join(c) for c in CASES])
def test_hand_built_binary_classifier_matches_onnxruntime(post, scored, weights, base, labels):
    model = _tree_classifier(post, labels, scored, weights, BASES[base])
    expected, got = _run_both(model, GRID)
    _assert_labels_equal(expected[0], got[0])
    assert got[1].dtype == np.float32 and got[1].shape == expected[1].shape
    # onnxruntime leaves the second column unset (stale memory) where it kept one score (rows without a
    # class-1 score, fewer than two base values) under PROBIT, and with one base value and weights for
    # both class ids.
    unset = (post == "PROBIT" and scored != "both" and base != "two") or (scored == "class1_on_some" and base == "one")
    columns = slice(0, 1) if unset else slice(None)
    np.testing.assert_allclose(got[1][:, columns], expected[1][:, columns], rtol=1e-5, atol=1e-6, equal_nan=True)


def test_binary_labels_and_scores_differ_between_rules():
    """The rules are told apart by the grid: not every case gives the same labels (guards the test
    above against a grid that lands every row on one side)."""
    seen = set()
    for scored in SCORED:
        expected, _ = _run_both(_tree_classifier("NONE", [3, 7], scored, "mixed", None), GRID)
        seen.add(tuple(expected[0].tolist()))
    assert len(seen) >= 3


def test_many_labels_pick_the_best_scored_class_like_onnxruntime():
    """Three labels, class 2 named by no leaf and every scored class negative: the label is the best
    scored class, not the unscored class's 0."""
    node = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml", classlabels_int64s=[10, 20, 30],
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0], nodes_values=[0.5, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"], nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
        class_treeids=[0, 0, 0, 0], class_nodeids=[1, 1, 2, 2], class_ids=[0, 1, 0, 1],
        class_weights=[-0.5, -0.2, -0.1, -0.3])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    expected, got = _run_both(model, GRID)
    assert set(expected[0].tolist()) == {10, 20}
    _assert_labels_equal(expected[0], got[0])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)


@pytest.mark.parametrize("post", ["PROBIT", "SOFTMAX_ZERO"])
def test_regressor_probit_and_softmax_zero_match_onnxruntime(post):
    """onnxruntime's PROBIT is an approximation of erfinv (up to ~2e-3 off the exact value);
    SOFTMAX_ZERO of a row of zeros is 0 / 0."""
    node = helper.make_node(
        "TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=2, post_transform=post,
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0], nodes_values=[0.5, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"], nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
        target_treeids=[0, 0, 0], target_nodeids=[1, 1, 2], target_ids=[0, 1, 0], target_weights=[0.02, 0.97, 0.0])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    expected, got = _run_both(model, GRID)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6, atol=1e-6, equal_nan=True)


# -- the compiled walk (native/kernels_trees.c) against NumPy's, leaf for leaf ---------------------

MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "mixed"]


def _merged(parts: list) -> dict:
    """The attributes of several _trees() forests as one, their tree ids renumbered in order."""
    out = {k: [] for k in parts[0]}
    offset = 0
    for attrs in parts:
        for k, v in attrs.items():
            out[k] += [t + offset for t in v] if k in ("nodes_treeids", "target_treeids") else list(v)
        offset += max(attrs["nodes_treeids"]) + 1
    return out


def _forest(mode: str, shallow_first: bool = False):
    """A 12-tree regressor's Forest (tests/host/test_ml_fast_paths.py's random trees, NaN directions
    included); "mixed": every branch mode in one forest. `shallow_first`: tree 0 is one split, the
    others five levels deep (trees of unequal depth walking together)."""
    from onnx import helper

    from tests.host.test_ml_fast_paths import FEATURES, _trees

    kind, rng = "BRANCH_LEQ" if mode == "mixed" else mode, np.random.RandomState(4)
    if shallow_first:
        attrs = _merged([_trees(kind, n_trees=1, depth=1, rng=rng), _trees(kind, n_trees=11, depth=5, rng=rng)])
    else:
        attrs = _trees(kind, n_trees=12, depth=5, rng=rng)
    if mode == "mixed":
        pick = np.random.RandomState(5)
        attrs["nodes_modes"] = [m if m == "LEAF" else MODES[pick.randint(6)] for m in attrs["nodes_modes"]]
    node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=2, **attrs)
    graph = helper.make_graph([node], "trees", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, FEATURES])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = host.InferenceSession(model.SerializeToString())
    return sess, model, sess.plan.nodes[0].kernel.forest


@pytest.mark.parametrize("rows", [1, 3, 700, 1029])  # 1029: blocks of 256 rows, lanes of 8 and a tail
@pytest.mark.parametrize("mode", MODES)
def test_compiled_tree_walk_reaches_the_numpy_walks_leaves(mode, rows):
    from host.cpu_ep import native
    from tests.host.test_ml_fast_paths import _inputs

    if native.LIB is None:
        pytest.skip(f"the CPU kernels library is not built ({native.LOAD_ERROR})")
    sess, model, forest = _forest(mode)
    x = _inputs(rows)  # thresholds' own values, and NaNs
    compiled = forest._compiled.leaves(x)
    assert compiled is not None and compiled.shape == (rows, len(forest.roots))
    np.testing.assert_array_equal(compiled, forest._numpy_leaves(x))
    # and through a run, against onnxruntime, with the library on and off
    expected, got = _run_both(model, x)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    saved = native.LIB
    native.use(None)
    try:
        np.testing.assert_allclose(sess.run(None, {"X": x})[0], expected[0], rtol=1e-5, atol=1e-5)
    finally:
        native.use(saved)


def test_compiled_tree_walk_leaves_float64_and_narrow_rows_to_numpy():
    from host.cpu_ep import native

    if native.LIB is None:
        pytest.skip(f"the CPU kernels library is not built ({native.LOAD_ERROR})")
    _, _, forest = _forest("BRANCH_LEQ")
    x = np.zeros((2, forest._compiled.width), dtype=np.float32)
    assert forest._compiled.leaves(x) is not None
    assert forest._compiled.leaves(x.astype(np.float64)) is None
    assert forest._compiled.leaves(x[:, :-1]) is None


def test_compiled_tree_walk_on_two_threads_gives_the_one_thread_leaves_and_sums(monkeypatch):
    from host.cpu_ep import native, ops_ml_trees
    from tests.host.test_ml_fast_paths import _inputs

    if native.LIB is None:
        pytest.skip(f"the CPU kernels library is not built ({native.LOAD_ERROR})")
    _, _, forest = _forest("mixed")
    x = np.ascontiguousarray(np.concatenate([_inputs(700)] * 3))  # 2100 rows: blocks for both threads
    one = forest._compiled.leaves(x), forest._compiled.sums(x)
    monkeypatch.setattr(ops_ml_trees, "_threads", lambda rows: 2)
    two = forest._compiled.leaves(x), forest._compiled.sums(x)
    np.testing.assert_array_equal(two[0], one[0])
    np.testing.assert_array_equal(two[1], one[1])
    np.testing.assert_array_equal(one[0], forest._numpy_leaves(x))


@pytest.mark.parametrize("rows", [1, 3, 700])
def test_a_shallow_tree_leading_a_group_does_not_stop_the_deeper_ones(rows):
    """Trees walk a small batch 8 at a time and rows walk a tree 8 at a time: each for the depth of
    the deepest, a shallow tree first in its group included."""
    from host.cpu_ep import native
    from tests.host.test_ml_fast_paths import _inputs

    if native.LIB is None:
        pytest.skip(f"the CPU kernels library is not built ({native.LOAD_ERROR})")
    _, _, forest = _forest("BRANCH_LEQ", shallow_first=True)
    assert forest._compiled.arrays[7][0] == 1 and forest._compiled.arrays[7][1:].max() == 5  # the depths
    x = _inputs(rows)
    np.testing.assert_array_equal(forest._compiled.leaves(x), forest._numpy_leaves(x))
    weights = forest.weights.astype(np.float32)
    want = np.stack([weights[leaves].sum(axis=0, dtype=np.float32) for leaves in forest._numpy_leaves(x)])
    np.testing.assert_allclose(forest._compiled.sums(x), want, rtol=1e-6, atol=1e-6)


def test_tree_depths_count_the_longest_path_of_each_tree():
    from host.cpu_ep.ops_ml_trees import _LEAF, Forest, _tree_depths

    # tree 0: root 0 -> (1 leaf, 2 -> (3 -> (4 leaf, 5 leaf), 6 leaf)); tree 1: a lone leaf 7; tree 2: 8 -> (9, 10)
    true_next = np.array([1, 1, 3, 4, 4, 5, 6, 7, 9, 9, 10])
    false_next = np.array([2, 1, 6, 5, 4, 5, 6, 7, 10, 9, 10])
    mode = np.zeros(11, dtype=np.uint8)
    mode[[1, 4, 5, 6, 7, 9, 10]] = _LEAF
    n = len(mode)
    forest = Forest(np.zeros(n, np.int64), np.zeros(n), mode, true_next, false_next, np.zeros(n, bool),
                    np.array([0, 7, 8]), np.zeros((n, 1), np.float32), np.zeros((n, 1), bool), {})
    assert _tree_depths(forest).tolist() == [3, 0, 1]


# -- the converters' binary models in one compiled call (ep_tree_class0) against the NumPy finish -----


def _numpy_finish(model, x: np.ndarray):
    """The session's outputs with the compiled finish off (the walk's sums, then _class0_only in NumPy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess = host.InferenceSession(model.SerializeToString())
    sess.plan.nodes[0].kernel._class0 = None
    return sess.run(None, {"X": x})


def _same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tolist() == w.tolist() if g.dtype == object else np.array_equal(g.view(np.uint8), w.view(np.uint8))


def _class0_calls(monkeypatch) -> list:
    from host.cpu_ep import native

    lib, calls = native.LIB, []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return lambda *a: (calls.append(name), fn(*a))[1]

    monkeypatch.setattr(native, "LIB", Spy())
    return calls


@pytest.mark.parametrize("labels", [[3, 7], ["neg", "pos"]], ids=["ints", "strings"])
@pytest.mark.parametrize("base", ["none", "one"])
@pytest.mark.parametrize("weights", LEAF_WEIGHTS)
@pytest.mark.parametrize("rows", [1, 13, 600])
def test_a_class0_binary_classifier_gives_the_numpy_finishs_bits_in_one_call(rows, weights, base, labels, monkeypatch):
    from host.cpu_ep import native

    if native.LIB is None:
        pytest.skip(f"the CPU kernels library is not built ({native.LOAD_ERROR})")
    model = _tree_classifier("NONE", labels, "class0", weights, BASES[base])
    x = np.resize(GRID, (rows, 2))  # both sides of every split, and a missing value
    calls = _class0_calls(monkeypatch)
    got = host.InferenceSession(model.SerializeToString()).run(None, {"X": x})
    assert calls == ["ep_tree_class0"]
    monkeypatch.undo()
    _same_bits(got, _numpy_finish(model, x))


@pytest.mark.parametrize("leaves, base, want", [([0.25, 0.25], None, 3), ([0.25], [0.25], 3),
                                                ([0.25, 0.5], None, 7), ([0.25, -0.25], None, 3),
                                                ([-0.25, 0.5], None, 7), ([0.0], None, 3)])
def test_a_class0_score_at_the_threshold_takes_the_first_label(leaves, base, want, monkeypatch):
    """s > 0.5 (every weight >= 0) or s > 0 (some negative) picks the second label: a sum of exactly 0.5 or 0
    takes the first, as NumPy's comparison does. One single-leaf tree per weight."""
    from host.cpu_ep import native

    if native.LIB is None:
        pytest.skip(f"the CPU kernels library is not built ({native.LOAD_ERROR})")
    n = len(leaves)
    kw = {"base_values": base} if base else {}
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml",
                            nodes_treeids=list(range(n)), nodes_nodeids=[0] * n, nodes_featureids=[0] * n,
                            nodes_values=[0.0] * n, nodes_modes=["LEAF"] * n, nodes_truenodeids=[0] * n,
                            nodes_falsenodeids=[0] * n, class_treeids=list(range(n)), class_nodeids=[0] * n,
                            class_ids=[0] * n, class_weights=leaves, classlabels_int64s=[3, 7], **kw)
    graph = helper.make_graph([node], "leaves", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    x = np.zeros((2, 2), dtype=np.float32)
    calls = _class0_calls(monkeypatch)
    got = host.InferenceSession(model.SerializeToString()).run(None, {"X": x})
    assert calls == ["ep_tree_class0"] and got[0].tolist() == [want, want]
    monkeypatch.undo()
    _same_bits(got, _numpy_finish(model, x))
    expected, _ = _run_both(model, x)
    _assert_labels_equal(expected[0], got[0])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, atol=1e-7)
