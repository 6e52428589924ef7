"""int4 / uint4 and float8 (and float4, int2) element types through the loader and the CPU EP's
QuantizeLinear / DequantizeLinear, against onnx's ReferenceEvaluator and onnxruntime (where it has the
kernel: it cannot take or return these types through its Python API, so those models keep them inside)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import host

RNG = np.random.RandomState(3)
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits, opset=21):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, t, s) for k, t, s in inputs],
                              [helper.make_tensor_value_info(k, t, s) for k, t, s in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ephost(model, feeds):
    return host.InferenceSession(model.SerializeToString()).run(None, feeds)


def _reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


@pytest.mark.parametrize("qtype", [TensorProto.INT4, TensorProto.UINT4])
def test_packed_4bit_weights_dequantize_blocked_like_onnxruntime(qtype):
    """A blocked int4 weight initializer (two values a byte in the file) dequantized and multiplied,
    the form of 4-bit weight-only quantized models."""
    dt = np.dtype(ml_dtypes.int4 if qtype == TensorProto.INT4 else ml_dtypes.uint4)
    lo, hi = int(ml_dtypes.iinfo(dt).min), int(ml_dtypes.iinfo(dt).max)
    w = RNG.randint(lo, hi + 1, (8, 6)).astype(dt)
    inits = [numpy_helper.from_array(w, "w"),
             numpy_helper.from_array((RNG.rand(4, 6) * 0.1 + 0.01).astype(np.float32), "s"),
             numpy_helper.from_array(RNG.randint(lo, hi + 1, (4, 6)).astype(dt), "zp")]
    assert inits[0].data_type == qtype and len(inits[0].raw_data) == w.size // 2  # packed in the file
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wf"], axis=0, block_size=2),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    model = _model(nodes, [("x", F, [3, 8])], [("y", F, [3, 6])], inits)
    feeds = {"x": RNG.randn(3, 8).astype(np.float32)}
    got = _ephost(model, feeds)[0]
    np.testing.assert_allclose(got, _reference(model, feeds)[0], rtol=1e-5, atol=1e-6)
    ort = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, ort.run(None, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", [TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT8E4M3FN,
                                   TensorProto.FLOAT8E5M2])
def test_quantize_dequantize_round_trip_like_onnxruntime(qtype):
    """x -> Q -> DQ through a low-bit type: rounding half to even and saturation (int4), the float8
    cast with saturation (out-of-range values become the largest finite value)."""
    x = np.array([[-300.0, -9.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.49, 7.5, 448.0, 70000.0]], np.float32)
    zp_dtype = helper.tensor_dtype_to_np_dtype(qtype)
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.float32).astype(zp_dtype), "zp")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])]
    model = _model(nodes, [("x", F, [1, 12])], [("y", F, [1, 12])], inits)
    got = _ephost(model, {"x": x})[0]
    np.testing.assert_array_equal(got, _reference(model, {"x": x})[0])
    ort = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(got, ort.run(None, {"x": x})[0])


@pytest.mark.parametrize("qtype,saturate", [(TensorProto.FLOAT8E4M3FN, 0), (TensorProto.FLOAT8E5M2FNUZ, 1),
                                            (TensorProto.INT4, 1)])
def test_low_bit_outputs_are_ml_dtypes_arrays(qtype, saturate):
    """A graph output of a low-bit type comes back as the ml_dtypes array onnx's reference returns."""
    x = (RNG.randn(2, 5) * 20).astype(np.float32)
    zp = numpy_helper.from_array(np.array(0, np.float32).astype(helper.tensor_dtype_to_np_dtype(qtype)), "zp")
    attrs = {"saturate": saturate} if qtype != TensorProto.INT4 else {}
    model = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **attrs)],
                   [("x", F, [2, 5])], [("q", qtype, [2, 5])],
                   [numpy_helper.from_array(np.array(0.5, np.float32), "s"), zp])
    got, want = _ephost(model, {"x": x})[0], _reference(model, {"x": x})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
