"""RNN, GRU and LSTM on the CPU EP against onnxruntime's CPU kernels, over the attributes: directions, every
activation function with its alpha/beta, clip, sequence_lens (0 included), initial states, peepholes,
input_forget, linear_before_reset, layouts, optional outputs, dtypes; plus onnx's backend node tests of the
three ops, the shape of the computation (one GEMM per step and direction) and the errors for bad input.

onnxruntime refuses layout 1 ("Batchwise recurrent operations (layout == 1) are not supported") and
float64 GRU/LSTM: layout 1 is checked against onnxruntime on the layout-0 model with transposed inputs and
outputs, float64 against onnxruntime in float32.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import host
from host.cpu_ep import ops_rnn
from host.errors import KernelError, ModelError

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
# Every ONNX RNN activation, with parameter values that keep the recurrence bounded.
ACTIVATIONS = [("Relu", [], []), ("Tanh", [], []), ("Sigmoid", [], []), ("Affine", [0.5], [0.1]),
               ("LeakyRelu", [0.2], []), ("ThresholdedRelu", [0.3], []), ("ScaledTanh", [1.5], [0.7]),
               ("HardSigmoid", [0.3], [0.4]), ("Elu", [0.8], []), ("Softsign", [], []), ("Softplus", [], [])]
INPUTS = {"RNN": ["X", "W", "R", "B", "sequence_lens", "initial_h"],
          "GRU": ["X", "W", "R", "B", "sequence_lens", "initial_h"],
          "LSTM": ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]}


def make_case(op, rng, *, seq=4, batch=3, inp=5, hidden=6, direction="forward", layout=0, bias=True,
              lengths=None, initial=True, peephole=False, outputs=("Y", "Y_h", "Y_c"), opset=22, dtype=np.float32,
              **attrs):
    """(model, feeds): one `op` node over random inputs; absent inputs and outputs are left out."""
    d = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    scale = 1 / np.sqrt(hidden)
    feeds = {"X": rng.standard_normal((batch, seq, inp) if layout else (seq, batch, inp)),
             "W": rng.uniform(-scale, scale, (d, g * hidden, inp)),
             "R": rng.uniform(-scale, scale, (d, g * hidden, hidden))}
    if bias:
        feeds["B"] = rng.uniform(-scale, scale, (d, 2 * g * hidden))
    if lengths is not None:
        feeds["sequence_lens"] = np.asarray(lengths, dtype=np.int32)
    state = (batch, d, hidden) if layout else (d, batch, hidden)
    if initial:
        feeds["initial_h"] = rng.standard_normal(state) * 0.5
        if op == "LSTM":
            feeds["initial_c"] = rng.standard_normal(state) * 0.5
    if peephole:
        feeds["P"] = rng.uniform(-scale, scale, (d, 3 * hidden))
    feeds = {k: v if k == "sequence_lens" else v.astype(dtype) for k, v in feeds.items()}
    names = [n if n in feeds else "" for n in INPUTS[op]]
    while names[-1] == "":
        names.pop()
    out_names = [n if n in outputs else "" for n in ("Y", "Y_h", "Y_c")[: 3 if op == "LSTM" else 2]]
    while out_names[-1] == "":
        out_names.pop()
    if layout:
        attrs["layout"] = layout
    node = helper.make_node(op, names, out_names, name="rec", hidden_size=hidden, direction=direction, **attrs)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "sequence_lens" else elem, feeds[n].shape)
         for n in names if n],
        [helper.make_tensor_value_info(n, elem, [None] * (4 if n == "Y" else 3)) for n in out_names if n])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), feeds


def run_both(model, feeds):
    """(ephost outputs, onnxruntime outputs), by output name."""
    names = [o.name for o in model.graph.output]
    ours = host.InferenceSession(model.SerializeToString()).run(names, feeds)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds)
    return dict(zip(names, ours)), dict(zip(names, ref))


def assert_match(model, feeds, rtol=1e-4, atol=1e-5):
    ours, ref = run_both(model, feeds)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype, name
        assert ours[name].shape == ref[name].shape, name
        np.testing.assert_allclose(ours[name], ref[name], rtol=rtol, atol=atol, err_msg=name)


def with_layout_1(model, feeds):
    """The same node with layout=1 and its feeds batch-major."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = out.graph.node[0]
    node.attribute.append(helper.make_attribute("layout", 1))
    moved = {k: (v.transpose(1, 0, 2) if k in ("X", "initial_h", "initial_c") else v) for k, v in feeds.items()}
    for vi in out.graph.input:
        vi.CopyFrom(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, moved[vi.name].shape))
    return out, moved


