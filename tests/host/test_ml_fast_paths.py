"""The per-run shortcuts of the CPU EP's ML models, against onnxruntime (CPU): tree ensembles at a
few rows (every node decided at once, Forest._decided) and at many rows (the cursor walk), for each
branch mode, aggregate and post transform; BLAS-free plans run without the BLAS thread bound; plain
NumPy feeds taken without check_feed keep its results and errors."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper
from threadpoolctl import threadpool_info, threadpool_limits

import host
from host.cpu_ep import ops_ml_trees
from host.errors import InvalidArgument
from host.runtime import threads

FEATURES = 5
LEVELS = np.array([0.0, 0.25, 0.5, 0.75], dtype=np.float32)  # EQ / NEQ need inputs equal to thresholds


def _trees(mode: str, n_trees: int, depth: int, rng, targets: int = 2) -> dict:
    """Attributes of `n_trees` random trees (ai.onnx.ml 3 layout): interior nodes of one branch mode,
    leaves at random depths up to `depth`, random missing-value directions, `targets` weights a leaf."""
    attrs = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
                             "nodes_truenodeids", "nodes_falsenodeids", "nodes_missing_value_tracks_true",
                             "target_treeids", "target_nodeids", "target_ids", "target_weights")}
    for tree in range(n_trees):
        count = [0]

        def grow(level: int, tree: int = tree, count: list = count) -> int:
            node = count[0]
            count[0] += 1
            leaf = level == depth or (level > 1 and rng.rand() < 0.25)
            attrs["nodes_treeids"].append(tree)
            attrs["nodes_nodeids"].append(node)
            attrs["nodes_featureids"].append(int(rng.randint(FEATURES)) if not leaf else 0)
            attrs["nodes_values"].append(float(rng.choice(LEVELS)) if not leaf else 0.0)
            attrs["nodes_modes"].append("LEAF" if leaf else mode)
            attrs["nodes_missing_value_tracks_true"].append(int(rng.rand() < 0.5) if not leaf else 0)
            at = len(attrs["nodes_truenodeids"])
            attrs["nodes_truenodeids"].append(0)
            attrs["nodes_falsenodeids"].append(0)
            if leaf:
                for target in range(targets):
                    attrs["target_treeids"].append(tree)
                    attrs["target_nodeids"].append(node)
                    attrs["target_ids"].append(target)
                    attrs["target_weights"].append(float(rng.randn()))
            else:
                attrs["nodes_truenodeids"][at] = grow(level + 1)
                attrs["nodes_falsenodeids"][at] = grow(level + 1)
            return node

        grow(0)
    return attrs


def _regressor(mode: str, aggregate: str, post: str = "NONE", seed: int = 0):
    attrs = _trees(mode, n_trees=12, depth=5, rng=np.random.RandomState(seed))
    node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=2,
                            aggregate_function=aggregate, post_transform=post, **attrs)
    graph = helper.make_graph([node], "trees", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, FEATURES])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])


def _classifier(mode: str, post: str, seed: int = 1):
    """Three classes (two-class models take onnxruntime's binary conventions, tested in test_ml_ops)."""
    attrs = _trees(mode, n_trees=12, depth=5, rng=np.random.RandomState(seed), targets=3)
    renamed = {k.replace("target_", "class_"): v for k, v in attrs.items()}
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml",
                            classlabels_int64s=[4, 9, 12], post_transform=post, **renamed)
    graph = helper.make_graph([node], "trees", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, FEATURES])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])


def _inputs(rows: int, seed: int = 2) -> np.ndarray:
    rng = np.random.RandomState(seed)
    x = rng.choice(np.concatenate([LEVELS, LEVELS + 0.1]), size=(rows, FEATURES)).astype(np.float32)
    x[rng.rand(rows, FEATURES) < 0.1] = np.nan  # missing values take the node's missing direction
    return x


def _check(model, x: np.ndarray) -> host.InferenceSession:
    ref = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = host.InferenceSession(model.SerializeToString())
    expected, got = ref.run(None, {"X": x}), sess.run(None, {"X": x})
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    return sess


def _uses_decided_path(sess: host.InferenceSession, rows: int) -> bool:
    forest = sess.plan.nodes[0].kernel.forest
    return forest.decide_all and rows * len(forest.mode) <= ops_ml_trees._DECIDE_ALL_CELLS


