"""Rotary fusion on folded cos/sin tables (host/optimizer/rules/rotary.py).

After BASIC constant folding of a static-shape export, `x * cos + rotate_half(x) * sin` has constant
cos / sin tables (or tables gathered by position ids) instead of the Cos / Sin(Concat(freqs, freqs))
computation onnxscript's rule matches. These tests check that the table forms become one
RotaryEmbedding-23 per rotated tensor, that the outputs do not change (onnxruntime CPU and onnx's
ReferenceEvaluator on the original vs the optimized model, and ephost's CPU EP), and that tables
whose two halves differ (which RotaryEmbedding cannot express) are left unfused.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from host.optimizer import GraphOptimizationLevel, expand_unclaimed, optimize
from host.runtime.session import InferenceSession
from tests.host.optimizer.common import References, assert_same, ops, optimized_fixture

EXTENDED = GraphOptimizationLevel.ORT_ENABLE_EXTENDED
INT64_MAX = np.iinfo(np.int64).max

try:
    from tests.models import available_models, load
except ImportError:  # the fixtures package is another helper's; without it there is nothing to test
    available_models, load = (lambda: []), None


# ---- the Llama fixtures ---------------------------------------------------------------------------
def _llama(exporter: str):
    return optimized_fixture(f"llama_{exporter}")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_llama_rotary_becomes_one_rotary_embedding_per_q_and_k(exporter):
    _, _, _, optimized, _ = _llama(exporter)
    counts = ops(optimized)
    layers = counts["Attention"]
    assert layers == 2  # the fixture's config: 2 layers (tests/models/README.md)
    assert counts["RotaryEmbedding"] == 2 * layers
    assert "Neg" not in counts and "Concat" not in counts  # rotate_half is gone
    producers = {o: n for n in optimized.graph.node for o in n.output}
    for attention in (n for n in optimized.graph.node if n.op_type == "Attention"):
        assert producers[attention.input[0]].op_type == "RotaryEmbedding"  # q, straight in
        k = producers[attention.input[1]]
        while k.op_type != "RotaryEmbedding":  # k through the GQA Unsqueeze / Expand / Reshape
            assert k.op_type in ("Unsqueeze", "Expand", "Reshape"), k.op_type
            k = producers[k.input[0]]
    for node in optimized.graph.node:
        if node.op_type == "RotaryEmbedding":
            assert len(node.input) == 3  # folded tables: per-token caches, no position_ids


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_llama_with_fused_rotary_matches_onnxruntime_and_torch(exporter):
    path, feeds, expected, optimized, want = _llama(exporter)
    runs = {
        "onnxruntime": ort.InferenceSession(optimized.SerializeToString(),
                                            providers=["CPUExecutionProvider"]).run(None, feeds),
        "reference": ReferenceEvaluator(optimized).run(None, feeds),
    }
    with InferenceSession(str(path), providers=["CPUExecutionProvider"]) as sess:
        assert "RotaryEmbedding" in {n.op_type for n in sess.plan.nodes}
        runs["ephost CPU EP"] = sess.run(None, feeds)
    for how, got in runs.items():
        for g, w, torch_out in zip(got, want, expected.values()):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4, err_msg=f"{how} vs onnxruntime on the original")
            np.testing.assert_allclose(g, torch_out, rtol=1e-3, atol=1e-4, err_msg=f"{how} vs torch")


# ---- synthetic graphs -----------------------------------------------------------------------------
def _tables(positions: np.ndarray, dim: int, base: float, halves_differ: bool) -> tuple[np.ndarray, np.ndarray]:
    """HF's cos / sin tables for `positions` (any shape): cat(freqs, freqs) along a new last axis.
    With halves_differ the second half uses other frequencies (not expressible as RotaryEmbedding)."""
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    freqs = positions[..., None].astype(np.float64) * inv_freq
    emb = np.concatenate([freqs, freqs * 1.5 + 0.5 if halves_differ else freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _rotary_model(case: dict) -> onnx.ModelProto:
    """x * cos + rotate_half(x) * sin with folded or gathered tables, operand orders as `case` says."""
    b, h, s, d = case["b"], case["h"], case["s"], case["d"]
    half = d // 2
    inits = {"start0": np.array([0], np.int64), "half": np.array([half], np.int64),
             "end": np.array([d if case["end_is_d"] else INT64_MAX], np.int64),
             "axis": np.array([case["axis"]], np.int64)}
    if case["steps"]:
        inits["step"] = np.array([1], np.int64)
    nodes = []
    x_shape = [case.get("batch_dim", b), h, s, d]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    if case["form"] == "gathered":
        positions = np.arange(case["max_pos"])
        inits["cos_table"], inits["sin_table"] = _tables(positions, d, case["base"], case["halves_differ"])
        inits["one"] = np.array([1], np.int64)
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, [b, s]))
        for t in ("cos", "sin"):
            nodes += [helper.make_node("Gather", [f"{t}_table", "position_ids"], [f"{t}_g"], axis=0),
                      helper.make_node("Unsqueeze", [f"{t}_g", "one"], [t])]
    else:
        # Positions per batch row when the table has a batch dim, else one run of positions.
        rows = b if case["table_shape"] == "b1sd" else 1
        positions = case["offset"] + np.arange(s)[None, :] + np.arange(rows)[:, None] * case["row_step"]
        cos, sin = _tables(positions, d, case["base"], case["halves_differ"])  # (rows, s, d)
        shape = {"sd": (s, d), "1sd": (1, s, d), "11sd": (1, 1, s, d), "b1sd": (b, 1, s, d),
                 "1hsd": (1, h, s, d)}[case["table_shape"]]
        if case["table_shape"] == "1hsd":  # a per-head table: heads rotated at different offsets
            cos, sin = _tables(positions + np.arange(h)[:, None], d, case["base"], case["halves_differ"])
        inits["cos"], inits["sin"] = cos.reshape(shape), sin.reshape(shape)
    slice_tail = ["axis", "step"] if case["steps"] else ["axis"]
    nodes += [helper.make_node("Slice", ["x", "start0", "half", *slice_tail], ["x1"]),
              helper.make_node("Slice", ["x", "half", "end", *slice_tail], ["x2"]),
              helper.make_node("Neg", ["x2"], ["neg"]),
              helper.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1 if case["axis"] == -1 else 3),
              helper.make_node("Mul", ["cos", "x"] if case["swap_cos"] else ["x", "cos"], ["a"]),
              helper.make_node("Mul", ["sin", "rot"] if case["swap_sin"] else ["rot", "sin"], ["c"]),
              helper.make_node("Add", ["c", "a"] if case["swap_add"] else ["a", "c"], ["y"])]
    graph = helper.make_graph(nodes, "rope", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", case["opset"])]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(model, full_check=True)
    return model


@st.composite
def rotary_cases(draw, form=None, halves_differ=False, table_shapes=("sd", "1sd", "11sd", "b1sd")):
    """Random sizes, table forms and operand orders of the rotary pattern."""
    case = {
        "b": draw(st.integers(1, 3)), "h": draw(st.integers(1, 3)), "s": draw(st.integers(1, 6)),
        "d": draw(st.sampled_from([2, 4, 8, 12])), "form": form or draw(st.sampled_from(["folded", "gathered"])),
        "base": draw(st.sampled_from([100.0, 10000.0])), "halves_differ": halves_differ,
        "axis": draw(st.sampled_from([3, -1])), "steps": draw(st.booleans()), "end_is_d": draw(st.booleans()),
        "swap_cos": draw(st.booleans()), "swap_sin": draw(st.booleans()), "swap_add": draw(st.booleans()),
        "opset": draw(st.sampled_from([17, 18])),
    }
    case["table_shape"] = draw(st.sampled_from(table_shapes))
    case["offset"] = draw(st.integers(0, 20))
    case["row_step"] = draw(st.integers(0, 5))
    case["max_pos"] = case["s"] + draw(st.integers(0, 8))
    return case


def _feeds(case: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.uniform(-4, 4, (case["b"], case["h"], case["s"], case["d"])).astype(np.float32)}
    if case["form"] == "gathered":
        feeds["position_ids"] = rng.integers(0, case["max_pos"], (case["b"], case["s"])).astype(np.int64)
    return feeds


def _ephost(model: onnx.ModelProto, feeds: dict, level) -> np.ndarray:
    from host.runtime.options import SessionOptions

    so = SessionOptions()
    so.graph_optimization_level = level
    with InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"]) as sess:
        return sess.run(None, feeds)[0]


@given(case=rotary_cases(), seed=st.integers(0, 2**16))
def test_table_rotary_becomes_rotary_embedding_and_keeps_outputs(case, seed):
    model = _rotary_model(case)
    optimized = optimize(model, EXTENDED).model
    counts = ops(optimized)
    assert counts["RotaryEmbedding"] == 1 and "Neg" not in counts, (case, counts)
    (node,) = [n for n in optimized.graph.node if n.op_type == "RotaryEmbedding"]
    assert (len(node.input) == 4) == (case["form"] == "gathered")  # position_ids only for gathered tables
    feeds = _feeds(case, seed)
    assert_same(References(model), References(optimized), feeds)
    unfused = _ephost(model, feeds, GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_allclose(_ephost(model, feeds, EXTENDED), unfused, rtol=1e-4, atol=1e-5)


@given(case=rotary_cases(form="folded"), seed=st.integers(0, 2**16))
def test_folded_rotary_falls_back_to_the_unfused_ops(case, seed):
    """An EP that does not claim RotaryEmbedding gets the expansion (fallback.py) of the folded form."""
    model = _rotary_model(case)
    optimized = optimize(model, EXTENDED).model
    names = [n.name for n in optimized.graph.node if n.op_type == "RotaryEmbedding"]
    expanded = expand_unclaimed(optimized, names)
    assert "RotaryEmbedding" not in ops(expanded)
    assert_same(References(model), References(expanded), _feeds(case, seed))


@given(case=rotary_cases(halves_differ=True), seed=st.integers(0, 2**16))
def test_tables_whose_halves_differ_are_not_fused(case, seed):
    model = _rotary_model(case)
    optimized = optimize(model, EXTENDED).model
    counts = ops(optimized)
    assert "RotaryEmbedding" not in counts and counts["Neg"] == 1, counts
    assert_same(References(model), References(optimized), _feeds(case, seed))


@given(case=rotary_cases(form="folded", table_shapes=("1hsd",)), seed=st.integers(0, 2**16))
def test_per_head_tables_are_not_fused(case, seed):
    """A table that varies over heads has no RotaryEmbedding form (its caches are per token)."""
    model = _rotary_model(case)
    optimized = optimize(model, EXTENDED).model
    assert ("RotaryEmbedding" in ops(optimized)) == (case["h"] == 1)
    assert_same(References(model), References(optimized), _feeds(case, seed))


def test_folded_tables_with_a_dynamic_batch_are_not_fused():
    """Without position ids the caches are (batch, seq, head/2) and onnxruntime does not broadcast a
    batch of 1, so a symbolic batch leaves the pattern alone (still correct)."""
    case = {"b": 2, "h": 2, "s": 4, "d": 8, "form": "folded", "base": 10000.0, "halves_differ": False,
            "axis": 3, "steps": True, "end_is_d": False, "swap_cos": False, "swap_sin": False,
            "swap_add": False, "opset": 18, "table_shape": "11sd", "offset": 0, "row_step": 0, "max_pos": 4,
            "batch_dim": "batch"}
    model = _rotary_model(case)
    optimized = optimize(model, EXTENDED).model
    assert "RotaryEmbedding" not in ops(optimized) and ops(optimized)["Neg"] == 1
    assert_same(References(model), References(optimized), _feeds(case, 3))
