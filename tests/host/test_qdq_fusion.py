"""The optimizer's QDQ fusion (host/optimizer/rules/qdq.py): QDQ models made by onnxruntime's
quantize_static run on integer kernels, with the results of onnxruntime.

Two references: onnxruntime running the graph ephost's optimizer wrote (its own QLinearConv, QLinearMatMul,
QGemm, ... kernels, optimizations off): ephost's integer outputs must equal it bit for bit; and
onnxruntime on the original QDQ model with its own fusions: within one output quantization step
(onnxruntime leaves some groups in float, e.g. where a DQ feeds two nodes, and the float path may round
an intermediate activation the other way).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import onnx
import onnxruntime
import pytest

import host
from host.optimizer.pipeline import optimize
from tests.host.test_quantized import MODELS, _Reader

quantization = pytest.importorskip("onnxruntime.quantization", reason="onnxruntime's quantizer makes the models")

FLOAT_OPS = {"Conv", "MatMul", "Gemm", "Add", "Softmax", "GlobalAveragePool"}


@pytest.fixture(scope="module")
def qdq_models(tmp_path_factory):
    """{(model name, per_channel): path} of QDQ models quantized by onnxruntime."""
    out_dir = str(tmp_path_factory.mktemp("qdq"))
    paths = {}
    for name, (build, shape) in MODELS.items():
        src = os.path.join(out_dir, f"{name}.onnx")
        onnx.save(build(), src)
        for per_channel in (False, True):
            dst = os.path.join(out_dir, f"{name}_{per_channel}.onnx")
            quantization.quantize_static(src, dst, _Reader(shape), quant_format=quantization.QuantFormat.QDQ,
                                         per_channel=per_channel)
            paths[name, per_channel] = dst
    return paths


def _ort(model, level=onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL):
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = level
    data = model if isinstance(model, str) else model.SerializeToString()
    return onnxruntime.InferenceSession(data, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_qdq_model_runs_on_integer_kernels_like_onnxruntime(qdq_models, name, per_channel):
    path = qdq_models[name, per_channel]
    fused = optimize(onnx.load(path), "ORT_ENABLE_EXTENDED").model
    ops = Counter(n.op_type for n in fused.graph.node)
    assert not FLOAT_OPS & set(ops), ops  # every float compute op became an integer kernel
    assert ops["DequantizeLinear"] == 1 and ops["QuantizeLinear"] == 1  # only the model's input and output
    shape = MODELS[name][1]
    session = host.InferenceSession(path)
    exact, ort_own = _ort(fused, onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL), _ort(path)
    y_scale = max(float(onnx.numpy_helper.to_array(t)) for t in onnx.load(path).graph.initializer
                  if t.name == "y_scale")
    for seed in range(3):
        x = (np.random.RandomState(seed).rand(*shape) * (1 + seed)).astype(np.float32)
        got = session.run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, exact.run(None, {"x": x})[0])
        np.testing.assert_allclose(got, ort_own.run(None, {"x": x})[0], rtol=0, atol=y_scale * 1.0001)


def test_fusion_waits_for_the_extended_level(qdq_models):
    model = onnx.load(qdq_models["cnn", False])
    basic = optimize(model, "ORT_ENABLE_BASIC").model
    assert {"Conv", "Gemm"} <= {n.op_type for n in basic.graph.node}
    extended = optimize(model, "ORT_ENABLE_EXTENDED").model
    assert {"QLinearConv", "QGemm"} <= {n.op_type for n in extended.graph.node}


def test_group_with_a_wrong_bias_scale_stays_float(qdq_models):
    """A Conv bias DQ whose scale is not x_scale * w_scale cannot be added to the int32 accumulator
    unscaled: the group is left as written, and the session still matches onnxruntime."""
    model = onnx.load(qdq_models["cnn", False])
    init = {t.name: t for t in model.graph.initializer}
    scale = onnx.numpy_helper.to_array(init["b1_quantized_scale"])
    init["b1_quantized_scale"].CopyFrom(onnx.numpy_helper.from_array(scale * 2, "b1_quantized_scale"))
    ops = Counter(n.op_type for n in optimize(model, "ORT_ENABLE_EXTENDED").model.graph.node)
    assert ops["Conv"] == 1 and ops["QLinearConv"] == 1
    x = np.random.RandomState(0).rand(1, 3, 8, 8).astype(np.float32)
    got = host.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    want = _ort(model, onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unclaimed_integer_kernels_expand_back_to_the_qdq_group(qdq_models, name):
    """For an EP without the integer kernels: the expansion gives the DQ -> float op -> Q graph, with
    onnxruntime's results on the original QDQ model (both run unfused)."""
    from host.optimizer.fallback import expand_unclaimed

    path = qdq_models[name, True]
    fused = optimize(onnx.load(path), "ORT_ENABLE_EXTENDED").model
    expanded = expand_unclaimed(fused, [n.name for n in fused.graph.node])
    assert not {n.op_type for n in expanded.graph.node} & {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd"}
    x = np.random.RandomState(0).rand(*MODELS[name][1]).astype(np.float32)
    off = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    np.testing.assert_array_equal(_ort(expanded, off).run(None, {"x": x})[0], _ort(path, off).run(None, {"x": x})[0])


@pytest.mark.parametrize("per_column", [False, True])
def test_matmul_with_a_float_result_becomes_matmul_integer_to_float(per_column):
    """DQ(a), DQ(b) -> MatMul with no Q after it (a float output): com.microsoft MatMulIntegerToFloat,
    as onnxruntime fuses it; the result within float32 rounding of the float MatMul's."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.RandomState(5)
    b_scale = (rng.rand(6) * 0.01 + 0.001).astype(np.float32) if per_column else np.float32(0.004)
    inits = [numpy_helper.from_array(rng.randint(-127, 127, (8, 6)).astype(np.int8), "bq"),
             numpy_helper.from_array(np.asarray(b_scale), "bs"),
             numpy_helper.from_array(np.zeros(np.shape(b_scale), np.int8), "bz"),
             numpy_helper.from_array(np.array(0.02, np.float32), "as"), numpy_helper.from_array(np.array(7, np.uint8), "az")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "as", "az"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "as", "az"], ["xf"]),
             helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["bf"], axis=1),
             helper.make_node("MatMul", ["xf", "bf"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    ops = Counter(n.op_type for n in optimize(model, "ORT_ENABLE_EXTENDED").model.graph.node)
    assert ops["MatMulIntegerToFloat"] == 1 and ops["MatMul"] == 0
    x = rng.rand(3, 8).astype(np.float32) * 3
    got = host.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, _ort(model).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_relu_before_a_q_that_clamps_at_zero_is_fused_away(qdq_models):
    """DQ -> Conv -> Relu -> Q, the Q's zero point its type's minimum (int8 -128): the Q already clamps
    negatives, so the group becomes QLinearConv alone, as onnxruntime fuses it; with another zero point
    the Relu matters and the group stays."""
    model = onnx.load(qdq_models["cnn", False])
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "r1")
    conv = next(n for n in model.graph.node if n.op_type == "Conv" and n.output[0] == "r1")
    conv.output[0] = "r1_pre_relu"
    model.graph.node.insert(list(model.graph.node).index(q), onnx.helper.make_node("Relu", ["r1_pre_relu"], ["r1"]))
    zp = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == q.input[2]))
    assert int(zp) == -128
    ops = Counter(n.op_type for n in optimize(model, "ORT_ENABLE_EXTENDED").model.graph.node)
    assert ops["Relu"] == 0 and ops["QLinearConv"] == 2
    x = np.random.RandomState(1).rand(1, 3, 8, 8).astype(np.float32)
    got = host.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, _ort(model).run(None, {"x": x})[0])
    shifted = onnx.ModelProto()
    shifted.CopyFrom(model)
    for t in shifted.graph.initializer:
        if t.name == q.input[2]:
            t.CopyFrom(onnx.numpy_helper.from_array(np.array(-100, np.int8), t.name))
    ops = Counter(n.op_type for n in optimize(shifted, "ORT_ENABLE_EXTENDED").model.graph.node)
    assert ops["Relu"] == 1