ROWS = [1, 3, 1000]  # 1 and 3: every node decided at once; 1000: the cursor walk


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("mode", ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"])
def test_tree_regressor_matches_onnxruntime_for_each_branch_mode(mode, rows):
    sess = _check(_regressor(mode, "SUM"), _inputs(rows))
    assert _uses_decided_path(sess, rows) == (rows < 1000)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("aggregate", ["AVERAGE", "MIN", "MAX"])
def test_tree_regressor_matches_onnxruntime_for_each_aggregate(aggregate, rows):
    _check(_regressor("BRANCH_LEQ", aggregate, post="LOGISTIC" if aggregate == "MIN" else "NONE"), _inputs(rows))


@pytest.mark.parametrize("rows", [1, 1000])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_tree_classifier_matches_onnxruntime_for_each_post_transform(post, rows):
    _check(_classifier("BRANCH_LT", post), _inputs(rows))


def test_both_walks_reach_the_same_leaves_row_by_row():
    sess = host.InferenceSession(_regressor("BRANCH_GTE", "SUM").SerializeToString())
    forest = sess.plan.nodes[0].kernel.forest
    x = _inputs(200, seed=5)
    np.testing.assert_array_equal(forest._decided(x), forest._walk(x))
    np.testing.assert_array_equal(forest._decided(x[7:8]), forest._walk(x[7:8]))


def test_a_row_with_too_few_features_fails_alike_on_both_paths():
    sess = host.InferenceSession(_regressor("BRANCH_LEQ", "SUM").SerializeToString())
    forest = sess.plan.nodes[0].kernel.forest
    short = np.zeros((1, 2), np.float32)
    with pytest.raises(IndexError):
        forest._walk(short)
    with pytest.raises(IndexError):
        forest._decided(short)  # the walk's own error: too few columns are not repeated silently


def _blas_counts() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


@pytest.mark.skipif(not _blas_counts(), reason="threadpoolctl finds no BLAS library in this process: nothing to bound")
def test_a_blas_free_plan_runs_without_the_thread_bound_and_a_matmul_plan_with_it():
    so = host.SessionOptions()
    so.intra_op_num_threads = 1
    trees = host.InferenceSession(_regressor("BRANCH_LEQ", "SUM").SerializeToString(), so)
    assert not threads.plan_calls_blas(trees.plan)
    segment = trees.executor.steps[0][0]
    node, original, *rest = segment.steps[0]
    seen = []
    segment.steps[0] = (node, lambda *a: (seen.append(_blas_counts()), original(*a))[1], *rest)
    with threadpool_limits(limits=3, user_api="blas"):
        trees.run(None, {"X": _inputs(1)})
    assert seen and set(seen[0]) == {3}  # the caller's count: no bound was applied

    a, c = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "AC")
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "A"], ["C"])], "mm", [a], [c])
    mm = host.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), so)
    assert threads.plan_calls_blas(mm.plan)


def _add_model(shape):
    x, y = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape), helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_plain_and_converted_feeds_give_the_same_results():
    sess = host.InferenceSession(_add_model([None, 3]).SerializeToString())
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    for feed in (base, np.asfortranarray(base), np.repeat(base, 2, axis=0)[::2], base[None][0]):
        np.testing.assert_array_equal(sess.run(None, {"x": feed})[0], base + base)


@pytest.mark.parametrize("feed, message", [
    (np.zeros((2, 3), np.float64), r"^input 'x': expected dtype float32 \(tensor\(float\)\), got float64 \(tensor\(double\)\)$"),
    (np.zeros((2, 4), np.float32), r"^input 'x': dimension 1 must be 3, got 4 \(expected shape \['N', 3\], got \[2, 4\]\)$"),
    (np.zeros((3,), np.float32), r"^input 'x': expected rank 2 \(shape \['N', 3\]\), got rank 1 \(shape \[3\]\)$"),
])
def test_feeds_the_shortcut_refuses_get_check_feeds_errors(feed, message):
    sess = host.InferenceSession(_add_model(["N", 3]).SerializeToString())
    with pytest.raises(InvalidArgument, match=message):
        sess.run(None, {"x": feed})


@pytest.mark.parametrize("rows", [1, 1000])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_binary_linear_classifier_matches_onnxruntime(post, rows):
    """One coefficient row and two labels: scores [-s, s] through LOGISTIC (one GEMM), [1 - s, s] as
    they are otherwise. (PROBIT is left out: onnxruntime's output there is not defined, NaN or 0.)"""
    rng = np.random.RandomState(3)
    node = helper.make_node("LinearClassifier", ["X"], ["label", "scores"], domain="ai.onnx.ml",
                            coefficients=rng.randn(FEATURES).tolist(), intercepts=[0.3], classlabels_ints=[5, 8],
                            post_transform=post)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, FEATURES])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])
    _check(model, rng.randn(rows, FEATURES).astype(np.float32))


