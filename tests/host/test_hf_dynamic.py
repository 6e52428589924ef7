"""Dynamic-axes Hugging Face exports on the CPU EP (issue 23): symbolic shapes (host/runtime/symbolic_shapes.py)
let the shape program absorb the shape arithmetic and the fusions match as on a static copy.

Fixtures: tests/models/dynamic_hf/*.onnx, made by tests/models/make_hf_dynamic.py (torch, transformers;
not needed here). Reference: onnxruntime CPU on the same file at each shape, and torch's output saved
beside each fixture at the export shape.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from host.errors import InvalidArgument
from host.runtime import dims, shape_constants, symbolic_rules, symbolic_shapes
from host.runtime.session import InferenceSession

DIR = Path(__file__).resolve().parents[1] / "models" / "dynamic_hf"
FIXTURES = ("bert_ts", "gpt2_ts", "gpt2_dynamo", "llama_ts", "vit_ts")
SHAPES = ((1, 16), (8, 128), (3, 50), (8, 128), (1, 16))
# Ops the optimizer fuses (host/optimizer/rules): the dynamic export must get the static copy's.
FUSED = ("Attention", "SkipLayerNormalization", "LayerNormalization", "Gelu", "BiasGelu", "RMSNormalization",
         "RotaryEmbedding")
# Plan nodes a dynamic export may have beyond its static copy's (docs/dynamic_shapes.md#limits): data
# ops a static copy folds into constants (BERT's token_type_ids Expand to [batch, seq], the causal
# mask's LessOrEqual over [seq, seq]): 1; Llama: also the rotary tables (inv_freq @ positions,
# Transpose, a Cos/Sin pair per RotaryEmbedding): 11 (55 against 44 nodes), pinned so that a
# regression shows.
EXTRA_NODES = {"llama_ts": 11}


def _feeds(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 1000 + seq)
    names = [i.name for i in model.graph.input]
    if names == ["pixel_values"]:
        return {"pixel_values": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    feeds = {"input_ids": rng.integers(0, 200, (batch, seq)).astype(np.int64)}
    if "attention_mask" in names:
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq - 2:] = 0  # padding in every row but the first
        feeds["attention_mask"] = mask
    return feeds


def _static_copy(model: onnx.ModelProto, sizes: dict[str, int]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in out.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]
    return out


@pytest.fixture(scope="module", params=FIXTURES)
def case(request):
    path = DIR / f"{request.param}.onnx"
    model = onnx.load(path)
    sess = InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return request.param, model, sess, ref


def test_fixtures_are_small():
    sizes = {p.name: p.stat().st_size for p in DIR.glob("*.onnx")}
    assert set(sizes) == {f"{n}.onnx" for n in FIXTURES}
    assert max(sizes.values()) < 1_000_000


def test_runs_every_shape_like_onnxruntime(case):
    name, model, sess, ref = case
    for batch, seq in SHAPES:
        feeds = _feeds(model, batch, seq)
        got, want = sess.run(None, feeds)[0], ref.run(None, feeds)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{name} at {batch}x{seq}")
    # One evaluation of the shape program per new signature: (8, 128) and (1, 16) came back.
    assert sess.shape_program.evaluations == 3
    assert sess.shape_program.cached_signatures() == 3


def test_matches_torch_at_the_export_shape(case):
    _name, model, sess, _ref = case
    saved = np.load(DIR / f"{_name}.npz")
    feeds = {i.name: saved[i.name] for i in model.graph.input}
    np.testing.assert_allclose(sess.run(None, feeds)[0], saved["out:last_hidden_state"], rtol=1e-4, atol=1e-4)


def _shape_nodes(sess) -> list[str]:
    """Plan nodes computing shapes: integer outputs of rank 0 or 1 (shape vectors and their parts)."""
    out = []
    for node in sess.plan.nodes:
        metas = [sess.graph.values.get(sess.plan.value_names[i]) for i in node.outputs if i >= 0]
        if metas and all(m is not None and m.shape is not None and len(m.shape) <= 1
                         and m.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) for m in metas):
            out.append(node.op_type)
    return out


def test_no_shape_arithmetic_left_in_the_plan(case):
    name, _model, sess, _ref = case
    ops = collections.Counter(n.op_type for n in sess.plan.nodes)
    assert ops["Shape"] == ops["Size"] == ops["ConstantOfShape"] == ops["Range"] == 0, (name, ops)
    assert _shape_nodes(sess) == [], name
    assert len(sess.shape_program) > 0


def test_plan_matches_a_static_copy(case):
    name, model, sess, _ref = case
    symbols = [d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param]
    sizes = dict(zip(dict.fromkeys(symbols), (8, 128)))
    static = InferenceSession(_static_copy(model, sizes).SerializeToString(), providers=["CPUExecutionProvider"])
    dyn_ops = collections.Counter(n.op_type for n in sess.plan.nodes)
    static_ops = collections.Counter(n.op_type for n in static.plan.nodes)
    for op in FUSED:
        assert dyn_ops[op] == static_ops[op], (name, op, dyn_ops, static_ops)
    assert len(sess.plan.nodes) <= len(static.plan.nodes) + EXTRA_NODES.get(name, 1), (name, dyn_ops, static_ops)


@pytest.mark.parametrize(("a", "b", "want"), [
    ("seq", "seq", "seq"),
    ("seq", 1, "seq"),
    (1, "Min(seq, 256)", "Min(seq, 256)"),
    ("seq", "Min(seq, 256)", "seq"),  # BERT's position embeddings + word embeddings
    ("Min(seq, 256)", "seq", "seq"),
    ("batch", 8, 8),  # broadcasting against 8 makes batch 8 (or 1)
    ("batch", "seq", "Max(batch, seq)"),
    ("unk__3", "seq", None),  # an unknown dim never enters an expression
])
def test_broadcast_merge(a, b, want):
    assert symbolic_rules.merge(a, b, {"batch", "seq"}) == want


@pytest.mark.parametrize(("dim", "start", "end", "step", "want"), [
    (256, 0, "seq", 1, "Min(seq, 256)"),  # Slice(position_ids buffer, 0, seq)
    ("seq", 0, "seq", 1, "seq"),
    (16, 8, 2**63 - 1, 1, 8),
    ("seq", 2, 2**63 - 1, 1, "(seq - 2)"),
    (10, 0, 7, 2, 4),
    (256, 0, "seq", 2, None),  # a symbolic end with a step: not followed
])
def test_slice_lengths(dim, start, end, step, want):
    assert symbolic_rules._slice_dim(dim, start, end, step, {"batch", "seq"}) == want


def test_torchscript_expand_minus_one_pattern():
    # Where(Equal(shape, -1), 1, shape): the exporter's `expand(..., -1, ...)`; a dim is never -1.
    equal = onnx.helper.make_node("Equal", ["s", "m"], ["e"])
    where = onnx.helper.make_node("Where", ["e", "ones", "s"], ["w"])
    env = {"s": ["batch", -1, 1], "m": [-1, -1, -1], "ones": [1, 1, 1]}
    env["e"] = symbolic_rules.follow(equal, env, set(), {})
    assert env["e"] == [False, True, False]
    assert symbolic_rules.follow(where, env, set(), {}) == ["batch", 1, 1]
    env["s"] = ["(seq * -1)", 2, 3]  # an expression may be negative: not decided
    assert symbolic_rules.follow(equal, env, set(), {}) is None


@pytest.mark.parametrize("name", FIXTURES)
def test_annotated_dims_match_run_time_shapes(name):
    # Every dim symbolic_shapes writes, evaluated at the fed sizes, against the shape onnxruntime
    # computes for that value (all of them made graph outputs).
    model = onnx.load(DIR / f"{name}.onnx")
    annotated = symbolic_shapes.annotate(model)
    found = {vi.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                       for d in vi.type.tensor_type.shape.dim] for vi in annotated.graph.value_info}
    assert len(found) > 10
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in found)
    symbols = {"batch", "seq"}
    # Shape values folded into constants (host/runtime/shape_constants.py): onnxruntime computes the
    # same values from the original graph at every shape.
    produced = {o for n in model.graph.node for o in n.output}
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in annotated.graph.initializer if t.name in produced}
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in folded)
    ref = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    symbols = {"batch", "seq"}
    for batch, seq in ((3, 50), (1, 16)):
        outs = ref.run([*found, *folded], _feeds(model, batch, seq))
        for (value, want_dims), got in zip(found.items(), outs):
            computed = [dims.compile_dim(d, symbols)[0]({"batch": batch, "seq": seq}) for d in want_dims]
            assert computed == list(np.shape(got)), (name, value, want_dims, batch, seq)
        for (value, constant), got in zip(folded.items(), outs[len(found):]):
            np.testing.assert_array_equal(constant, got, err_msg=f"{name}: {value} at {batch}x{seq}")


@pytest.mark.parametrize(("op", "terms", "data", "want"), [
    ("Reshape", ["batch", "seq", 4, 16], ["batch", "seq", 64], [0, 0, 4, 16]),  # split into heads
    ("Reshape", ["batch", "(seq * 4)", 16], ["batch", "seq", 64], [0, -1, 16]),  # the one dim left
    ("Reshape", ["seq", "batch", 64], ["batch", "seq", 64], None),  # two dims left: no constant
    ("Reshape", [4, 16], [4, 16], None),  # already constant
    ("Expand", ["batch", 2, 2, "seq", 16], ["batch", 2, 1, "seq", 16], [1, 2, 2, 1, 16]),  # GQA repeat_kv
    ("Expand", ["batch", 1, 64], [1, 1, 64], None),  # ViT's class token: batch is no dim of the input
    ("Expand", ["seq", 8], ["batch", "seq", 8], None),  # a target shorter than the input: invalid
])
def test_constant_targets(op, terms, data, want):
    node = onnx.helper.make_node(op, ["x", "shape"], ["y"])
    got = shape_constants._target(node, terms, data, {"batch", "seq"})
    assert (got is None) if want is None else (got is not None and got.tolist() == want)


def _with_entry(value: str):
    import host

    so = host.SessionOptions()
    so.add_session_config_entry(symbolic_shapes.ENABLE_KEY, value)
    return host.InferenceSession(str(DIR / "bert_ts.onnx"), sess_options=so, providers=["CPUExecutionProvider"])


def test_symbolic_shapes_can_be_turned_off():
    # "0": Range lengths only, as before: BERT's position-ids Slice keeps an unknown length, Shape
    # nodes stay in the plan and the Attention fusion misses; the results are the same.
    off = _with_entry("0")
    ops = collections.Counter(n.op_type for n in off.plan.nodes)
    assert ops["Shape"] > 0 and ops["Attention"] == 0
    model = onnx.load(DIR / "bert_ts.onnx")
    feeds = _feeds(model, 3, 50)
    want = ort.InferenceSession(str(DIR / "bert_ts.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(off.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)


def test_a_bad_symbolic_shapes_entry_is_refused():
    with pytest.raises(InvalidArgument, match=r"^session config 'session\.ephost\.symbolic_shapes' = 'yes': "
                                              r"expected '1' \(default: infer symbolic shapes\) or '0'"):
        _with_entry("yes")