# ---- onnxruntime comparisons --------------------------------------------------------------------------
CASES = [
    *[(op, dict(direction=d, lengths=lens)) for op in GATES for d in ("forward", "reverse", "bidirectional")
      for lens in (None, [4, 2, 0], [1, 4, 3])],
    *[(op, dict(clip=0.4, direction="bidirectional", lengths=[3, 4, 1])) for op in GATES],
    *[(op, dict(bias=False, initial=False)) for op in GATES],
    *[(op, dict(outputs=("Y_h",))) for op in GATES],
    ("LSTM", dict(outputs=("Y_c",), direction="reverse")),
    ("LSTM", dict(outputs=("Y", "Y_c"), lengths=[2, 0, 4])),
    ("LSTM", dict(peephole=True, direction="bidirectional", lengths=[4, 2, 3], clip=0.7)),
    ("LSTM", dict(peephole=True, input_forget=1)),
    ("LSTM", dict(input_forget=1, direction="bidirectional")),
    ("GRU", dict(linear_before_reset=1, direction="bidirectional", lengths=[4, 2, 0])),
    ("GRU", dict(linear_before_reset=1, bias=False, clip=0.5)),
    ("RNN", dict(opset=7)),
    ("GRU", dict(opset=14, linear_before_reset=1)),
    ("LSTM", dict(opset=7, peephole=True)),
]


def _case_id(case):
    op, kw = case
    return op + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_onnxruntime(case):
    op, kw = case
    assert_match(*make_case(op, np.random.default_rng(len(CASES)), **kw))


@pytest.mark.parametrize("op", list(GATES))
@pytest.mark.parametrize("name,alphas,betas", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_every_activation(op, name, alphas, betas):
    """Each function as the first gate function (given alpha/beta), and in every slot with onnxruntime's
    defaults (no alpha/beta given), in both directions."""
    rng = np.random.default_rng(3)
    acts = [name, *DEFAULTS[op][1:]]
    extra = {k: v for k, v in (("activation_alpha", alphas), ("activation_beta", betas)) if v}
    assert_match(*make_case(op, rng, activations=acts, **extra))
    assert_match(*make_case(op, rng, activations=DEFAULTS[op] + [name] * len(DEFAULTS[op]),
                            direction="bidirectional", lengths=[4, 3, 1]))


def test_activation_parameters_are_taken_in_order():
    """alpha/beta lists are consumed by the functions that take them, in order, across directions."""
    rng = np.random.default_rng(4)
    assert_match(*make_case("LSTM", rng, direction="bidirectional",
                            activations=["HardSigmoid", "Affine", "ScaledTanh", "Sigmoid", "LeakyRelu", "Elu"],
                            activation_alpha=[0.25, 0.9, 1.2, 0.05, 0.7], activation_beta=[0.45, 0.05, 0.8]))


@pytest.mark.parametrize("op", list(GATES))
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_layout_1(op, direction):
    """layout=1 equals layout 0 on batch-major inputs (onnxruntime runs layout 0 only)."""
    rng = np.random.default_rng(5)
    model, feeds = make_case(op, rng, direction=direction, lengths=[3, 0, 4], peephole=op == "LSTM")
    names = [o.name for o in model.graph.output]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds)
    model1, feeds1 = with_layout_1(model, feeds)
    ours = host.InferenceSession(model1.SerializeToString()).run(names, feeds1)
    for name, o, r in zip(names, ours, ref):
        want = r.transpose(2, 0, 1, 3) if name == "Y" else r.transpose(1, 0, 2)
        np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("op", list(GATES))
def test_float64_and_float16(op):
    """float64 computes in float64 (checked against onnxruntime's float32 run); float16 in float32, rounded."""
    rng = np.random.default_rng(6)
    kw = dict(direction="bidirectional", lengths=[4, 1, 2])
    model64, feeds64 = make_case(op, rng, dtype=np.float64, **kw)
    model32, _ = make_case(op, rng, **kw)
    names = [o.name for o in model32.graph.output]
    ours = host.InferenceSession(model64.SerializeToString()).run(names, feeds64)
    feeds32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds64.items()}
    ref = ort.InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, feeds32)
    for o, r in zip(ours, ref):
        assert o.dtype == np.float64
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)
    model16, _ = make_case(op, rng, dtype=np.float16, **kw)
    feeds16 = {k: v.astype(np.float16) if v.dtype == np.float64 else v for k, v in feeds64.items()}
    ours16 = host.InferenceSession(model16.SerializeToString()).run(names, feeds16)
    for o, r in zip(ours16, ref):
        assert o.dtype == np.float16
        np.testing.assert_allclose(o.astype(np.float32), r, rtol=1e-2, atol=1e-2)


@given(op=st.sampled_from(list(GATES)), direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
       seq=st.integers(1, 5), batch=st.integers(1, 3), hidden=st.integers(1, 5), lengths=st.booleans(),
       bias=st.booleans(), initial=st.booleans(), clip=st.sampled_from([None, 0.3, 2.0]), seed=st.integers(0, 99),
       flag=st.booleans())