@pytest.mark.parametrize("rows", [1, 1000])
def test_tree_ensemble_v5_with_one_mode_matches_onnxruntime(rows):
    """ai.onnx.ml 5's layout (leaves as their own nodes after the splits) on both walks: two trees,
    BRANCH_GT everywhere, a missing value going the true way at the first split."""
    node = helper.make_node(
        "TreeEnsemble", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=2, aggregate_function=1, tree_roots=[0, 2],
        nodes_featureids=[0, 3, 2], nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [3], [3, 3, 3]),
        nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [3], [0.5, 0.25, 0.3]),
        nodes_truenodeids=[1, 0, 3], nodes_trueleafs=[0, 1, 1], nodes_falsenodeids=[2, 1, 4],
        nodes_falseleafs=[1, 1, 1], nodes_missing_value_tracks_true=[1, 0, 0], leaf_targetids=[0, 1, 0, 0, 1],
        leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [5], [1.0, 2.0, 3.0, 4.0, 5.0]))
    graph = helper.make_graph([node], "v5", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, FEATURES])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 5)])
    model.ir_version = 10
    x = _inputs(rows)
    sess = _check(model, x)
    assert _uses_decided_path(sess, rows)  # a 7-node forest: every node decided at once even at 1000 rows
    forest = sess.plan.nodes[0].kernel.forest
    np.testing.assert_array_equal(forest._walk(x), forest._decided(x))


def _linear(op: str, features: int, columns: int, seed: int = 4, post: str = "SOFTMAX"):
    rng = np.random.RandomState(seed)
    attrs = {"coefficients": rng.randn(columns * features).tolist(), "intercepts": rng.randn(columns).tolist()}
    if op == "LinearClassifier":
        attrs |= {"classlabels_ints": list(range(10, 10 + columns)), "post_transform": post}
        outs = [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, columns])]
    else:
        attrs |= {"targets": columns}
        outs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, columns])]
    node = helper.make_node(op, ["X"], [o.name for o in outs], domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, features])],
                              outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])


@pytest.mark.parametrize("op, post", [("LinearClassifier", "SOFTMAX"), ("LinearClassifier", "LOGISTIC"),
                                      ("LinearClassifier", "NONE"), ("LinearRegressor", "NONE")])
def test_linear_models_run_the_compiled_gemm_in_row_blocks_without_blas(op, post, monkeypatch):
    """Coefficients within the small GEMM's panel: no BLAS in the plan (so no per-run thread bound), rows
    in blocks of native.gemm_fits (made 4 rows here, so 1000 rows take 250 GEMMs: 250 calls for the
    regressor, one ep_ml_linear call walking 250 blocks for the classifier), onnxruntime's answers."""
    from host.cpu_ep import native

    if native.LIB is None:
        pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
    model = _linear(op, FEATURES, 3, post=post)
    monkeypatch.setattr(native, "GEMM_MAX_MACS", 4 * FEATURES * 3)
    sess = host.InferenceSession(model.SerializeToString())
    assert not threads.plan_calls_blas(sess.plan)
    calls = []
    lib = native.LIB
    monkeypatch.setattr(native, "LIB", type("Spy", (), {
        "ep_gemm": lambda self, *a: (calls.append(("gemm", a[6])), lib.ep_gemm(*a))[1],
        "ep_ml_linear": lambda self, *a: (calls.append(("linear", a[1], a[10])), lib.ep_ml_linear(*a))[1],
        "ep_ml_logistic_labels": lambda self, *a: lib.ep_ml_logistic_labels(*a)})())
    x = np.random.RandomState(5).randn(1000, FEATURES).astype(np.float32)
    got = sess.run(None, {"X": x})
    assert calls == ([("gemm", 4)] * 250 if op == "LinearRegressor" else [("linear", 1000, 4)])
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    one = sess.run(None, {"X": x[:1]})  # one row: one call, in place after it
    for g, w in zip(one, want):
        np.testing.assert_allclose(g, w[:1], rtol=1e-5, atol=1e-5)


def test_a_linear_model_beyond_the_panel_keeps_blas_and_its_bound():
    from host.cpu_ep import native

    features = native.GEMM_MAX_PANEL // 2 + 1  # two score columns: one float past the panel
    sess = host.InferenceSession(_linear("LinearRegressor", features, 2).SerializeToString())
    assert threads.plan_calls_blas(sess.plan)
    x = np.random.RandomState(6).randn(3, features).astype(np.float32)
    want = x @ sess.plan.nodes[0].kernel.coef + sess.plan.nodes[0].kernel.intercepts
    np.testing.assert_allclose(sess.run(None, {"X": x})[0], want, rtol=1e-4, atol=1e-3)
