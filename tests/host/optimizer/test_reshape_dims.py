"""Reshape(x, Concat(x's own dims in place, constants)) -> Reshape(x, constant with 0s)
(host/optimizer/rules/reshape_dims.py), against onnxruntime on the original at several shapes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.optimizer import GraphOptimizationLevel, optimize
from tests.models import dynamic


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _reshape_shapes(model: onnx.ModelProto) -> list[list[int]]:
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                   if n.op_type == "Constant" and n.attribute[0].name == "value"})
    return [consts[n.input[1]].tolist() for n in model.graph.node if n.op_type == "Reshape" and n.input[1] in consts]


def test_head_split_becomes_a_constant_shape():
    model = dynamic.reshape_heads()
    out = optimize(model, GraphOptimizationLevel.ORT_ENABLE_BASIC).model
    # The split reads X's own dims: [0, 0, 2, 4]. The merge reshapes another value with X's dims: kept.
    assert _reshape_shapes(out) == [[0, 0, 2, 4]] and _ops(out).count("Reshape") == 2
    ref, got = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (model, out))
    rng = np.random.default_rng(0)
    for shape in [(1, 16, 8), (8, 128, 8), (3, 50, 8)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(got.run(None, {"X": x})[0], ref.run(None, {"X": x})[0])


def _one_reshape(parts_from_shape, allowzero: int = 0, of_other: bool = False, sliced: bool = False) -> onnx.ModelProto:
    """Y = Reshape(X, Concat(Unsqueeze(Gather(Shape(src), i)) for i in parts_from_shape, [-1])), or with
    Slice(Shape(src), [i], [i + 1]) for each part when `sliced`."""
    nodes = [helper.make_node("Shape", ["Z" if of_other else "X"], ["s"])]
    parts = []
    for j in range(len(parts_from_shape)):
        if sliced:
            nodes.append(helper.make_node("Slice", ["s", f"st{j}", f"en{j}"], [f"u{j}"]))
            parts.append(f"u{j}")
            continue
        nodes += [helper.make_node("Gather", ["s", f"i{j}"], [f"g{j}"], axis=0),
                  helper.make_node("Unsqueeze", [f"g{j}", "ax0"], [f"u{j}"])]
        parts.append(f"u{j}")
    nodes += [helper.make_node("Concat", [*parts, "minus1"], ["shape"], axis=0),
              helper.make_node("Reshape", ["X", "shape"], ["Y"], allowzero=allowzero)]
    inits = [numpy_helper.from_array(np.array(i, np.int64), f"i{j}") for j, i in enumerate(parts_from_shape)]
    inits += [numpy_helper.from_array(np.array([i], np.int64), f"st{j}") for j, i in enumerate(parts_from_shape)]
    inits += [numpy_helper.from_array(np.array([i + 1], np.int64), f"en{j}") for j, i in enumerate(parts_from_shape)]
    inits += [numpy_helper.from_array(np.array([0], np.int64), "ax0"),
              numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["a", "b", "c"]),
           helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["a", "b", "c"])]
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "r", ins, [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("case", ["in_place", "negative_index", "sliced", "moved_dim", "allowzero", "other_tensor"])
def test_only_dims_copied_in_place_become_zeros(case):
    model = {"in_place": lambda: _one_reshape([0, 1]), "negative_index": lambda: _one_reshape([-3]),
             "sliced": lambda: _one_reshape([0, 1], sliced=True),
             "moved_dim": lambda: _one_reshape([1]), "allowzero": lambda: _one_reshape([0], allowzero=1),
             "other_tensor": lambda: _one_reshape([0], of_other=True)}[case]()
    out = optimize(model, GraphOptimizationLevel.ORT_ENABLE_BASIC).model
    rewritten = "Shape" not in _ops(out)
    assert rewritten == (case in ("in_place", "negative_index", "sliced"))
    ref, got = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (model, out))
    rng = np.random.default_rng(1)
    for shape in [(2, 3, 4), (5, 1, 6)]:
        feeds = {"X": rng.standard_normal(shape).astype(np.float32), "Z": rng.standard_normal(shape).astype(np.float32)}
        np.testing.assert_array_equal(got.run(None, feeds)[0], ref.run(None, feeds)[0])
