"""Quantized nodes in a row as one compiled call (host/cpu_ep/quant_chain.py, native/kernels_quant_chain.c).

Random QOperator graphs (a CNN's QuantizeLinear -> QLinearConv -> MaxPool -> QLinearConv -> QLinearAdd ->
QLinearGlobalAveragePool -> Flatten -> QGemm, a transformer block's QLinearMatMul -> QLinearAdd -> QLinearMatMul ->
QLinearAdd -> QLinearSoftmax, each cut after a random node and closed by a DequantizeLinear) run as one chain,
bit for bit against the same session's nodes one by one (the NumPy paths), and the default-domain convolutions
against onnxruntime. Geometry (groups, kernels, strides, pads, dilations), 8-bit types, per-tensor and
per-channel weights, zero points, biases and transB are drawn.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import host
from host.cpu_ep import native, quant_chain
from host.errors import KernelError

pytestmark = pytest.mark.skipif(native.LIB is None, reason="the compiled kernels are not built (python build.py)")

MS = "com.microsoft"
_ELEM = {np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}


class _Graph:
    """Nodes and initializers of a QOperator graph under construction."""

    def __init__(self, rng: np.random.Generator, act: type):
        self.rng, self.act, self.nodes, self.inits, self.n = rng, act, [], [], 0

    def const(self, value, prefix="c") -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def params(self, scale: float) -> tuple[str, str]:
        """A scale (drawn around `scale`) and a zero point of the activation type."""
        info = np.iinfo(self.act)
        zp = self.rng.integers(info.min // 2, info.max // 2 + 1) if self.act is np.int8 else self.rng.integers(0, 160)
        return self.const(np.float32(scale * self.rng.uniform(0.5, 2.0))), self.const(self.act(zp))

    def weights(self, shape, w_type, per_channel: bool, axis: int = 0) -> tuple[str, str, str]:
        """Weights with per-tensor or per-channel (along `axis`) scales and zero points."""
        info = np.iinfo(w_type)
        w = self.rng.integers(info.min, info.max + 1, shape).astype(w_type)
        count = shape[axis] if per_channel else 1
        scales = self.rng.uniform(0.002, 0.02, count).astype(np.float32)
        zps = self.rng.integers(info.min // 4, info.max // 4 + 1, count).astype(w_type)
        if not per_channel:
            scales, zps = scales[0], zps[0]
        return self.const(w, "w"), self.const(scales), self.const(zps)

    def node(self, op, inputs, domain="", **attrs) -> str:
        self.n += 1
        out = f"v{self.n}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"{op}_{self.n}", domain=domain, **attrs))
        return out

    def model(self, x_shape, last: str, last_params: tuple[str, str], rank: int | None = None):
        y = self.node("DequantizeLinear", [last, *last_params])
        y_shape = [f"d{i}" for i in range(len(x_shape) if rank is None else rank)]
        graph = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info(y, TensorProto.FLOAT, y_shape)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)])


@st.composite
def cnn_cases(draw):
    """(model, x, symmetric weights): a CNN cut after `stop` of its nodes."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    act, w_type = draw(st.sampled_from([np.uint8, np.int8])), draw(st.sampled_from([np.int8, np.uint8]))
    per_channel, symmetric = draw(st.booleans()), draw(st.booleans())
    group = draw(st.sampled_from([1, 2]))
    c, m = group * draw(st.integers(1, 3)), group * draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    strides = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    pads = [draw(st.integers(0, 1)) for _ in range(4)]
    dilations = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    h, w = draw(st.integers(5, 9)), draw(st.integers(5, 9))
    stop = draw(st.integers(2, 8))
    g = _Graph(rng, act)
    if symmetric:
        w_type = np.int8
    xs, xz = g.params(0.02)
    q = g.node("QuantizeLinear", ["x", xs, xz])
    stages = [(q, (xs, xz))]
    w1, w1s, w1z = g.weights((m, c // group, kh, kw), w_type, per_channel)
    if symmetric:
        g.inits[-1] = numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(g.inits[-1])), g.inits[-1].name)
    bias = [g.const(rng.integers(-2000, 2000, m).astype(np.int32))] if draw(st.booleans()) else []
    c1s, c1z = g.params(0.05)
    c1 = g.node("QLinearConv", [q, xs, xz, w1, w1s, w1z, c1s, c1z, *bias], group=group, kernel_shape=[kh, kw],
                strides=strides, pads=pads, dilations=dilations)
    stages.append((c1, (c1s, c1z)))
    p1 = g.node("MaxPool", [c1], kernel_shape=[2, 2], strides=[draw(st.integers(1, 2))] * 2,
                pads=[draw(st.integers(0, 1))] * 4)
    stages.append((p1, (c1s, c1z)))
    w2, w2s, w2z = g.weights((m, m, 3, 3), w_type, per_channel)
    c2s, c2z = g.params(0.1)
    c2 = g.node("QLinearConv", [p1, c1s, c1z, w2, w2s, w2z, c2s, c2z], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    stages.append((c2, (c2s, c2z)))
    a_s, a_z = g.params(0.1)
    a = g.node("QLinearAdd", [c2, c2s, c2z, p1, c1s, c1z, a_s, a_z], domain=MS)
    stages.append((a, (a_s, a_z)))
    gs, gz = g.params(0.05)
    gap = g.node("QLinearGlobalAveragePool", [a, a_s, a_z, gs, gz], domain=MS)
    stages.append((gap, (gs, gz)))
    f = g.node("Flatten", [gap])
    stages.append((f, (gs, gz)))
    trans_b = draw(st.booleans())
    n_out = draw(st.integers(1, 6))
    wf, wfs, wfz = g.weights((n_out, m) if trans_b else (m, n_out), w_type, per_channel, axis=0 if trans_b else 1)
    gemm_bias = [g.const(rng.integers(-500, 500, n_out).astype(np.int32))] if draw(st.booleans()) else [""]
    ys, yz = g.params(0.05)
    q5 = g.node("QGemm", [f, gs, gz, wf, wfs, wfz, *gemm_bias, ys, yz], domain=MS, transB=int(trans_b))
    stages.append((q5, (ys, yz)))
    g.nodes = g.nodes[:stop]
    last, params = stages[stop - 1]
    x = (rng.standard_normal((1, c, h, w)) * 2).astype(np.float32)
    return g.model([1, c, h, w], last, params, 2 if stop >= 7 else 4), x, symmetric and stop <= 4


@st.composite
def block_cases(draw):
    """A transformer block over (lead..., k) tokens, cut after a random node."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    act, w_type = draw(st.sampled_from([np.uint8, np.int8])), draw(st.sampled_from([np.int8, np.uint8]))
    lead = draw(st.sampled_from([(1,), (3,), (1, 4), (2, 3)]))
    k, hidden = draw(st.integers(1, 20)), draw(st.integers(1, 40))
    stop = draw(st.integers(2, 6))
    g = _Graph(rng, act)
    xs, xz = g.params(0.02)
    q = g.node("QuantizeLinear", ["x", xs, xz])
    stages = [(q, (xs, xz))]
    w1, w1s, w1z = g.weights((k, hidden), w_type, draw(st.booleans()), axis=1)
    ms, mz = g.params(0.1)
    m1 = g.node("QLinearMatMul", [q, xs, xz, w1, w1s, w1z, ms, mz])
    stages.append((m1, (ms, mz)))
    b = g.const(rng.integers(0, 255, hidden).astype(act) if act is np.uint8 else
                rng.integers(-128, 127, hidden).astype(act))
    bs, bz = g.params(0.05)
    as_, az = g.params(0.1)
    a1 = g.node("QLinearAdd", [m1, ms, mz, b, bs, bz, as_, az], domain=MS)
    stages.append((a1, (as_, az)))
    w2, w2s, w2z = g.weights((hidden, k), w_type, draw(st.booleans()), axis=1)
    m2s, m2z = g.params(0.1)
    m2 = g.node("QLinearMatMul", [a1, as_, az, w2, w2s, w2z, m2s, m2z])
    stages.append((m2, (m2s, m2z)))
    rs, rz = g.params(0.1)
    r = g.node("QLinearAdd", [m2, m2s, m2z, q, xs, xz, rs, rz], domain=MS)
    stages.append((r, (rs, rz)))
    ss, sz = g.const(np.float32(1 / 256)), g.const(act(np.iinfo(act).min))
    s = g.node("QLinearSoftmax", [r, rs, rz, ss, sz], domain=MS, axis=-1, opset=13)
    stages.append((s, (ss, sz)))
    g.nodes = g.nodes[:stop]
    last, params = stages[stop - 1]
    x = (rng.standard_normal((*lead, k)) * 2).astype(np.float32)
    return g.model([*lead, k], last, params), x


def _session(model, chains: bool, monkeypatch):
    with monkeypatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.setattr(quant_chain, "ENABLED", chains)
        options = host.SessionOptions()  # the graph as written (the optimizer's passes cost 0.25 s a session)
        options.graph_optimization_level = host.GraphOptimizationLevel.ORT_DISABLE_ALL
        return host.InferenceSession(model.SerializeToString(), options)


def _chains(session) -> list:
    """The QuantChain kernels of the session's CPU segments."""
    found = []
    for step, _, _ in session.executor.state().prepared:
        for entry in getattr(step, "steps", ()):
            if isinstance(entry[0].kernel, quant_chain.QuantChain):
                found.append(entry[0].kernel)
    return found


def _same_bits_as_one_by_one(model, x):
    with pytest.MonkeyPatch.context() as mp:
        joined, plain = _session(model, True, mp), _session(model, False, mp)
    (chain,) = _chains(joined)
    assert not _chains(plain)
    want = plain.run(None, {"x": x})[0]
    first, second = joined.run(None, {"x": x})[0], joined.run(None, {"x": x})[0]  # one by one, then compiled
    assert all(run for _, run in chain._runs.values()), "the chain was not compiled"
    for got in (first, second):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    return second


@settings(max_examples=60, deadline=None)
@given(case=cnn_cases())
def test_a_cnn_chain_gives_the_bits_of_its_nodes_one_by_one(case):
    model, x, _ = case
    _same_bits_as_one_by_one(model, x)


@settings(max_examples=60, deadline=None)
@given(case=block_cases())
def test_a_transformer_chain_gives_the_bits_of_its_nodes_one_by_one(case):
    _same_bits_as_one_by_one(*case)


@settings(max_examples=30, deadline=None)
@given(case=cnn_cases().filter(lambda c: c[2]))
def test_a_convolution_chain_matches_onnxruntime(case):
    """Quantize, QLinearConv, MaxPool, QLinearConv (symmetric int8 weights, which onnxruntime takes per channel
    too): MLAS's integers exactly."""
    model, x, _ = case
    got = _same_bits_as_one_by_one(model, x)
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_a_new_input_shape_gets_its_own_program(monkeypatch):
    model, _ = _fixed_block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joined, plain = _session(model, True, monkeypatch), _session(model, False, monkeypatch)
    (chain,) = _chains(joined)
    for rows in (1, 3, 1, 5):
        x = np.random.default_rng(rows).standard_normal((rows, 4, 16)).astype(np.float32)
        for _ in range(2):
            np.testing.assert_array_equal(joined.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])
    assert sorted(key[0][0][0] for key in chain._runs) == [1, 3, 5]
    assert all(run for _, run in chain._runs.values())


