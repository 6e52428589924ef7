"""Element types of com.microsoft quantized ops' outputs (host/runtime/contrib_types.py): onnx's
shape inference has no schemas for them, and a plugin kernel cannot allocate an untyped output
(found on the H100: QLinearAdd on the CUDA EP, "value 's' has no inferred element type")."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from host.runtime.model import build_graph

MS = "com.microsoft"


def _model(dtype=np.uint8):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(np.array(v, t), n) for n, v, t in
             (("sa", 0.1, np.float32), ("za", 3, dtype), ("sb", 0.2, np.float32), ("zb", 5, dtype),
              ("sc", 0.3, np.float32), ("zc", 7, dtype))]
    nodes = [helper.make_node("QLinearAdd", ["A", "sa", "za", "B", "sb", "zb", "sc", "zc"], ["C"], domain=MS),
             helper.make_node("QLinearMul", ["C", "sc", "zc", "B", "sb", "zb", "sa", "za"], ["D"], domain=MS),
             helper.make_node("DequantizeLinear", ["D", "sa", "za"], ["Y"])]
    ins = [helper.make_tensor_value_info(n, elem, [2, 3]) for n in "AB"]
    graph = helper.make_graph(nodes, "q", ins, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=10)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_quantized_outputs_take_their_input_type(dtype):
    g = build_graph(_model(dtype))
    want = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    assert g.values["C"].elem_type == want and g.values["D"].elem_type == want


def test_float_and_qgemm_outputs():
    inits = [numpy_helper.from_array(np.array(v, t), n) for n, v, t in
             (("s", 0.1, np.float32), ("z", 0, np.uint8), ("w", np.ones((3, 4)), np.uint8))]
    nodes = [helper.make_node("MatMulIntegerToFloat", ["A", "w", "s", "s", "z", "z"], ["F"], domain=MS),
             helper.make_node("QGemm", ["A", "s", "z", "w", "s", "z", "", "s", "z"], ["Q"], domain=MS),
             helper.make_node("QGemm", ["A", "s", "z", "w", "s", "z"], ["G"], domain=MS)]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("A", TensorProto.UINT8, [2, 3])],
                              [helper.make_tensor_value_info(n, 0, [2, 4]) for n in "FQG"], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=10)
    g = build_graph(model)
    assert [g.values[n].elem_type for n in "FQG"] == [TensorProto.FLOAT, TensorProto.UINT8, TensorProto.FLOAT]


def test_onnx_nodes_after_them_get_types_too():
    """A QLinearMatMul and a Reshape reading a QLinearAdd's output: onnx leaves them untyped."""
    model = _model()
    inits = [numpy_helper.from_array(np.array(v, t), n) for n, v, t in
             (("w", np.ones((3, 3)), np.uint8), ("shape", [3, 2], np.int64))]
    model.graph.initializer.extend(inits)
    model.graph.node.insert(1, helper.make_node("QLinearMatMul", ["C", "sc", "zc", "w", "sb", "zb", "sa", "za"], ["M"]))
    model.graph.node.insert(2, helper.make_node("Reshape", ["M", "shape"], ["R"]))
    model.graph.node.insert(3, helper.make_node("MatMulInteger", ["C", "w"], ["I"]))
    g = build_graph(model)
    assert [g.values[n].elem_type for n in "MRI"] == [TensorProto.UINT8, TensorProto.UINT8, TensorProto.INT32]


def test_the_cpu_ep_still_matches_onnxruntime():
    model = _model().SerializeToString()
    rng = np.random.default_rng(0)
    feeds = {n: rng.integers(0, 255, (2, 3)).astype(np.uint8) for n in "AB"}
    got = host.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, atol=0.11)  # one quantization step of the last op at most
