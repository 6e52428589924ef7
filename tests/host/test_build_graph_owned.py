"""build_graph puts shape inference's answer into a model it owns (loaded from a path or bytes, or the
session's own optimized copy) instead of into a copy of its weights, and never changes a caller's
ModelProto."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import host as ort
from host.runtime.model import build_graph


def _model() -> onnx.ModelProto:
    """x @ w (a large weight: `typed_inputs` leaves it out of inference's view) -> Relu; no value infos."""
    w = numpy_helper.from_array(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1e3, "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_owned_model_gets_the_inferred_shapes_in_place():
    proto = _model()
    graph = build_graph(proto, owned=True)
    assert graph.model is proto  # no copy of the weights
    assert [vi.name for vi in proto.graph.value_info] == ["m"]
    assert [d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim] == [2, 32]
    assert [t.name for t in proto.graph.initializer] == ["w"] and [i.name for i in proto.graph.input] == ["x"]
    assert graph.values["m"].shape == (2, 32)


def test_a_model_not_owned_is_left_as_it_was():
    proto = _model()
    before = proto.SerializeToString()
    graph = build_graph(proto)
    assert graph.model is not proto and proto.SerializeToString() == before
    assert graph.values["m"].shape == (2, 32)


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL])
def test_a_session_leaves_the_callers_model_as_it_was(level):
    proto = _model()
    before = proto.SerializeToString()
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    session = ort.InferenceSession(proto, so)
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], np.maximum(x @ numpy_helper.to_array(proto.graph.initializer[0]), 0),
                               rtol=1e-6)
    assert proto.SerializeToString() == before
