"""Levels, BASIC passes, the report, and the onnxscript bugs the optimizer works around."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import helper

from host.errors import InvalidArgument
from host.optimizer import GraphOptimizationLevel, as_level, optimize
from host.optimizer.opset import convert_opset, onnx_opset
from tests.host.optimizer.common import References, assert_same, float_arrays, make_model, ops

L = GraphOptimizationLevel


# ---- levels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,level", [(0, L.ORT_DISABLE_ALL), (1, L.ORT_ENABLE_BASIC), (2, L.ORT_ENABLE_EXTENDED),
                                         (99, L.ORT_ENABLE_ALL), ("basic", L.ORT_ENABLE_BASIC),
                                         ("ORT_ENABLE_EXTENDED", L.ORT_ENABLE_EXTENDED), (L.ORT_ENABLE_ALL, 99)])
def test_levels_have_onnxruntime_values_and_names(value, level):
    assert as_level(value) == level


@pytest.mark.parametrize("value,message", [
    (3, "^graph_optimization_level 3 is not a level; allowed: ORT_DISABLE_ALL=0, ORT_ENABLE_BASIC=1, "
        "ORT_ENABLE_EXTENDED=2, ORT_ENABLE_ALL=99$"),
    ("max", "^graph_optimization_level 'max' is not a level name; allowed: disable, basic, extended, all or "),
    (True, "^graph_optimization_level must be a GraphOptimizationLevel or int; got True "),
    (1.0, "^graph_optimization_level must be a GraphOptimizationLevel, int or name; got float "),
])
def test_bad_levels_are_refused(value, message):
    with pytest.raises(InvalidArgument, match=message):
        as_level(value)


def test_optimize_rejects_a_path():
    with pytest.raises(InvalidArgument, match="^optimize\\(\\) takes an onnx.ModelProto; got str$"):
        optimize("model.onnx", 1)


# ---- BASIC ---------------------------------------------------------------------------------------
def _shape_subgraph_model(dropout=True):
    """Reshape(x, Concat(Shape(x)[0], [-1])) after Identity and Dropout, then a redundant Cast pair.

    With x's shape declared, the whole shape computation folds to a constant."""
    nodes = [helper.make_node("Identity", ["x"], ["xi"]),
             helper.make_node("Dropout", ["xi"], ["xd"]) if dropout else helper.make_node("Identity", ["xi"], ["xd"]),
             helper.make_node("Shape", ["xd"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
             helper.make_node("Concat", ["b1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["xd", "shape"], ["r"]),
             helper.make_node("Cast", ["r"], ["c64"], to=onnx.TensorProto.DOUBLE),
             helper.make_node("Cast", ["c64"], ["c32"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Relu", ["c32"], ["y"])]
    inits = {"zero": np.array(0, np.int64), "axes": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    return make_model(nodes, [("x", [3, 4, 5])], [("y", [3, 20])], inits)


@functools.cache
def basic_pair():
    model = _shape_subgraph_model()
    return References(model), optimize(model, L.ORT_ENABLE_BASIC), None


@functools.cache
def _basic_refs():
    return References(basic_pair()[1].model)


@given(x=float_arrays([3, 4, 5]))
def test_basic_folds_shape_subgraphs_and_drops_no_ops(x):
    original, result, _ = basic_pair()
    # Identity, Dropout, the shape computation and the Cast round trip are gone.
    assert ops(result.model) == {"Reshape": 1, "Relu": 1}
    assert result.nodes_before == 10 and result.nodes_after == 2
    assert_same(original, _basic_refs(), {"x": x})


def test_basic_does_not_fuse():
    model = _linear_gelu_model()
    assert ops(optimize(model, L.ORT_ENABLE_BASIC).model) == ops(model)


def test_disable_all_returns_the_model_itself():
    model = _shape_subgraph_model()
    result = optimize(model, L.ORT_DISABLE_ALL)
    assert result.model is model and result.report == []


def test_all_is_extended():
    model = _linear_gelu_model()
    extended, everything = optimize(model, L.ORT_ENABLE_EXTENDED).model, optimize(model, L.ORT_ENABLE_ALL).model
    assert extended.SerializeToString() == everything.SerializeToString()
    assert ops(extended) == {"ai.ephost::FusedMatMul": 1}


def _linear_gelu_model():
    half, one, sqrt2 = (np.float32(v) for v in (0.5, 1.0, 2 ** 0.5))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["z"]),
             helper.make_node("Div", ["z", "sqrt2"], ["s"]), helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["t"]), helper.make_node("Mul", ["z", "t"], ["p"]),
             helper.make_node("Mul", ["p", "half"], ["y"])]
    rng = np.random.default_rng(1)
    inits = {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.standard_normal(6).astype(np.float32),
             "half": half, "one": one, "sqrt2": sqrt2}
    return make_model(nodes, [("x", [2, 3, 4])], [("y", [2, 3, 6])], inits)


def test_report_says_what_each_pass_changed():
    result = optimize(_linear_gelu_model(), L.ORT_ENABLE_ALL)
    by_name = {r.name: r for r in result.report}
    assert by_name["opset conversion 17 -> 23"].nodes_before == 7
    gelu = by_name["fuse Gelu"]
    assert gelu.removed == {"Div": 1, "Erf": 1, "Add": 1, "Mul": 2} and gelu.added == {"Gelu": 1}
    assert by_name["fuse FusedMatMul"].added == {"ai.ephost::FusedMatMul": 1}
    assert "fuse Gelu: 7 -> 3 nodes" in result.summary()
    assert result.nodes_before == 7 and result.nodes_after == 1


def test_verbose_prints_the_passes(capsys):
    optimize(_linear_gelu_model(), L.ORT_ENABLE_ALL, verbose=True)
    out = capsys.readouterr().out
    assert "[optimizer] fuse Gelu: 7 -> 3 nodes" in out and "optimizer (ORT_ENABLE_ALL): 7 -> 1 nodes" in out


@given(x=float_arrays([2, 3, 4]))
def test_fusing_to_opset_23_keeps_results(x):
    original, fused = _gelu_refs()
    assert_same(original, fused, {"x": x})


@functools.cache
def _gelu_refs():
    model = _linear_gelu_model()
    optimized = optimize(model, L.ORT_ENABLE_ALL).model
    assert {o.domain: o.version for o in optimized.opset_import} == {"": 23, "ai.ephost": 1}
    return References(model), References(optimized)


# ---- onnxscript bugs, pinned with the workaround ------------------------------------------------
def test_onnxscript_convert_version_on_a_proto_keeps_the_old_opset_import():
    """onnxscript's version_converter.convert_version(ModelProto) rewrites the graph but not
    opset_import (seen on a Llama export); ephost converts the ir.Model instead."""
    import onnx_ir as ir
    from onnxscript import version_converter

    model = _linear_gelu_model()
    model.opset_import[0].version = 18
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    version_converter.convert_version(proto, 23)
    if proto.opset_import[0].version == 23:
        pytest.skip("onnxscript now updates opset_import on the proto path (bug fixed upstream)")
    assert proto.opset_import[0].version == 18
    ir_model = ir.serde.deserialize_model(model)
    assert convert_opset(ir_model, 23) and onnx_opset(ir_model) == 23
    assert ir.serde.serialize_model(ir_model).opset_import[0].version == 23


def _gemm_bias_model(bias_shape):
    nodes = [helper.make_node("MatMul", ["a", "w"], ["m"]), helper.make_node("Add", ["m", "c"], ["y"])]
    rng = np.random.default_rng(0)
    out = list(np.broadcast_shapes((4, 6), bias_shape))
    return make_model(nodes, [("a", [4, 5])], [("y", out)],
                      {"w": rng.standard_normal((5, 6)).astype(np.float32),
                       "c": rng.standard_normal(bias_shape).astype(np.float32)})


def test_onnxscript_gemm_rule_ignores_the_bias_shape():
    """onnxscript's MatMulAddToGemm fuses an Add that raises the rank into Gemm, whose C cannot;
    ephost's rule checks the bias (and still fuses the valid case)."""
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.common import matmul_add_to_gemm_rule

    model = _gemm_bias_model((3, 4, 6))
    theirs = rewriter.rewrite(model, [matmul_add_to_gemm_rule])
    assert ops(theirs) == {"Gemm": 1}  # the bug: a rank-3 C
    import onnxruntime as ort

    sess = ort.InferenceSession(theirs.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="Invalid bias shape"):
        sess.run(None, {"a": np.ones((4, 5), np.float32)})
    assert "Gemm" not in ops(optimize(model, L.ORT_ENABLE_ALL).model)
    assert ops(optimize(_gemm_bias_model((6,)), L.ORT_ENABLE_ALL).model) == {"Gemm": 1}


def test_onnxscript_layer_norm_rule_ignores_the_scale_shape():
    """onnxscript's LayerNormFusion takes a per-element scale [S, D] as LayerNormalization's Scale;
    ephost's rule requires the normalized shape."""
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.fusion._layer_norm import layer_normalization_rules

    from tests.host.optimizer.test_fusions import _layer_norm_model

    model = _layer_norm_model(scale_shape=(5, 16))
    converted = optimize(model, L.ORT_ENABLE_BASIC).model
    import onnx_ir as ir

    ir_model = ir.serde.deserialize_model(converted)
    convert_opset(ir_model, 23)
    ir.passes.common.AddDefaultAttributesPass()(ir_model)
    theirs = rewriter.rewrite(ir.serde.serialize_model(ir_model), layer_normalization_rules)
    assert "LayerNormalization" in ops(theirs)  # the bug
    ours = optimize(model, L.ORT_ENABLE_ALL).model
    assert "LayerNormalization" not in ops(ours)
    x = np.random.default_rng(2).standard_normal((2, 5, 16)).astype(np.float32)
    assert_same(References(model), References(ours), {"x": x})


def _chain(*extra):
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Sigmoid", ["a"], ["b"]),
             helper.make_node("Neg", ["b"], ["y"]), *extra]
    outputs = [("y", [2, 3])] + [(n.output[0], [2, 3]) for n in extra]
    return make_model(nodes, [("x", [2, 3])], outputs)


def test_a_model_with_nothing_to_optimize_is_returned_as_is():
    model = _chain()
    result = optimize(model, L.ORT_ENABLE_ALL)
    assert result.model is model and result.report == []


@pytest.mark.parametrize("extra,gone", [
    (helper.make_node("Identity", ["b"], ["i"]), "Identity"),          # a BASIC candidate
    (helper.make_node("Relu", ["x"], ["r"]), "Relu"),                 # a common subexpression of node 0
])
def test_the_fast_path_does_not_skip_work(extra, gone):
    model = _chain(extra)
    after = ops(optimize(model, L.ORT_ENABLE_ALL).model)
    assert after[gone] < ops(model)[gone]


@pytest.mark.parametrize("to,removed", [(onnx.TensorProto.FLOAT, True), (onnx.TensorProto.DOUBLE, False)])
def test_single_cast_is_removed_only_when_it_is_a_no_op(to, removed):
    node = helper.make_node("Cast", ["x"], ["y"], to=to)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", to, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert ("Cast" not in ops(optimize(model, L.ORT_ENABLE_ALL).model)) == removed


# ---- onnx's reference GatherElements, which onnxscript's folding calls ------------------------------
def _gather_elements_model(data: np.ndarray, indices: np.ndarray, axis: int) -> onnx.ModelProto:
    """y = x + GatherElements(data, indices) with both operands initializers (x: the output's shape)."""
    nodes = [helper.make_node("GatherElements", ["d", "i"], ["g"], axis=axis),
             helper.make_node("Cast", ["g"], ["gf"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Add", ["x", "gf"], ["y"])]
    return make_model(nodes, [("x", list(indices.shape))], [("y", list(indices.shape))], {"d": data, "i": indices})


def test_gather_elements_of_constants_is_folded_where_onnx_reference_fails():
    """BERT's dynamo export gathers its token-type ids (1, 64) by position ids (1, 16): onnx's reference
    kernel cannot (indices shorter than the data along the axis), so onnxscript left the node; ephost
    folds it in NumPy, and onnxruntime agrees with the result."""
    import onnxruntime as ort

    from host.optimizer.pipeline import _gather_elements

    data = np.arange(64, dtype=np.int64).reshape(1, 64) * 3
    indices = np.arange(16, dtype=np.int64).reshape(1, 16)[:, ::-1].copy()
    indices[0, 0] = -1  # wraps to the last element
    model = _gather_elements_model(data, indices, 1)
    optimized = optimize(model, L.ORT_ENABLE_BASIC).model
    assert "GatherElements" not in ops(optimized)
    feeds = {"x": np.ones((1, 16), np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == 1 + 63 * 3
    assert _gather_elements(data, indices, -1) is not None and _gather_elements(data, indices, 2) is None


@given(st.data())
def test_gather_elements_fold_matches_onnxruntime(draw):
    import onnxruntime as ort

    from host.optimizer.pipeline import _gather_elements

    rank = draw.draw(st.integers(1, 3))
    shape = draw.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    axis = draw.draw(st.integers(-rank, rank - 1))
    ishape = [draw.draw(st.integers(1, n)) if a != axis % rank else draw.draw(st.integers(1, 5))
              for a, n in enumerate(shape)]
    size = shape[axis]
    rng = np.random.default_rng(draw.draw(st.integers(0, 2**16)))
    data = rng.integers(-50, 50, shape).astype(np.int64)
    indices = rng.integers(-size, size, ishape).astype(np.int64)
    want = ort.InferenceSession(_gather_elements_model(data, indices, axis).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": np.zeros(ishape, np.float32)})[0]
    np.testing.assert_array_equal(_gather_elements(data, indices, axis).astype(np.float32), want)


def test_gather_elements_fold_refuses_what_the_op_refuses():
    from host.optimizer.pipeline import _gather_elements

    data = np.arange(8, dtype=np.int64).reshape(2, 4)
    assert _gather_elements(data, np.array([[1, 4]], np.int64), 1) is None  # out of range
    assert _gather_elements(data, np.array([[1, -5]], np.int64), 1) is None
    assert _gather_elements(data, np.zeros((3, 1), np.int64), 1) is None  # longer than the data off the axis
    assert _gather_elements(data, np.zeros((2,), np.int64), 0) is None  # another rank
    np.testing.assert_array_equal(_gather_elements(data, np.array([[3], [0]], np.int64), 1), [[3], [4]])


# ---- re-viewing nodes -> Reshape (rules/views.py) -----------------------------------------------------
def _view_model(gather_indices: np.ndarray, axis: int, flatten: bool) -> onnx.ModelProto:
    """x (4, 3) -> [Flatten(axis=1) of x * 1 ->] Gather(indices, axis) -> Add 0 -> y: the Gather reads a
    computed value (not foldable), and its output feeds an op (not a graph output)."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["xx"])]
    data = "xx"
    if flatten:
        nodes.append(helper.make_node("Flatten", ["xx"], ["f"], axis=1))
        data = "f"
    nodes += [helper.make_node("Gather", [data, "i"], ["g"], axis=axis), helper.make_node("Neg", ["g"], ["y"])]
    shape = [4, 3]
    out = shape[:axis] + list(gather_indices.shape) + shape[axis + 1:]
    return make_model(nodes, [("x", shape)], [("y", out)], {"two": np.float32(2), "i": gather_indices})


@pytest.mark.parametrize("indices,axis,becomes_reshape", [
    (np.arange(4, dtype=np.int64).reshape(1, 1, 4), 0, True),   # Llama's mask[:, None, None, :]
    (np.arange(3, dtype=np.int64).reshape(3, 1), 1, True),
    (np.arange(3, dtype=np.int64).reshape(3, 1), -1, True),
    (np.array([0, 1, 2], np.int64), 0, False),                  # not the whole axis
    (np.array([0, 2, 1], np.int64), 1, False),                  # another order
    (np.array([0, 1, -1], np.int64), 1, False),                 # -1 is 2, but not as written
])
@pytest.mark.parametrize("flatten", [False, True])
def test_an_identity_gather_becomes_a_reshape(indices, axis, becomes_reshape, flatten):
    model = _view_model(indices, axis, flatten)
    optimized = optimize(model, L.ORT_ENABLE_BASIC).model
    got = ops(optimized)
    assert ("Gather" not in got) == becomes_reshape, got
    # A static Flatten is a Reshape (here to the shape it has: a no-op, removed); Reshapes in a row join.
    assert "Flatten" not in got
    assert got.get("Reshape", 0) == (1 if becomes_reshape else 0), got
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert_same(References(model), References(optimized), {"x": x})


def test_a_flatten_of_a_dynamic_shape_stays():
    nodes = [helper.make_node("Flatten", ["x"], ["y"], axis=2)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 2, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.graph.node.append(helper.make_node("Neg", ["y"], ["z"]))
    model.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None))
    assert ops(optimize(model, L.ORT_ENABLE_BASIC).model)["Flatten"] == 1
