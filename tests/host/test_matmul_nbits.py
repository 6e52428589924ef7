"""Blocked weight-only quantization: com.microsoft MatMulNBits (host/cpu_ep/ops_quant_nbits.py) and the
optimizer's blocked DequantizeLinear -> MatMul fusion into it (host/optimizer/rules/qdq_nbits.py).

Models are quantized here by onnxruntime's own weight-only quantizer (MatMulNBitsQuantizer, QOperator and
QDQ formats) from a small MLP and a small transformer block; ephost's CPU EP must match onnxruntime's
session on the same model. Single-node models cover what the quantizer does not write (float zero
points, g_idx, bias, weights fed at run time) against a NumPy dequantization written here.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from host.cpu_ep import ops_quant_nbits
from host.errors import KernelError, ModelError
from host.optimizer.pipeline import optimize

nbits = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer",
                            reason="onnxruntime's weight-only quantizer makes the models")
QuantFormat = pytest.importorskip("onnxruntime.quantization").QuantFormat
RNG = np.random.RandomState(0)
MS = "com.microsoft"


def _w(name, *shape, scale=0.3):
    return numpy_helper.from_array((RNG.randn(*shape) * scale).astype(np.float32), name)


def small_mlp(k: int = 80) -> onnx.ModelProto:
    """MatMul + Add + Relu, MatMul; K = 80 is not a multiple of the block sizes (a padded last block)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["r1"]), helper.make_node("MatMul", ["r1", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 24])],
                              [_w("w1", k, 64), _w("b1", 64, scale=0.1), _w("w2", 64, 24)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def small_transformer_block(d: int = 64) -> onnx.ModelProto:
    """Single-head attention (Q, K, V and output projections), residual, LayerNormalization, a
    MatMul-Relu-MatMul feed-forward and a second residual, over (batch, tokens, d)."""
    mm = helper.make_node
    nodes = [
        mm("MatMul", ["x", "wq"], ["q"]), mm("MatMul", ["x", "wk"], ["k"]), mm("MatMul", ["x", "wv"], ["v"]),
        mm("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), mm("MatMul", ["q", "kt"], ["s"]),
        mm("Mul", ["s", "inv_sqrt_d"], ["ss"]), mm("Softmax", ["ss"], ["p"], axis=-1),
        mm("MatMul", ["p", "v"], ["att"]), mm("MatMul", ["att", "wo"], ["o"]), mm("Add", ["o", "x"], ["h"]),
        mm("LayerNormalization", ["h", "gamma", "beta"], ["n"], axis=-1),
        mm("MatMul", ["n", "w1"], ["f1"]), mm("Relu", ["f1"], ["f1r"]), mm("MatMul", ["f1r", "w2"], ["f2"]),
        mm("Add", ["f2", "n"], ["y"]),
    ]
    inits = [_w("wq", d, d), _w("wk", d, d), _w("wv", d, d), _w("wo", d, d), _w("w1", d, 2 * d),
             _w("w2", 2 * d, d), numpy_helper.from_array(np.array(d ** -0.5, np.float32), "inv_sqrt_d"),
             numpy_helper.from_array(np.ones(d, np.float32), "gamma"), _w("beta", d, scale=0.1)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "t", d]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "block", io[:1], io[1:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


MODELS = {"mlp": (small_mlp, [(1, 80), (5, 80), (33, 80)]),
          "transformer": (small_transformer_block, [(1, 4, 64), (2, 7, 64)])}


def _quantize(model: onnx.ModelProto, fmt, **config) -> onnx.ModelProto:
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs a line per MatMul; restored for later caplog tests
    try:
        quantizer = nbits.MatMulNBitsQuantizer(model, quant_format=fmt, **config)
        quantizer.process()
    finally:
        root.setLevel(level)
    return quantizer.model.model


def _ort(model: onnx.ModelProto, optimized: bool = True) -> onnxruntime.InferenceSession:
    so = onnxruntime.SessionOptions()
    if not optimized:
        so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return onnxruntime.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(shape):
    return {"x": np.random.RandomState(len(shape) * 7 + shape[0]).randn(*shape).astype(np.float32)}


def _close(got, expected, rel: float = 1e-5):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=rel, atol=rel * float(np.abs(expected).max()))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("bits,block_size,symmetric", [(4, 32, False), (4, 16, True), (8, 32, False), (8, 64, True)])
def test_matmul_nbits_model_matches_onnxruntime(name, bits, block_size, symmetric):
    build, shapes = MODELS[name]
    model = _quantize(build(), QuantFormat.QOperator, bits=bits, block_size=block_size, is_symmetric=symmetric)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == (2 if name == "mlp" else 6)
    assert any(i.name.endswith("zero_points") for i in model.graph.initializer) is not symmetric
    ref, eph = _ort(model), host.InferenceSession(model.SerializeToString())
    for shape in shapes:
        feeds = _feeds(shape)
        _close(eph.run(None, feeds)[0], ref.run(None, feeds)[0])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("symmetric", [False, True])
def test_blocked_qdq_weights_fuse_into_matmul_nbits(name, symmetric):
    build, shapes = MODELS[name]
    model = _quantize(build(), QuantFormat.QDQ, bits=4, block_size=32, is_symmetric=symmetric)
    assert Counter(n.op_type for n in model.graph.node)["DequantizeLinear"] == (2 if name == "mlp" else 6)
    fused = optimize(model, "ORT_ENABLE_EXTENDED").model
    ops = Counter(n.op_type for n in fused.graph.node)
    assert ops["MatMulNBits"] == (2 if name == "mlp" else 6) and "DequantizeLinear" not in ops
    # references: onnxruntime on the model as written (DQ, then a float MatMul) and on the graph with
    # only this fusion applied (its own MatMulNBits kernel: checks the repacked weights); both float32
    as_written, on_fused = _ort(model, optimized=False), _ort(_only_nbits_fusion(model), optimized=False)
    eph = host.InferenceSession(model.SerializeToString())
    for shape in shapes:
        feeds = _feeds(shape)
        got = eph.run(None, feeds)[0]
        _close(got, as_written.run(None, feeds)[0])
        _close(got, on_fused.run(None, feeds)[0])


def _only_nbits_fusion(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with DqMatMulToNBits applied and nothing else (no ephost-domain ops for onnxruntime)."""
    from onnxscript import rewriter

    from host.optimizer.rules.qdq_nbits import DqMatMulToNBits

    fused = ir.serde.deserialize_model(model)
    rewriter.rewrite(fused, pattern_rewrite_rules=[DqMatMulToNBits.rule()])
    ir.passes.common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(fused)
    assert any(n.op_type == "MatMulNBits" for n in fused.graph)
    return ir.serde.serialize_model(fused)


def test_blocked_qdq_against_onnxruntimes_own_fusion():
    """onnxruntime fuses the same pair at its default level, with accuracy_level 4 (A quantized to int8
    inside the kernel): ephost's float32 product differs from it by A's quantization error only."""
    model = _quantize(small_mlp(), QuantFormat.QDQ, bits=4, block_size=32)
    feeds = _feeds((5, 80))
    got = host.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    _close(got, _ort(model).run(None, feeds)[0], rel=2e-2)


def test_accuracy_level_is_accepted():
    model = _quantize(small_mlp(), QuantFormat.QOperator, bits=4, block_size=32, accuracy_level=4)
    assert all(a.i == 4 for n in model.graph.node for a in n.attribute if a.name == "accuracy_level")
    feeds = _feeds((5, 80))
    got = host.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    # exact against the float product of the same weights; onnxruntime's level 4 quantizes A to int8
    _close(got, _ort(model.__class__.FromString(_level0(model))).run(None, feeds)[0])
    _close(got, _ort(model).run(None, feeds)[0], rel=2e-2)


def _level0(model: onnx.ModelProto) -> bytes:
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    for node in copy.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 0
    return copy.SerializeToString()


# ---- single nodes, against a NumPy dequantization written here -----------------------------------


def _reference_weight(b, scales, zp, k, n, bits, block_size, g_idx=None) -> np.ndarray:
    """(K, N) float weight, one element at a time from the packed bytes (independent of the kernel)."""
    k_blocks = -(-k // block_size)
    b = b.reshape(n, -1)
    scales = scales.reshape(n, k_blocks)
    w = np.zeros((k, n), np.float32)
    for col in range(n):
        for row in range(k):
            byte, slot = divmod(row * bits, 8)
            code = (int(b[col, byte]) >> slot) & ((1 << bits) - 1)
            blk = row // block_size if g_idx is None else int(g_idx[row])
            if zp is None:
                z = 1 << (bits - 1)
            elif zp.dtype.kind == "f":
                z = float(zp.reshape(n, k_blocks)[col, blk])
            else:
                zbyte, zslot = divmod(blk * bits, 8)
                z = (int(zp.reshape(n, -1)[col, zbyte]) >> zslot) & ((1 << bits) - 1)
            w[row, col] = (code - z) * scales[col, blk]
    return w


def _nbits_node_model(k, n, bits, block_size, inputs: dict, constant=("b", "scales", "zp", "g_idx", "bias"),
                      **attrs) -> onnx.ModelProto:
    names = ["a", "b", "scales", "zp", "g_idx", "bias"]
    used = [nm if nm in inputs or nm == "a" else "" for nm in names]
    while used and not used[-1]:
        used.pop()
    node = helper.make_node("MatMulNBits", used, ["y"], domain=MS, K=k, N=n, bits=bits, block_size=block_size, **attrs)
    graph_inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])]
    inits = []
    for nm, arr in inputs.items():
        if nm in constant:
            inits.append(numpy_helper.from_array(arr, nm))
        else:
            graph_inputs.append(helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(arr.dtype),
                                                              list(arr.shape)))
    graph = helper.make_graph([node], "nbits", graph_inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])


def _random_node(k, n, bits, block_size, zp_kind="packed"):
    rng = np.random.RandomState(k + n + bits)
    k_blocks = -(-k // block_size)
    inputs = {"b": rng.randint(0, 256, (n, k_blocks, block_size * bits // 8)).astype(np.uint8),
              "scales": (rng.rand(n, k_blocks) * 0.1 + 0.01).astype(np.float32)}
    if zp_kind == "packed":
        inputs["zp"] = rng.randint(0, 256, (n, -(-k_blocks * bits // 8))).astype(np.uint8)
    elif zp_kind == "float":
        inputs["zp"] = (rng.rand(n, k_blocks) * (1 << bits)).astype(np.float32)
    return inputs


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("zp_kind", ["packed", "float", "none"])
def test_single_node_dequantizes_like_the_reference(bits, zp_kind):
    k, n, block_size = 40, 6, 16
    inputs = _random_node(k, n, bits, block_size, zp_kind)
    inputs["bias"] = np.linspace(-1, 1, n).astype(np.float32)
    a = np.random.RandomState(3).randn(3, k).astype(np.float32)
    got = host.InferenceSession(_nbits_node_model(k, n, bits, block_size, inputs).SerializeToString()).run(
        None, {"a": a})[0]
    w = _reference_weight(inputs["b"], inputs["scales"], inputs.get("zp"), k, n, bits, block_size)
    _close(got, a @ w + inputs["bias"])


def test_g_idx_names_each_rows_block():
    k, n, bits, block_size = 32, 4, 4, 16
    inputs = _random_node(k, n, bits, block_size)
    inputs["g_idx"] = np.random.RandomState(5).randint(0, 2, k).astype(np.int32)
    a = np.random.RandomState(4).randn(2, k).astype(np.float32)
    got = host.InferenceSession(_nbits_node_model(k, n, bits, block_size, inputs).SerializeToString()).run(
        None, {"a": a})[0]
    w = _reference_weight(inputs["b"], inputs["scales"], inputs["zp"], k, n, bits, block_size, inputs["g_idx"])
    _close(got, a @ w)


def test_weights_fed_at_run_time_are_dequantized_in_column_slices(monkeypatch):
    monkeypatch.setattr(ops_quant_nbits, "SLICE_BYTES", 3 * 4 * 48)  # 3 columns a slice: 3 slices of 8
    k, n, bits, block_size = 48, 8, 4, 16
    inputs = _random_node(k, n, bits, block_size)
    model = _nbits_node_model(k, n, bits, block_size, inputs, constant=())
    a = np.random.RandomState(6).randn(5, k).astype(np.float32)
    got = host.InferenceSession(model.SerializeToString()).run(None, {"a": a, **inputs})[0]
    w = _reference_weight(inputs["b"], inputs["scales"], inputs["zp"], k, n, bits, block_size)
    _close(got, a @ w)
    # and onnxruntime agrees on the same node
    _close(got, _ort(_nbits_node_model(k, n, bits, block_size, inputs)).run(None, {"a": a})[0])


def test_bad_bits_is_a_model_error():
    inputs = _random_node(32, 4, 4, 16)
    model = _nbits_node_model(32, 4, 3, 16, inputs)
    with pytest.raises(ModelError, match=r"^node '.*' \(MatMulNBits\): attribute 'bits' is 3; allowed: 2, 4 or 8"):
        host.InferenceSession(model.SerializeToString())


def test_wrong_weight_size_is_a_kernel_error():
    inputs = _random_node(32, 4, 4, 16)
    model = _nbits_node_model(48, 4, 4, 16, inputs)  # K=48 needs 3 blocks a column; B has 2
    with pytest.raises(KernelError, match=r"^node '.*' \(MatMulNBits\) on CPUExecutionProvider failed: input B has "
                                          r"64 elements \(shape \[4, 2, 8\]\); K=48, N=4, bits=4, block_size=16 need 96"):
        host.InferenceSession(model.SerializeToString()).run(None, {"a": np.ones((1, 48), np.float32)})


def test_unclaimed_matmul_nbits_expands_to_a_float_matmul():
    from host.optimizer.fallback import expand_unclaimed

    k, n, bits, block_size = 40, 6, 4, 16
    inputs = _random_node(k, n, bits, block_size, "float")
    inputs["bias"] = np.linspace(-1, 1, n).astype(np.float32)
    model = _nbits_node_model(k, n, bits, block_size, inputs)
    expanded = expand_unclaimed(model, ["MatMulNBits_0"])  # the session's name for the unnamed node
    assert Counter(nd.op_type for nd in expanded.graph.node) == {"Constant": 1, "MatMul": 1, "Add": 1}
    a = np.random.RandomState(7).randn(3, k).astype(np.float32)
    w = _reference_weight(inputs["b"], inputs["scales"], inputs["zp"], k, n, bits, block_size)
    _close(_ort(expanded).run(None, {"a": a})[0], a @ w + inputs["bias"])


@pytest.mark.parametrize("dtype,with_zp", [(TensorProto.INT8, False), (TensorProto.UINT8, True),
                                           (TensorProto.UINT4, False), (TensorProto.INT4, True)])
def test_blocked_dq_of_other_types_fuses_exactly(dtype, with_zp):
    """Forms the weight-only quantizer does not write: 8-bit blocked weights, uint4 without a zero point
    (zero, not MatMulNBits' default), int4 with one."""
    k, n, block_size = 40, 6, 16
    lo, hi = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255), TensorProto.UINT4: (0, 15),
              TensorProto.INT4: (-8, 7)}[dtype]
    rng = np.random.RandomState(dtype)
    weight = helper.make_tensor("w", dtype, [k, n], rng.randint(lo, hi + 1, k * n).tolist())
    scales = numpy_helper.from_array((rng.rand(3, n) * 0.1 + 0.01).astype(np.float32), "s")
    inits, dq_inputs = [weight, scales], ["w", "s"]
    if with_zp:
        inits.append(helper.make_tensor("z", dtype, [3, n], rng.randint(lo, hi + 1, 3 * n).tolist()))
        dq_inputs.append("z")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["wf"], axis=0, block_size=block_size),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(nodes, "dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert Counter(nd.op_type for nd in optimize(model, "ORT_ENABLE_EXTENDED").model.graph.node) == {"MatMulNBits": 1}
    x = np.random.RandomState(9).randn(5, k).astype(np.float32)
    want = _ort(model, optimized=False).run(None, {"x": x})[0]
    _close(host.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0], want)
    _close(_ort(_only_nbits_fusion(model), optimized=False).run(None, {"x": x})[0], want)
