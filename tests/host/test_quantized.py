"""Quantized models on the CPU EP, against onnxruntime (CPU) on the same model and inputs.

Models are made here by onnxruntime's own quantizer (quantize_static in the QDQ and QOperator
formats with a small calibration reader, and quantize_dynamic) from a small CNN and a small
transformer-like MatMul block; single-node models cover per-axis and blocked parameters, rounding
ties, saturation and the com.microsoft ops.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from host.errors import KernelError

quantization = pytest.importorskip("onnxruntime.quantization", reason="onnxruntime's quantizer makes the models")

RNG = np.random.RandomState(0)


def _init(name, *shape, scale=0.3):
    return numpy_helper.from_array((RNG.randn(*shape) * scale).astype(np.float32), name)


def small_cnn() -> onnx.ModelProto:
    """Conv+Relu, MaxPool, Conv, a residual Add, GlobalAveragePool, Flatten, Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["a2"]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"]),
    ]
    inits = [_init("w1", 8, 3, 3, 3), _init("b1", 8, scale=0.1), _init("w2", 8, 8, 3, 3, scale=0.2),
             _init("wf", 8, 5), _init("bf", 5)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def small_transformer_block() -> onnx.ModelProto:
    """MatMul+Add+Relu, MatMul, a residual Add and Softmax over (1, 4, 16) tokens."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"]),
        helper.make_node("Add", ["m2", "x"], ["a2"]),
        helper.make_node("Softmax", ["a2"], ["y"], axis=-1),
    ]
    inits = [_init("w1", 16, 32), _init("b1", 32, scale=0.1), _init("w2", 32, 16, scale=0.2)]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


MODELS = {"cnn": (small_cnn, (1, 3, 8, 8)), "transformer": (small_transformer_block, (1, 4, 16))}


class _Reader(quantization.CalibrationDataReader):
    def __init__(self, shape):
        rng = np.random.RandomState(1)
        self._feeds = iter([{"x": rng.rand(*shape).astype(np.float32)} for _ in range(4)])

    def get_next(self):
        return next(self._feeds, None)


def _quantized(tmp_dir, name: str, fmt: str) -> str:
    build, shape = MODELS[name]
    src = os.path.join(tmp_dir, f"{name}.onnx")
    if not os.path.exists(src):
        onnx.save(build(), src)
    out = os.path.join(tmp_dir, f"{name}_{fmt}.onnx")
    if fmt == "dynamic":
        quantization.quantize_dynamic(src, out)
    else:
        quant_format = quantization.QuantFormat.QDQ if fmt == "qdq" else quantization.QuantFormat.QOperator
        quantization.quantize_static(src, out, _Reader(shape), quant_format=quant_format)
    return out


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quantized"))


# The ops each quantized model must contain (so that the comparison exercises the quantized kernels).
EXPECTED_OPS = {
    ("cnn", "qop"): {"QLinearConv", "QGemm", "QLinearAdd", "QLinearGlobalAveragePool", "QuantizeLinear"},
    ("cnn", "qdq"): {"QuantizeLinear", "DequantizeLinear"},
    ("cnn", "dynamic"): {"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"},
    ("transformer", "qop"): {"QLinearMatMul", "QLinearAdd", "QLinearSoftmax"},
    ("transformer", "qdq"): {"QuantizeLinear", "DequantizeLinear"},
    ("transformer", "dynamic"): {"MatMulInteger", "DynamicQuantizeLinear"},
}


@pytest.mark.parametrize("name,fmt", sorted(EXPECTED_OPS))
def test_quantized_model_matches_onnxruntime(quant_dir, name, fmt):
    path = _quantized(quant_dir, name, fmt)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert EXPECTED_OPS[name, fmt] <= ops
    x = np.random.RandomState(2).rand(*MODELS[name][1]).astype(np.float32)
    expected = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = host.InferenceSession(path).run(None, {"x": x})[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if (name, fmt) == ("transformer", "qdq"):
        # Both fuse QDQ groups into integer kernels (tests/host/test_qdq_fusion.py), but onnxruntime
        # leaves the groups whose DQ feeds two nodes (the residual input) and the Adds in float; a
        # quantized activation may round the other way there: the bound is one output quantization step.
        np.testing.assert_allclose(got, expected, atol=1 / 255 + 1e-6)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


# ---- single nodes ---------------------------------------------------------------------------------------


def _node_model(node, inputs: dict, outputs: dict, opset=21, ms=False):
    vis = [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()]
    outs = [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()]
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    return helper.make_model(helper.make_graph([node], "g", vis, outs), opset_imports=imports)


def _compare(model, feeds, max_step=0):
    """Runs both; integer outputs equal (or within `max_step` quantization steps for the
    com.microsoft element-wise ops, whose vectorized onnxruntime kernels may round a tie the
    other way), float outputs close."""
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = host.InferenceSession(model.SerializeToString()).run(None, feeds)
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        if e.dtype.kind in "iu":
            diff = np.abs(g.astype(np.int64) - e.astype(np.int64))
            assert diff.max(initial=0) <= max_step
            assert (diff == 0).mean() >= (0.98 if max_step else 1.0)
        else:
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


U8, I8, F = TensorProto.UINT8, TensorProto.INT8, TensorProto.FLOAT


@pytest.mark.parametrize("qtype", [U8, I8, TensorProto.UINT16, TensorProto.INT16])
def test_quantize_linear_rounds_half_to_even_and_saturates(qtype):
    x = np.array([[-300.0, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.49, 70000.0]], dtype=np.float32)
    zp = numpy_helper.from_array(np.array(3, dtype=helper.tensor_dtype_to_np_dtype(qtype)), "zp")
    node = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"])
    model = _node_model(node, {"x": (F, [1, 9])}, {"y": (qtype, [1, 9])})
    model.graph.initializer.extend([numpy_helper.from_array(np.array(1.0, np.float32), "s"), zp])
    _compare(model, {"x": x})


def test_quantize_dequantize_per_axis_and_blocked():
    x = RNG.randn(4, 6).astype(np.float32)
    per_axis = _node_model(helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], axis=0),
                           {"x": (F, [4, 6]), "s": (F, [4]), "zp": (I8, [4])}, {"y": (I8, [4, 6])})
    _compare(per_axis, {"x": x, "s": np.array([0.01, 0.02, 0.05, 0.1], np.float32),
                        "zp": np.array([0, 1, -3, 5], np.int8)})
    blocked = _node_model(helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], axis=1, block_size=3),
                          {"x": (F, [4, 6]), "s": (F, [4, 2]), "zp": (U8, [4, 2])}, {"y": (U8, [4, 6])})
    _compare(blocked, {"x": x, "s": (RNG.rand(4, 2) * 0.05 + 0.01).astype(np.float32),
                       "zp": RNG.randint(100, 150, (4, 2)).astype(np.uint8)})
    deq = _node_model(helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1, block_size=2),
                      {"q": (U8, [2, 4]), "s": (F, [2, 2]), "zp": (U8, [2, 2])}, {"y": (F, [2, 4])})
    _compare(deq, {"q": RNG.randint(0, 255, (2, 4)).astype(np.uint8), "s": RNG.rand(2, 2).astype(np.float32),
                   "zp": RNG.randint(0, 255, (2, 2)).astype(np.uint8)})


@pytest.mark.parametrize("wtype", [U8, I8])
def test_qlinear_conv_per_channel_with_bias(wtype):
    wdt = helper.tensor_dtype_to_np_dtype(wtype)
    lo, hi = np.iinfo(wdt).min, np.iinfo(wdt).max
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            pads=[1, 1, 1, 1], strides=[2, 1], group=2)
    model = _node_model(node, {"x": (U8, [1, 4, 7, 6])}, {"y": (U8, [1, 6, 4, 6])}, opset=13)
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"), numpy_helper.from_array(np.array(120, np.uint8), "xz"),
        numpy_helper.from_array(RNG.randint(lo, hi, (6, 2, 3, 3)).astype(wdt), "w"),
        numpy_helper.from_array((RNG.rand(6) * 0.01 + 0.001).astype(np.float32), "ws"),
        numpy_helper.from_array(np.zeros(6, wdt) if wtype == I8 else RNG.randint(100, 150, 6).astype(wdt), "wz"),
        numpy_helper.from_array(np.array(0.05, np.float32), "ys"), numpy_helper.from_array(np.array(128, np.uint8), "yz"),
        numpy_helper.from_array(RNG.randint(-500, 500, 6).astype(np.int32), "b")])
    _compare(model, {"x": RNG.randint(0, 255, (1, 4, 7, 6)).astype(np.uint8)})


def test_qlinear_matmul_matmul_integer_conv_integer():
    a = RNG.randint(0, 255, (2, 3, 5)).astype(np.uint8)
    b = RNG.randint(-128, 127, (5, 4)).astype(np.int8)
    qmm = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    model = _node_model(qmm, {"a": (U8, [2, 3, 5]), "b": (I8, [5, 4])}, {"y": (U8, [2, 3, 4])}, opset=13)
    model.graph.initializer.extend([numpy_helper.from_array(v, k) for k, v in {
        "as": np.array(0.03, np.float32), "az": np.array(7, np.uint8), "bs": np.array(0.02, np.float32),
        "bz": np.array(0, np.int8), "ys": np.array(0.1, np.float32), "yz": np.array(100, np.uint8)}.items()])
    _compare(model, {"a": a, "b": b})
    mmi = _node_model(helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"]),
                      {"a": (U8, [2, 3, 5]), "b": (I8, [5, 4]), "az": (U8, [])}, {"y": (TensorProto.INT32, [2, 3, 4])})
    _compare(mmi, {"a": a, "b": b, "az": np.array(9, np.uint8)})
    conv = _node_model(helper.make_node("ConvInteger", ["x", "w", "xz"], ["y"], pads=[0, 1, 0, 1]),
                       {"x": (U8, [1, 2, 4, 4]), "w": (U8, [3, 2, 2, 2]), "xz": (U8, [])},
                       {"y": (TensorProto.INT32, [1, 3, 3, 5])})
    _compare(conv, {"x": RNG.randint(0, 255, (1, 2, 4, 4)).astype(np.uint8),
                    "w": RNG.randint(0, 255, (3, 2, 2, 2)).astype(np.uint8), "xz": np.array(5, np.uint8)})


def _ms_params(model, **values):
    model.graph.initializer.extend([numpy_helper.from_array(np.asarray(v), k) for k, v in values.items()])
    return model


MS_UNARY = {
    "QLinearSigmoid": {},
    "QLinearLeakyRelu": {"alpha": 0.1},
    "QLinearGlobalAveragePool": {},
    "QLinearAveragePool": {"kernel_shape": [2, 2], "strides": [2, 2]},
    "QLinearSoftmax": {"axis": -1, "opset": 13},
}


@pytest.mark.parametrize("op", sorted(MS_UNARY))
def test_microsoft_unary_ops_match_onnxruntime(op):
    out_shape = {"QLinearGlobalAveragePool": [1, 3, 1, 1], "QLinearAveragePool": [1, 3, 3, 3]}.get(op, [1, 3, 6, 6])
    node = helper.make_node(op, ["x", "xs", "xz", "ys", "yz"], ["y"], domain="com.microsoft", **MS_UNARY[op])
    model = _node_model(node, {"x": (U8, [1, 3, 6, 6])}, {"y": (U8, out_shape)}, opset=13, ms=True)
    y_scale = np.float32(1 / 256) if op in ("QLinearSigmoid", "QLinearSoftmax") else np.float32(0.03)
    _ms_params(model, xs=np.float32(0.05), xz=np.uint8(128), ys=y_scale, yz=np.uint8(0 if y_scale < 0.01 else 100))
    _compare(model, {"x": RNG.randint(0, 255, (1, 3, 6, 6)).astype(np.uint8)}, max_step=1)


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_microsoft_binary_ops_match_onnxruntime(op):
    node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"], domain="com.microsoft")
    model = _node_model(node, {"a": (I8, [4, 8]), "b": (I8, [8])}, {"y": (I8, [4, 8])}, opset=13, ms=True)
    _ms_params(model, **{"as": np.float32(0.02), "az": np.int8(3), "bs": np.float32(0.03), "bz": np.int8(-2),
                         "ys": np.float32(0.04), "yz": np.int8(1)})
    _compare(model, {"a": RNG.randint(-128, 127, (4, 8)).astype(np.int8),
                     "b": RNG.randint(-128, 127, 8).astype(np.int8)}, max_step=1)


def test_microsoft_gemm_concat_and_float_output_matmuls_match_onnxruntime():
    a = RNG.randint(0, 255, (3, 5)).astype(np.uint8)
    qgemm = helper.make_node("QGemm", ["a", "as", "az", "b", "bs", "bz", "c", "ys", "yz"], ["y"],
                             domain="com.microsoft", transB=1, alpha=0.5)
    model = _node_model(qgemm, {"a": (U8, [3, 5])}, {"y": (U8, [3, 4])}, opset=13, ms=True)
    _ms_params(model, **{"as": np.float32(0.02), "az": np.uint8(10), "b": RNG.randint(-128, 127, (4, 5)).astype(np.int8),
                         "bs": np.float32(0.01), "bz": np.int8(0), "c": RNG.randint(-99, 99, 4).astype(np.int32),
                         "ys": np.float32(0.01), "yz": np.uint8(120)})
    _compare(model, {"a": a})
    concat = helper.make_node("QLinearConcat", ["ys", "yz", "p", "ps", "pz", "q", "qs", "qz"], ["y"],
                              domain="com.microsoft", axis=1)
    model = _node_model(concat, {"p": (U8, [2, 3]), "q": (U8, [2, 2])}, {"y": (U8, [2, 5])}, opset=13, ms=True)
    _ms_params(model, ys=np.float32(0.05), yz=np.uint8(128), ps=np.float32(0.05), pz=np.uint8(128),
               qs=np.float32(0.02), qz=np.uint8(60))
    _compare(model, {"p": a[:2, :3], "q": a[:2, 3:]})
    x = RNG.randn(3, 5).astype(np.float32)
    dqmm = helper.make_node("DynamicQuantizeMatMul", ["x", "b", "bs", "bz", "bias"], ["y"], domain="com.microsoft")
    model = _node_model(dqmm, {"x": (F, [3, 5])}, {"y": (F, [3, 4])}, opset=13, ms=True)
    _ms_params(model, b=RNG.randint(-128, 127, (5, 4)).astype(np.int8), bs=(RNG.rand(4) * 0.01).astype(np.float32),
               bz=np.zeros(4, np.int8), bias=RNG.randn(4).astype(np.float32))
    _compare(model, {"x": x})
    mitf = helper.make_node("MatMulIntegerToFloat", ["a", "b", "as", "bs", "az", "bz"], ["y"], domain="com.microsoft")
    model = _node_model(mitf, {"a": (U8, [3, 5])}, {"y": (F, [3, 4])}, opset=13, ms=True)
    _ms_params(model, **{"b": RNG.randint(0, 255, (5, 4)).astype(np.uint8), "as": np.float32(0.02),
                         "bs": np.float32(0.03), "az": np.uint8(9), "bz": np.uint8(120)})
    _compare(model, {"a": a})


def test_per_axis_scale_of_the_wrong_length_is_a_kernel_error():
    model = _node_model(helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1),
                        {"q": (U8, [2, 4]), "s": (F, [3])}, {"y": (F, [2, 4])})
    sess = host.InferenceSession(model.SerializeToString())
    with pytest.raises(KernelError, match=r"^node '.*' \(DequantizeLinear\) on CPUExecutionProvider failed: per-axis "
                                          r"parameter of length 3 does not match axis 1 of input shape \(2, 4\)$"):
        sess.run(None, {"q": np.zeros((2, 4), np.uint8), "s": np.ones(3, np.float32)})


def test_unsupported_op_error_names_the_models_own_opset():
    """The optimizer converts this opset-12 model to opset 23 (for its attention fusion); the
    message still names opset 12."""
    nodes = [helper.make_node("MatMul", ["x", "x"], ["m"]), helper.make_node("Softmax", ["m"], ["s"]),
             helper.make_node("MatMul", ["s", "x"], ["t"]),
             helper.make_node("Reshape", ["t", "shape"], ["t4"]),
             helper.make_node("MaxRoiPool", ["t4", "rois"], ["y"], pooled_shape=[1, 1])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, [4, 4]), helper.make_tensor_value_info("rois", F, [1, 5])],
        [helper.make_tensor_value_info("y", F, [1, 1, 1, 1])],
        [numpy_helper.from_array(np.array([1, 1, 4, 4], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    with pytest.raises(host.errors.ModelError, match=r"^no execution provider supports 1 node\(s\): '.*' "
                                                     r"\(ai.onnx::MaxRoiPool, opset 12\)$"):
        host.InferenceSession(model.SerializeToString())


@pytest.mark.parametrize("k", [258, 1000])
def test_integer_matmul_stays_exact_past_float32_integers(k):
    """Below K = 258 the 8-bit products accumulate in float32 exactly; past it partial sums pass 2**24
    and the kernel must switch to float64 (odd sums there are not float32 values)."""
    a = RNG.randint(200, 256, (3, k)).astype(np.uint8)
    b = RNG.randint(-128, -100, (k, 4)).astype(np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    model = _node_model(node, {"a": (U8, [3, k]), "b": (I8, [k, 4])}, {"y": (TensorProto.INT32, [3, 4])}, opset=13)
    model.graph.initializer.append(numpy_helper.from_array(np.array(1, np.uint8), "az"))
    _compare(model, {"a": a, "b": b})