def _fixed_block():
    g = _Graph(np.random.default_rng(0), np.uint8)
    xs, xz = g.params(0.02)
    q = g.node("QuantizeLinear", ["x", xs, xz])
    w, ws, wz = g.weights((16, 16), np.int8, True, axis=1)
    ms, mz = g.params(0.1)
    m = g.node("QLinearMatMul", [q, xs, xz, w, ws, wz, ms, mz])
    model = g.model(["rows", 4, 16], m, (ms, mz))
    return model, None


def test_a_graph_output_inside_the_run_starts_the_chain_after_it(monkeypatch):
    model, _ = _fixed_block()
    model.graph.output.append(helper.make_tensor_value_info(model.graph.node[0].output[0], TensorProto.UINT8,
                                                            ["r", 4, 16]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joined, plain = _session(model, True, monkeypatch), _session(model, False, monkeypatch)
    (chain,) = _chains(joined)
    assert [n.op_type for n in chain.nodes] == ["QLinearMatMul", "DequantizeLinear"]
    x = np.random.default_rng(1).standard_normal((2, 4, 16)).astype(np.float32)
    for _ in range(2):
        for got, want in zip(joined.run(None, {"x": x}), plain.run(None, {"x": x})):
            np.testing.assert_array_equal(got, want)


def test_a_failing_node_of_a_chain_is_named(monkeypatch):
    model, _ = _fixed_block()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "k"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joined = _session(model, True, monkeypatch)
    assert _chains(joined)
    named = r"^node 'QLinearMatMul_\d+' \(QLinearMatMul\) on CPUExecutionProvider failed"
    with pytest.raises(KernelError, match=named):
        joined.run(None, {"x": np.zeros((1, 4, 15), np.float32)})


def test_a_large_convolution_runs_its_nodes_one_by_one(monkeypatch):
    """Beyond CONV_MAX_MACS the chain keeps the kernels' own paths (BLAS-backed): no program for that shape."""
    g = _Graph(np.random.default_rng(2), np.uint8)
    xs, xz = g.params(0.02)
    q = g.node("QuantizeLinear", ["x", xs, xz])
    w, ws, wz = g.weights((16, 8, 3, 3), np.int8, True)
    cs, cz = g.params(0.05)
    c = g.node("QLinearConv", [q, xs, xz, w, ws, wz, cs, cz], pads=[1, 1, 1, 1])
    model = g.model([1, 8, 64, 64], c, (cs, cz))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joined, plain = _session(model, True, monkeypatch), _session(model, False, monkeypatch)
    x = np.random.default_rng(3).standard_normal((1, 8, 64, 64)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(joined.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])
    (chain,) = _chains(joined)
    assert [run for _, run in chain._runs.values()] == [False]


# -- quantize_dynamic's graphs: float ops around the integer ones ---------------------------------------------


@st.composite
def dynamic_cnn_cases(draw):
    """DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul (the scales) -> Add (bias) -> Relu -> MaxPool (float32,
    tiling or not) -> Reshape -> DynamicQuantizeMatMul, as quantize_dynamic writes a CNN, cut after a random node."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    g = _Graph(rng, np.uint8)
    c, m = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    h, w = 2 * draw(st.integers(2, 4)), 2 * draw(st.integers(2, 4))
    w_type = draw(st.sampled_from([np.int8, np.uint8]))
    g.nodes.append(helper.make_node("DynamicQuantizeLinear", ["x"], ["dq_y", "dq_s", "dq_z"], name="dql"))
    stages = [("dq_y", TensorProto.UINT8, 4)]
    weights, w_scale, w_zp = g.weights((m, c, 3, 3), w_type, False)
    scale = g.node("Mul", ["dq_s", w_scale])
    stages.append((scale, TensorProto.FLOAT, 0))
    zp_input = [w_zp] if draw(st.booleans()) else []
    pad = draw(st.integers(0, 1))
    conv = g.node("ConvInteger", ["dq_y", weights, "dq_z", *zp_input], pads=[pad] * 4)
    stages.append((conv, TensorProto.INT32, 4))
    cast = g.node("Cast", [conv], to=TensorProto.FLOAT)
    scaled = g.node("Mul", [cast, scale])
    bias_shape = draw(st.sampled_from([(1, m, 1, 1), (m, 1, 1), (1,)]))
    biased = g.node("Add", [scaled, g.const(rng.standard_normal(bias_shape).astype(np.float32) * 0.1)])
    relu = g.node("Relu", [biased])
    stages += [(v, TensorProto.FLOAT, 4) for v in (cast, scaled, biased, relu)]
    tiles = draw(st.booleans()) and pad == 1  # the convolution keeps the even image: 2x2 windows tile it
    pool_pad = 0 if tiles else draw(st.integers(0, 1))
    pool = g.node("MaxPool", [relu], kernel_shape=[2, 2], strides=[2, 2] if tiles else [1, 1], pads=[pool_pad] * 4)
    stages.append((pool, TensorProto.FLOAT, 4))
    flat = g.node("Reshape", [pool, g.const(np.array([1, -1], np.int64))])
    stages.append((flat, TensorProto.FLOAT, 2))
    oh, ow = h + 2 * pad - 2, w + 2 * pad - 2
    ph, pw = (oh // 2, ow // 2) if tiles else (oh + 2 * pool_pad - 1, ow + 2 * pool_pad - 1)
    b, b_scale, b_zp = g.weights((m * ph * pw, draw(st.integers(1, 5))), w_type, draw(st.booleans()), axis=1)
    out = g.node("DynamicQuantizeMatMul", [flat, b, b_scale, b_zp], domain=MS)
    stages.append((out, TensorProto.FLOAT, 2))
    stop = draw(st.integers(2, len(stages)))
    g.nodes = g.nodes[:stop]
    x = (rng.standard_normal((1, c, h, w)) * draw(st.sampled_from([0.5, 3.0]))).astype(np.float32)
    return _typed_model(g, [1, c, h, w], *stages[stop - 1]), x


def _typed_model(g: _Graph, x_shape, last: str, elem: int, rank: int):
    y = helper.make_tensor_value_info(last, elem, [f"d{i}" for i in range(rank)])
    graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)], [y],
                              g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)])


@st.composite
def dynamic_block_cases(draw):
    """quantize_dynamic's transformer block: DynamicQuantizeMatMul -> Relu -> DynamicQuantizeMatMul -> Add (the
    input) -> Softmax, cut after a random node."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    g = _Graph(rng, np.uint8)
    lead = draw(st.sampled_from([(1,), (3,), (1, 4)]))
    k, hidden = draw(st.integers(1, 20)), draw(st.integers(1, 40))
    w_type = draw(st.sampled_from([np.int8, np.uint8]))
    stages = []
    b1, s1, z1 = g.weights((k, hidden), w_type, draw(st.booleans()), axis=1)
    bias = [g.const(rng.standard_normal(hidden).astype(np.float32))] if draw(st.booleans()) else []
    m1 = g.node("DynamicQuantizeMatMul", ["x", b1, s1, z1, *bias], domain=MS)
    r = g.node("Relu", [m1])
    b2, s2, z2 = g.weights((hidden, k), w_type, draw(st.booleans()), axis=1)
    m2 = g.node("DynamicQuantizeMatMul", [r, b2, s2, z2], domain=MS)
    a = g.node("Add", [m2, "x"])
    y = g.node("Softmax", [a], axis=-1)
    stages = [m1, r, m2, a, y]
    stop = draw(st.integers(2, len(stages)))
    g.nodes = g.nodes[:stop]
    x = (rng.standard_normal((*lead, k)) * draw(st.sampled_from([0.5, 3.0]))).astype(np.float32)
    return _typed_model(g, [*lead, k], stages[stop - 1], TensorProto.FLOAT, len(lead) + 1), x


@settings(max_examples=60, deadline=None)
@given(case=dynamic_cnn_cases())
def test_a_dynamic_cnn_chain_gives_the_bits_of_its_nodes_one_by_one(case):
    _same_bits_as_one_by_one(*case)


@settings(max_examples=40, deadline=None)
@given(case=dynamic_block_cases())
def test_a_dynamic_transformer_chain_gives_the_bits_of_its_nodes_one_by_one(case):
    _same_bits_as_one_by_one(*case)


def test_a_nan_in_the_input_runs_that_call_one_by_one(monkeypatch):
    """DynamicQuantizeLinear leaves a NaN or an infinity to the NumPy path: the chain's call declines, the nodes
    run in turn for that run, and the next finite input takes the compiled call again."""
    model, x = _dynamic_block_fixed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joined, plain = _session(model, True, monkeypatch), _session(model, False, monkeypatch)
    for value in (0.0, np.nan, np.inf, -np.inf, 1.0):
        x2 = x.copy()
        x2[0, 1, 3] = value
        for _ in range(2):
            np.testing.assert_array_equal(joined.run(None, {"x": x2})[0].view(np.uint32),
                                          plain.run(None, {"x": x2})[0].view(np.uint32))
    (chain,) = _chains(joined)
    assert all(run for _, run in chain._runs.values())


def _dynamic_block_fixed():
    g = _Graph(np.random.default_rng(4), np.uint8)
    b, s, z = g.weights((16, 8), np.int8, True, axis=1)
    m = g.node("DynamicQuantizeMatMul", ["x", b, s, z], domain=MS)
    r = g.node("Relu", [m])
    x = np.random.default_rng(5).standard_normal((1, 4, 16)).astype(np.float32)
    return _typed_model(g, [1, 4, 16], r, TensorProto.FLOAT, 3), x


def test_a_float_maxpool_in_a_chain_keeps_numpys_signed_zeros_and_nans(monkeypatch):
    """Quantize -> Dequantize -> Mul by +-1 and NaNs of either sign -> MaxPool: windows of -0 and +0 and of NaNs,
    whose winner depends on the order of np.maximum (tiling windows and padded ones)."""
    rng = np.random.default_rng(6)
    for tiles in (True, False):
        g = _Graph(rng, np.uint8)
        xs, xz = g.params(0.02)
        q = g.node("QuantizeLinear", ["x", xs, xz])
        d = g.node("DequantizeLinear", [q, xs, xz])
        signs = rng.choice(np.array([1.0, -1.0, np.nan, -np.nan], np.float32), (1, 2, 6, 6), p=[0.4, 0.4, 0.1, 0.1])
        mul = g.node("Mul", [d, g.const(signs.astype(np.float32))])
        pool = g.node("MaxPool", [mul], kernel_shape=[2, 2], strides=[2, 2] if tiles else [1, 1],
                      pads=[0] * 4 if tiles else [1] * 4)
        model = _typed_model(g, [1, 2, 6, 6], pool, TensorProto.FLOAT, 4)
        x = np.zeros((1, 2, 6, 6), np.float32)  # every code the zero point: every product a signed zero or NaN
        want = _same_bits_as_one_by_one(model, x)
        assert np.signbit(want[~np.isnan(want)]).any() and not np.signbit(want[~np.isnan(want)]).all()
        assert np.isnan(want).any()


def test_a_relu_in_a_chain_gives_numpys_zero_and_nans(monkeypatch):
    """np.maximum(x, 0) makes -0 +0 and passes a NaN of either sign as it is."""
    rng = np.random.default_rng(7)
    g = _Graph(rng, np.uint8)
    xs, xz = g.params(0.02)
    d = g.node("DequantizeLinear", [g.node("QuantizeLinear", ["x", xs, xz]), xs, xz])
    signs = rng.choice(np.array([1.0, -1.0, np.nan, -np.nan], np.float32), (3, 8), p=[0.4, 0.4, 0.1, 0.1])
    relu = g.node("Relu", [g.node("Mul", [d, g.const(signs.astype(np.float32))])])
    model = _typed_model(g, [3, 8], relu, TensorProto.FLOAT, 2)
    x = np.where(rng.random((3, 8)) < 0.5, 0.0, rng.standard_normal((3, 8))).astype(np.float32)
    want = _same_bits_as_one_by_one(model, x)
    assert (want == 0).any() and not np.signbit(want[want == 0]).any() and np.signbit(want[np.isnan(want)]).any()


def test_without_the_compiled_kernels_a_chain_runs_its_nodes(monkeypatch):
    model, _ = _fixed_block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        joined, plain = _session(model, True, monkeypatch), _session(model, False, monkeypatch)
    x = np.random.default_rng(8).standard_normal((2, 4, 16)).astype(np.float32)
    want = plain.run(None, {"x": x})[0]
    monkeypatch.setattr(native, "LIB", None)
    for _ in range(2):
        np.testing.assert_array_equal(joined.run(None, {"x": x})[0], want)
    (chain,) = _chains(joined)
    assert not chain._runs  # nothing compiled without the library
