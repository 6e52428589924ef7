"""The optimizer's fusion of quantize_dynamic's MatMul chain (DynamicQuantizeLinear, MatMulInteger, Cast,
two Muls, the bias Add) into com.microsoft DynamicQuantizeMatMul (host/optimizer/rules/qdq_dynamic.py).
References: onnxruntime on the model as written (no optimizations) and on the fused graph."""

from __future__ import annotations

import logging
import os
from collections import Counter

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from host.optimizer.fallback import expand_unclaimed
from host.optimizer.pipeline import optimize
from tests.host import test_quantized
from tests.host.test_quantized import MODELS

quantization = pytest.importorskip("onnxruntime.quantization", reason="onnxruntime's quantizer makes the models")


def _ort(model: onnx.ModelProto, optimized: bool = False) -> onnxruntime.InferenceSession:
    so = onnxruntime.SessionOptions()
    if not optimized:
        so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return onnxruntime.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _block() -> onnx.ModelProto:
    """test_quantized's transformer block, leaving that module's RNG where it was (its own cases draw
    their data from it, and some accept no more than a few one-step differences on that data)."""
    state = test_quantized.RNG.get_state()
    try:
        return test_quantized.small_transformer_block()
    finally:
        test_quantized.RNG.set_state(state)


def _dynamic(tmp_path, model: onnx.ModelProto, per_channel: bool) -> onnx.ModelProto:
    src, out = os.path.join(tmp_path, "float.onnx"), os.path.join(tmp_path, "dynamic.onnx")
    onnx.save(model, src)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer's INFO chatter; restored: caplog tests read WARNING records
    try:
        quantization.quantize_dynamic(src, out, per_channel=per_channel)
    finally:
        root.setLevel(level)
    return onnx.load(out)


@pytest.mark.parametrize("per_channel", [False, True])
def test_dynamic_chain_becomes_dynamic_quantize_matmul(tmp_path, per_channel):
    model = _dynamic(tmp_path, _block(), per_channel)
    fused = optimize(model, "ORT_ENABLE_EXTENDED").model
    ops = Counter(n.op_type for n in fused.graph.node)
    # both MatMuls, and the first one's bias Add (the second Add is the residual: it stays)
    assert ops["DynamicQuantizeMatMul"] == 2 and ops["Add"] == 1
    assert not {"DynamicQuantizeLinear", "MatMulInteger", "Cast", "Mul"} & set(ops)
    as_written, on_fused = _ort(model), _ort(fused)
    eph = host.InferenceSession(model.SerializeToString())
    for seed in range(3):
        x = np.random.RandomState(seed).rand(*MODELS["transformer"][1]).astype(np.float32)
        want = as_written.run(None, {"x": x})[0]
        np.testing.assert_allclose(on_fused.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(eph.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-7)


def test_a_shared_dynamic_quantization_stays_as_written():
    """Two MatMuls read one DynamicQuantizeLinear (as Q, K, V projections do): the chain's values have
    other readers, so nothing fuses."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array(rng.randint(0, 255, (8, 4)).astype(np.uint8), f"w{i}") for i in (1, 2)]
    inits += [numpy_helper.from_array(np.array(0.01 * i, np.float32), f"s{i}") for i in (1, 2)]
    inits += [numpy_helper.from_array(np.array(128, np.uint8), f"z{i}") for i in (1, 2)]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "xs", "xz"])]
    for i in (1, 2):
        nodes += [helper.make_node("MatMulInteger", ["q", f"w{i}", "xz", f"z{i}"], [f"p{i}"]),
                  helper.make_node("Cast", [f"p{i}"], [f"c{i}"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["xs", f"s{i}"], [f"m{i}"]),
                  helper.make_node("Mul", [f"c{i}", f"m{i}"], [f"y{i}"])]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [3, 4]) for i in (1, 2)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    ops = Counter(n.op_type for n in optimize(model, "ORT_ENABLE_EXTENDED").model.graph.node)
    assert ops["MatMulInteger"] == 2 and "DynamicQuantizeMatMul" not in ops
    x = np.random.RandomState(1).randn(3, 8).astype(np.float32)
    for got, want in zip(host.InferenceSession(model.SerializeToString()).run(None, {"x": x}),
                         _ort(model).run(None, {"x": x})):
        np.testing.assert_array_equal(got, want)


def test_unclaimed_dynamic_quantize_matmul_expands_to_the_chain(tmp_path):
    fused = optimize(_dynamic(tmp_path, _block(), False), "ORT_ENABLE_EXTENDED").model
    names = [n.name for n in fused.graph.node if n.op_type == "DynamicQuantizeMatMul"]
    expanded = expand_unclaimed(fused, names)
    ops = Counter(n.op_type for n in expanded.graph.node)
    assert "DynamicQuantizeMatMul" not in ops and ops["MatMulInteger"] == 2 and ops["DynamicQuantizeLinear"] == 2
    x = np.random.RandomState(5).rand(*MODELS["transformer"][1]).astype(np.float32)
    np.testing.assert_allclose(_ort(expanded).run(None, {"x": x})[0], _ort(fused).run(None, {"x": x})[0],
                               rtol=1e-6, atol=1e-7)
