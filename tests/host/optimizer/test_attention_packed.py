"""Attention after a packed Q/K/V projection (GPT-2): one MatMul of width 3*hidden, a Split into q, k, v,
the head reshapes, and an output flattened to 2-D for the next projection's Gemm.

The 4-D Attention fusion fires there; Attention3D (host/optimizer/rules/attention.py) must then take the
head split / merge around it although the merge Reshape flattens to [B*S, hidden], and FlattenedGemm the
projection after it. Outputs are compared with the original model through onnxruntime CPU, onnx's
ReferenceEvaluator and ephost's CPU EP.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from host.optimizer import GraphOptimizationLevel, optimize
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.host.optimizer.common import References, assert_same, ops, optimized_fixture, standard_only

EXTENDED = GraphOptimizationLevel.ORT_ENABLE_EXTENDED

try:
    from tests.models import available_models, load
except ImportError:  # the fixtures package is another helper's; without it there is nothing to test
    available_models, load = (lambda: []), None


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# ---- the GPT-2 fixtures ---------------------------------------------------------------------------
def _gpt2(exporter: str):
    return optimized_fixture(f"gpt2_{exporter}")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_gpt2_packed_qkv_becomes_3d_attention_on_the_split(exporter):
    _, _, _, optimized, _ = _gpt2(exporter)
    counts = ops(optimized)
    assert counts["Attention"] == 2  # the fixture's 2 layers
    assert "Transpose" not in counts and "Gemm" not in counts, counts  # head reshapes and Conv1D Gemms gone
    producers = {o: n for n in optimized.graph.node for o in n.output}
    for node in (n for n in optimized.graph.node if n.op_type == "Attention"):
        assert _attrs(node)["q_num_heads"] == _attrs(node)["kv_num_heads"] == 2
        splits = {producers[name].op_type for name in node.input[:3]}
        assert splits == {"Split"} and len({producers[name].name for name in node.input[:3]}) == 1


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_gpt2_with_3d_attention_matches_onnxruntime_and_torch(exporter):
    path, feeds, expected, optimized, want = _gpt2(exporter)
    plain = standard_only(optimized)  # ai.ephost nodes expanded for the two references
    runs = {
        "onnxruntime": ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds),
        "reference": ReferenceEvaluator(plain).run(None, feeds),
    }
    with InferenceSession(str(path), providers=["CPUExecutionProvider"]) as sess:
        assert sum(n.op_type == "Attention" for n in sess.plan.nodes) == 2
        runs["ephost CPU EP"] = sess.run(None, feeds)
    for how, got in runs.items():
        for g, w, torch_out in zip(got, want, expected.values()):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4, err_msg=f"{how} vs onnxruntime on the original")
            np.testing.assert_allclose(g, torch_out, rtol=1e-3, atol=1e-4, err_msg=f"{how} vs torch")


# ---- synthetic packed-QKV blocks ------------------------------------------------------------------
def _packed_model(case: dict) -> onnx.ModelProto:
    """x @ W_qkv -> Split -> heads -> softmax(q k^T * scale + mask) v -> merge -> [B*S, E] @ W_o (+b) -> [B, S, E]
    (or, with flatten="batch", a merge to [B, S*E] that is not a plain flatten of the tokens)."""
    b, s, h, d = case["b"], case["s"], case["h"], case["d"]
    e = h * d
    rng = np.random.default_rng(case["seed"])
    inits = {"w_qkv": rng.standard_normal((e, 3 * e)).astype(np.float32) / math.sqrt(e),
             "heads": np.array([b, s, h, d], np.int64), "scale": np.float32(1 / math.sqrt(d))}
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"])]
    if case["split_input"]:
        inits["split"] = np.array([e, e, e], np.int64)
        nodes.append(helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2))
    else:
        nodes.append(helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=2, num_outputs=3))
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [name, "heads"], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}t"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Transpose", ["kt"], ["ktt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qt", "ktt"], ["scores"]),
              helper.make_node("Mul", ["scores", "scale"], ["scaled"])]
    logits = "scaled"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, e])]
    if case["mask"]:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [b, 1, s, s]))
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
        logits = "masked"
    flat = [b * s, e] if case["flatten"] == "tokens" else [b, s * e]
    k_in = flat[1]
    inits["flat"] = np.array(flat, np.int64)
    inits["w_o"] = rng.standard_normal((k_in, e)).astype(np.float32) / math.sqrt(k_in)
    inits["back"] = np.array([b, s, e] if case["flatten"] == "tokens" else [b, e], np.int64)
    gemm_inputs = ["flat2d", "w_o"]
    if case["bias"]:
        inits["b_o"] = rng.standard_normal(e).astype(np.float32)
        gemm_inputs.append("b_o")
    nodes += [helper.make_node("Softmax", [logits], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "vt"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "flat"], ["flat2d"]),
              helper.make_node("Gemm", gemm_inputs, ["proj"]),
              helper.make_node("Reshape", ["proj", "back"], ["y"])]
    out_shape = [b, s, e] if case["flatten"] == "tokens" else [b, e]
    graph = helper.make_graph(nodes, "packed_qkv", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", case["opset"])]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(model, full_check=True)
    return model


@st.composite
def packed_cases(draw, flatten="tokens"):
    opset = draw(st.sampled_from([17, 18]))
    return {"b": draw(st.integers(1, 3)), "s": draw(st.integers(1, 6)), "h": draw(st.integers(1, 3)),
            "d": draw(st.sampled_from([2, 4, 8])), "mask": draw(st.booleans()), "bias": draw(st.booleans()),
            "split_input": opset < 18 or draw(st.booleans()), "opset": opset, "flatten": flatten,
            "seed": draw(st.integers(0, 2**16))}


def _feeds(case: dict) -> dict:
    rng = np.random.default_rng(case["seed"] + 1)
    b, s, e = case["b"], case["s"], case["h"] * case["d"]
    feeds = {"x": rng.uniform(-2, 2, (b, s, e)).astype(np.float32)}
    if case["mask"]:
        feeds["mask"] = np.where(rng.random((b, 1, s, s)) < 0.3, -1e4, 0).astype(np.float32)
    return feeds


def _ephost(model: onnx.ModelProto, feeds: dict, level) -> np.ndarray:
    so = SessionOptions()
    so.graph_optimization_level = level
    with InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"]) as sess:
        return sess.run(None, feeds)[0]


@given(case=packed_cases())
def test_packed_qkv_attention_becomes_3d_attention_and_keeps_outputs(case):
    model = _packed_model(case)
    optimized = optimize(model, EXTENDED).model
    counts = ops(optimized)
    assert counts["Attention"] == 1 and "Transpose" not in counts and "Gemm" not in counts, (case, counts)
    (node,) = [n for n in optimized.graph.node if n.op_type == "Attention"]
    assert _attrs(node)["q_num_heads"] == _attrs(node)["kv_num_heads"] == case["h"]
    feeds = _feeds(case)
    assert_same(References(model), References(optimized), feeds)
    unfused = _ephost(model, feeds, GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_allclose(_ephost(model, feeds, EXTENDED), unfused, rtol=1e-4, atol=1e-5)


@given(case=packed_cases(flatten="batch"))
def test_a_2d_merge_that_is_not_a_token_flatten_stays_4d(case):
    """Reshape to [B, S*E] mixes tokens into one row: not the 3-D Attention's output, so only the 4-D
    fusion applies (its head transposes stay), and the outputs do not change."""
    model = _packed_model(case)
    optimized = optimize(model, EXTENDED).model
    counts = ops(optimized)
    (node,) = [n for n in optimized.graph.node if n.op_type == "Attention"]
    if case["b"] > 1 and case["s"] > 1:  # else [B, S*E] is also [B*S, E]
        assert "q_num_heads" not in _attrs(node) and counts["Transpose"] >= 1, counts
    assert_same(References(model), References(optimized), _feeds(case))