def test_random_attributes_match_onnxruntime(op, direction, seq, batch, hidden, lengths, bias, initial, clip, seed,
                                             flag):
    rng = np.random.default_rng(seed)
    kw = dict(seq=seq, batch=batch, inp=3, hidden=hidden, direction=direction, bias=bias, initial=initial)
    if lengths:
        kw["lengths"] = rng.integers(0, seq + 1, batch).tolist()
    if clip is not None:
        kw["clip"] = clip
    if op == "GRU":
        kw["linear_before_reset"] = int(flag)
    elif op == "LSTM":
        kw["peephole"] = flag
        kw["input_forget"] = int(seed % 3 == 0)
    assert_match(*make_case(op, rng, **kw))


# ---- the computation's shape ----------------------------------------------------------------------------
@pytest.mark.parametrize("op,attrs,per_step", [("RNN", {}, 1), ("LSTM", {}, 1), ("GRU", {"linear_before_reset": 1}, 1),
                                               ("GRU", {}, 2)])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_one_projection_then_one_gemm_per_step(op, attrs, per_step, direction, monkeypatch):
    """The input projection is one GEMM for every step and direction; the recurrence makes per_step GEMMs
    per step and direction (GRU without linear_before_reset needs (r * H) @ Rh^T after r)."""
    calls = []
    real = ops_rnn.gemm
    monkeypatch.setattr(ops_rnn, "gemm", lambda a, b: calls.append(a.shape) or real(a, b))
    seq, batch, inp, dirs = 6, 3, 5, 2 if direction == "bidirectional" else 1
    model, feeds = make_case(op, np.random.default_rng(8), seq=seq, batch=batch, inp=inp, direction=direction,
                             **attrs)
    host.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert calls[0] == (seq * batch, inp)
    assert len(calls) == 1 + seq * dirs * per_step


# onnx's backend node tests of these ops run in tests/host/test_backend.py (the whole suite).


# ---- errors ----------------------------------------------------------------------------------------------
def _session(op, **kw):
    model, feeds = make_case(op, np.random.default_rng(9), **kw)
    return host.InferenceSession(model.SerializeToString()), feeds


def test_unknown_activation_is_a_model_error():
    with pytest.raises(ModelError, match=r"^node 'rec' \(GRU\): attribute 'activations' is \['Sigmoid', 'Swish'\]; "
                                         r"allowed: names among Relu, Tanh, Sigmoid, Affine, .*Softplus$"):
        _session("GRU", activations=["Sigmoid", "Swish"])


def test_activation_count_must_fit_the_directions():
    with pytest.raises(ModelError, match=r"^node 'rec' \(LSTM\): attribute 'activations' is \['Sigmoid', 'Tanh', "
                                         r"'Tanh'\]; allowed: a list of 6 names \(3 per direction, 2 direction\(s\)\)$"):
        _session("LSTM", direction="bidirectional", activations=["Sigmoid", "Tanh", "Tanh"])


def test_bad_direction_and_clip():
    with pytest.raises(ModelError, match=r"^node 'rec' \(RNN\): attribute 'direction' is 'both'; allowed: one of "
                                         r"'forward', 'reverse', 'bidirectional'$"):
        _session("RNN", direction="both")
    with pytest.raises(ModelError, match=r"^node 'rec' \(RNN\): attribute 'clip' is 0.0; allowed: a float > 0$"):
        _session("RNN", clip=0.0)


def _any_shape_session(op, **kw):
    """A session whose graph inputs have unknown dims (so the kernel, not the feed check, sees bad shapes)."""
    model, feeds = make_case(op, np.random.default_rng(9), **kw)
    for vi in model.graph.input:
        for dim in vi.type.tensor_type.shape.dim:
            dim.dim_param = "n"
    return host.InferenceSession(model.SerializeToString()), feeds


def test_wrong_weight_shape_names_the_input():
    sess, feeds = _any_shape_session("GRU", hidden=4)
    feeds["R"] = feeds["R"][:, :, :3].copy()
    with pytest.raises(KernelError, match=r"^node 'rec' \(GRU\) on CPUExecutionProvider failed: R must have shape "
                                          r"\(1, 12, 4\) \(direction 'forward', hidden_size 4, 3 gate\(s\)\), got "
                                          r"\(1, 12, 3\)"):
        sess.run(None, feeds)


def test_sequence_lens_out_of_range():
    sess, feeds = _any_shape_session("LSTM", seq=4, lengths=[4, 5, 1])
    with pytest.raises(KernelError, match=r"^node 'rec' \(LSTM\) on CPUExecutionProvider failed: sequence_lens must "
                                          r"lie in \[0, 4\] \(the sequence length\), got \[4, 5, 1\]$"):
        sess.run(None, feeds)
