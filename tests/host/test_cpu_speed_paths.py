"""The CPU EP's fast paths (docs/cpu_ep.md, "Speed") against onnxruntime and onnx's ReferenceEvaluator.

Each fast path serves only some inputs (initializer weights bound by the run loop, float32/float64,
contiguous, normalized over the last axis...); every test here runs a whole session, so the path is
chosen the way a real model chooses it, checks that the fast path was really taken (so a test cannot
pass on the general path alone), and compares with independent references. Hypothesis draws the
shapes where the geometry matters (convolutions).

These are the NumPy paths: the compiled kernels (host/cpu_ep/native, tested in test_cpu_native.py) are
switched off for this module, as when the library is not built.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from host.cpu_ep import native
from host.optimizer import GraphOptimizationLevel
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession

TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _numpy_paths():
    """Every test here runs the NumPy paths (the library off, as when it is not built)."""
    lib = native.LIB
    native.use(None)
    yield
    native.use(lib)


def _model(nodes, inputs: dict, outputs, initializers: dict, opset=18, domains=()):
    """A one-graph model: `inputs` name -> array (its dtype and shape declare the input), initializers
    name -> array; the outputs' types come from ONNX shape inference."""
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items()]
    outs = [helper.make_empty_tensor_value_info(o) for o in outputs]
    inits = [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    graph = helper.make_graph(nodes, "g", ins, outs, initializer=inits)
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=imports, ir_version=10))
    for out in model.graph.output:
        if not out.type.tensor_type.HasField("shape"):  # ai.ephost ops have no inference: float, rank unknown
            out.type.tensor_type.elem_type = ins[0].type.tensor_type.elem_type
            out.type.tensor_type.shape.SetInParent()
    return model


def _ephost(model) -> InferenceSession:
    so = SessionOptions()
    so.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL  # the node as written
    return InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])


def _kernels(sess: InferenceSession, op_type: str) -> list:
    return [n.kernel for n in sess.plan.nodes if n.op_type == op_type]


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


# -- the run loop binds initializers ---------------------------------------------------------------


def test_run_loop_binds_initializers_by_position(monkeypatch):
    from host import cpu_ep

    w = np.ones((4, 3), np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": np.ones((2, 4), np.float32)}, ["y"],
                   {"w": w})
    seen = []
    # The steps are built with the session: record what every kernel is told then.
    monkeypatch.setattr(cpu_ep.lookup("", "MatMul", 17), "bind_constants", lambda self, bound: seen.append(bound))
    sess = _ephost(model)
    sess.run(None, {"x": np.ones((2, 4), np.float32)})
    assert len(seen) == 1 and list(seen[0]) == [1]
    np.testing.assert_array_equal(seen[0][1], w)


# -- Conv with bound weights -----------------------------------------------------------------------


def _conv_model(x, w, b, attrs, weights_fed=False):
    inputs = {"x": x}
    names = ["x", "w"] + (["b"] if b is not None else [])
    consts = {"w": w} if not weights_fed else {}
    if weights_fed:
        inputs["w"] = w
    if b is not None:
        consts["b"] = b
    node = helper.make_node("Conv", names, ["y"], **attrs)
    return _model([node], inputs, ["y"], consts)


@st.composite
def depthwise_cases(draw):
    c = draw(st.integers(1, 12))
    mult = draw(st.integers(1, 3))
    nd = draw(st.sampled_from([1, 2]))
    k = [draw(st.integers(1, 5)) for _ in range(nd)]
    dil = [draw(st.integers(1, 2)) for _ in range(nd)]
    size = [draw(st.integers(max(1, (kk - 1) * dd + 1 - 2), 9)) for kk, dd in zip(k, dil)]
    strides = [draw(st.integers(1, 3)) for _ in range(nd)]
    pads = [draw(st.integers(0, 2)) for _ in range(2 * nd)]
    batch = draw(st.integers(1, 2))
    bias = draw(st.booleans())
    return c, mult, k, dil, size, strides, pads, batch, bias


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depthwise_cases())
def test_depthwise_conv_as_dense_matrix_matches_onnxruntime(case):
    c, mult, k, dil, size, strides, pads, batch, bias = case
    nd = len(k)
    # The padded image must hold one dilated window (else the output is empty).
    if any(s + pads[i] + pads[i + nd] < (kk - 1) * d + 1 for i, (s, kk, d) in enumerate(zip(size, k, dil))):
        return
    rng = np.random.default_rng(sum(size) + c)
    x = rng.standard_normal((batch, c, *size)).astype(np.float32)
    w = rng.standard_normal((c * mult, 1, *k)).astype(np.float32)
    b = rng.standard_normal(c * mult).astype(np.float32) if bias else None
    attrs = {"group": c, "strides": strides, "pads": pads, "dilations": dil}
    model = _conv_model(x, w, b, attrs)
    sess = _ephost(model)
    want = _ort(model, {"x": x})[0]
    for _ in range(2):  # the second run goes through the per-shape closure (Conv._closure)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, **TOL)
    kernel = _kernels(sess, "Conv")[0]
    assert list(kernel._fast) == [x.shape]
    prepared = [p[0] for p in kernel._prepared.values()]
    if [p.kind for p in kernel._plans.values()] == ["pointwise"]:  # one channel, 1x1, stride 1, no padding
        assert prepared == ["pointwise"]
    else:
        assert prepared == ["dense"]  # these sizes are all under the dense-matrix limit


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 6), st.tuples(st.integers(1, 5), st.integers(1, 5)), st.tuples(st.integers(1, 2), st.integers(1, 2)),
       st.tuples(st.integers(1, 3), st.integers(1, 3)), st.lists(st.integers(0, 2), min_size=4, max_size=4),
       st.integers(20, 28), st.booleans())
def test_depthwise_conv_over_a_larger_image_by_rows_matches_onnxruntime(c, k, dil, strides, pads, size, bias):
    """Images too large for the dense matrix: the kernel-rows matrix (Conv._prepare_rows)."""
    rng = np.random.default_rng(size + c)
    x = rng.standard_normal((1, c, size, size + 3)).astype(np.float32)
    w = rng.standard_normal((c, 1, *k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32) if bias else None
    model = _conv_model(x, w, b, {"group": c, "strides": list(strides), "pads": pads, "dilations": list(dil)})
    sess = _ephost(model)
    want = _ort(model, {"x": x})[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, **TOL)
    from host.cpu_ep.ops_nn import _DENSE_LIMIT

    # Strides can shrink the output enough for the dense matrix: only larger outputs go by rows.
    expected = "dense" if c * x[0, 0].size * want[0, 0].size <= _DENSE_LIMIT else "rows"
    assert [p[0] for p in _kernels(sess, "Conv")[0]._prepared.values()] == [expected]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 6), st.tuples(st.integers(1, 4), st.integers(1, 4)),
       st.tuples(st.integers(1, 2), st.integers(1, 2)), st.tuples(st.integers(1, 3), st.integers(1, 3)),
       st.lists(st.integers(0, 2), min_size=4, max_size=4), st.booleans())
def test_conv_im2col_with_bound_weights_matches_onnxruntime(c, m, k, dil, strides, pads, bias):
    rng = np.random.default_rng(c * 7 + m)
    x = rng.standard_normal((1, c, 11, 9)).astype(np.float32)
    w = rng.standard_normal((m, c, *k)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32) if bias else None
    model = _conv_model(x, w, b, {"strides": list(strides), "pads": pads, "dilations": list(dil)})
    sess = _ephost(model)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _ort(model, {"x": x})[0], **TOL)
    kernel = _kernels(sess, "Conv")[0]
    if [p.kind for p in kernel._plans.values()] == ["im2col"]:
        assert [p[0] for p in kernel._prepared.values()] == ["im2col"]


def test_depthwise_conv_over_a_large_image_keeps_the_window_path():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 8, 32, 32)).astype(np.float32)
    w = rng.standard_normal((8, 1, 3, 3)).astype(np.float32)
    model = _conv_model(x, w, None, {"group": 8, "strides": [2, 2], "pads": [1, 1, 1, 1]})
    sess = _ephost(model)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _ort(model, {"x": x})[0], **TOL)
    assert list(_kernels(sess, "Conv")[0]._prepared.values())[0][0] == "rows"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_pointwise_conv_with_bound_weights(batch, bias):
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 6, 3, 5)).astype(np.float32)
    w = rng.standard_normal((4, 6, 1, 1)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32) if bias else None
    model = _conv_model(x, w, b, {})
    sess = _ephost(model)
    want = _ort(model, {"x": x})[0]
    for _ in range(2):  # the second run goes through the per-shape closure (Conv._closure)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, **TOL)
    assert [p[0] for p in _kernels(sess, "Conv")[0]._prepared.values()] == ["pointwise"]
    assert list(_kernels(sess, "Conv")[0]._fast) == [x.shape]


def test_conv_with_fed_weights_takes_the_general_path():
    """Weights that are a graph input are not bound: each run's weights are used as they come."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 4, 5, 5)).astype(np.float32)
    w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    model = _conv_model(x, w, None, {"group": 4, "pads": [1, 1, 1, 1]}, weights_fed=True)
    sess = _ephost(model)
    for scale in (1.0, -2.0):
        feeds = {"x": x, "w": w * np.float32(scale)}
        np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)
    assert _kernels(sess, "Conv")[0]._prepared == {}


def test_conv_float64_dense_path():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 3, 4, 4))
    w = rng.standard_normal((3, 1, 3, 3))
    model = _conv_model(x, w, None, {"group": 3, "pads": [1, 1, 1, 1]})
    sess = _ephost(model)
    got = sess.run(None, {"x": x})[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-12, atol=1e-12)


# -- ReduceMean over trailing axes -----------------------------------------------------------------


@pytest.mark.parametrize("axes,keepdims", [([2, 3], 1), ([2, 3], 0), ([-1], 1), ([1, 2, 3], 0), ([1], 1),
                                           ([3, 2], 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_mean_with_initializer_axes(axes, keepdims, dtype):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 3, 4)).astype(dtype)
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=keepdims)
    model = _model([node], {"x": x}, ["y"], {"axes": np.array(axes, np.int64)})
    sess = _ephost(model)
    got = sess.run(None, {"x": x})[0]
    want = np.mean(x, axis=tuple(axes), keepdims=bool(keepdims))
    assert got.dtype == x.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], **TOL)


# -- normalizations over the last axis -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 16, 64), (3, 7), (2, 2, 3, 5)])
def test_layer_normalization_rows(dtype, shape):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    scale = rng.standard_normal(shape[-1]).astype(dtype)
    bias = rng.standard_normal(shape[-1]).astype(dtype)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], epsilon=1e-3)
    model = _model([node], {"x": x}, ["y", "mean", "inv"], {"s": scale, "b": bias}, opset=17)
    got = _ephost(model).run(None, {"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("shape", [(1, 16, 64), (4, 9)])
def test_rms_normalization_rows(shape):
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape).astype(np.float32)
    scale = rng.standard_normal(shape[-1]).astype(np.float32)
    node = helper.make_node("RMSNormalization", ["x", "s"], ["y"], epsilon=1e-2)
    model = _model([node], {"x": x}, ["y"], {"s": scale}, opset=23)
    got = _ephost(model).run(None, {"x": x})[0]
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-2) * scale
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_skip_layer_normalization_rows(with_bias, dtype):
    rng = np.random.default_rng(7)
    x, skip = (rng.standard_normal((2, 5, 8)).astype(dtype) for _ in range(2))
    scale, bias = (rng.standard_normal(8).astype(dtype) for _ in range(2))
    names = ["x", "skip", "s"] + (["b"] if with_bias else [])
    node = helper.make_node("SkipLayerNormalization", names, ["y", "sum"], domain="ai.ephost", epsilon=1e-4)
    consts = {"s": scale} | ({"b": bias} if with_bias else {})
    model = _model([node], {"x": x, "skip": skip}, ["y", "sum"], consts, domains=("ai.ephost",))
    y, total = _ephost(model).run(None, {"x": x, "skip": skip})
    s = (x + skip).astype(np.float64)
    want = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-4) * scale
    if with_bias:
        want = want + bias
    np.testing.assert_allclose(y, want, **TOL)
    np.testing.assert_array_equal(total, x + skip)


# -- Attention's softmax: one shared maximum, the per-row softmax when a row underflows ---------------


def _attention_model(q, mask, heads):
    names = ["q", "k", "v"] + (["mask"] if mask is not None else [])
    node = helper.make_node("Attention", names, ["y"], q_num_heads=heads, kv_num_heads=heads)
    inputs = {"q": q, "k": q[:, ::-1].copy(), "v": q * 2} | ({"mask": mask} if mask is not None else {})
    return _model([node], inputs, ["y"], {}, opset=23), inputs


def _attention_cases():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 6, 8)).astype(np.float32)
    yield "no-mask", q, None
    yield "additive", q, rng.standard_normal((1, 1, 6, 6)).astype(np.float32)
    far = np.zeros((1, 1, 6, 6), np.float32)
    far[..., 2, :] = -1e4  # one query row far below the others: its exponentials vanish with a shared maximum
    yield "row-far-below", q, far
    dead = np.zeros((1, 1, 6, 6), np.float32)
    dead[..., 3, :] = -np.inf  # a row with no attendable key: zeros
    yield "dead-row", q, dead
    yield "bool-mask", q, rng.random((2, 1, 6, 6)) > 0.3
    yield "huge-scores", q * 40, None  # exp(score - shared max) underflows for most rows


@pytest.mark.parametrize("label,q,mask", list(_attention_cases()), ids=[c[0] for c in _attention_cases()])
def test_attention_softmax_paths_match_the_reference(label, q, mask):
    model, feeds = _attention_model(q, mask, heads=2)
    got = _ephost(model).run(None, feeds)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("mask_kind", ["none", "float", "bool", "short"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_4d_and_causal_match_the_reference(causal, mask_kind, dtype):
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)).astype(dtype) for _ in range(3))
    masks = {"none": None, "float": rng.standard_normal((1, 3, 5, 5)).astype(dtype),
             "bool": rng.random((5, 5)) > 0.2, "short": rng.standard_normal((5, 3)).astype(dtype)}
    mask = masks[mask_kind]
    names = ["q", "k", "v"] + ([] if mask is None else ["mask"])
    node = helper.make_node("Attention", names, ["y"], is_causal=causal, scale=0.7)
    feeds = {"q": q, "k": k, "v": v} | ({} if mask is None else {"mask": mask})
    model = _model([node], feeds, ["y"], {}, opset=23)
    got = _ephost(model).run(None, feeds)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, **TOL)


def test_attention_fast_softmax_falls_back_exactly_when_a_row_underflows():
    """The fallback is needed: a shared maximum alone gives NaN (0/0) on the far row."""
    from host.cpu_ep.ops_transformer import Attention
    from host.runtime.node import NodeInfo

    kernel = Attention(NodeInfo("a", "Attention", "", 23, {}, ("q", "k", "v"), ("y",)))
    scores = np.zeros((1, 1, 3, 4), np.float32)
    scores[..., 1, :] = -1e4
    probs = kernel._softmax(scores.copy(), None)
    np.testing.assert_allclose(probs, np.full((1, 1, 3, 4), 0.25, np.float32), rtol=1e-6)


# -- gathers with initializer indices --------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_with_initializer_indices(axis):
    rng = np.random.default_rng(9)
    data = rng.standard_normal((3, 5)).astype(np.float32)
    dim = data.shape[axis]
    shape = (2, 5) if axis == 0 else (3, 4)
    indices = rng.integers(-dim, dim, size=shape).astype(np.int64)
    model = _model([helper.make_node("GatherElements", ["data", "idx"], ["y"], axis=axis)], {"data": data}, ["y"],
                   {"idx": indices})
    sess = _ephost(model)
    for scale in (1, 3):  # the flat index is reused on the next run
        feeds = {"data": data * np.float32(scale)}
        got = sess.run(None, feeds)[0]
        # (onnx's reference mishandles a negative axis here: onnxruntime and NumPy are the references)
        np.testing.assert_array_equal(got, _ort(model, feeds)[0])
        np.testing.assert_array_equal(got, np.take_along_axis(feeds["data"], indices % dim, axis=axis))
    assert list(_kernels(sess, "GatherElements")[0]._flat) == [data.shape]


def test_gather_elements_initializer_index_out_of_range_is_a_kernel_error():
    data = np.zeros((2, 3), np.float32)
    model = _model([helper.make_node("GatherElements", ["data", "idx"], ["y"], axis=1)], {"data": data}, ["y"],
                   {"idx": np.array([[0, 3]], np.int64)})
    from host.errors import KernelError

    with pytest.raises(KernelError, match=r"^node '.*' \(GatherElements\) on CPUExecutionProvider failed: index 3 "):
        _ephost(model).run(None, {"data": data})


@pytest.mark.parametrize("batch_dims,data_shape,idx", [
    (0, (1, 16), np.stack([np.zeros(16, np.int64), np.arange(16)], -1).reshape(1, 1, 1, 16, 2)),
    (0, (4, 3, 2), np.array([[1], [-1], [0]], np.int64)),
    (1, (2, 4, 3), np.array([[[1, 2], [3, -1]], [[0, 0], [2, 1]]], np.int64)),
])
def test_gather_nd_with_initializer_indices(batch_dims, data_shape, idx):
    rng = np.random.default_rng(10)
    data = rng.standard_normal(data_shape).astype(np.float32)
    node = helper.make_node("GatherND", ["data", "idx"], ["y"], batch_dims=batch_dims)
    model = _model([node], {"data": data}, ["y"], {"idx": idx})
    sess = _ephost(model)
    got = sess.run(None, {"data": data})[0]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"data": data})[0])
    np.testing.assert_array_equal(got, _ort(model, {"data": data})[0])
    assert list(_kernels(sess, "GatherND")[0]._flat) == [data.shape]


# -- FusedMatMul with an initializer bias ----------------------------------------------------------


@pytest.mark.parametrize("activation", ["", "Relu", "Gelu", "GeluTanh"])
@pytest.mark.parametrize("a_shape", [(1, 16, 8), (5, 8), (2, 3, 4, 8)])
def test_fused_matmul_bound_bias_tile(activation, a_shape):
    rng = np.random.default_rng(11)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal((8, 6)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    node = helper.make_node("FusedMatMul", ["a", "b", "bias"], ["y"], domain="ai.ephost", activation=activation)
    model = _model([node], {"a": a}, ["y"], {"b": b, "bias": bias}, domains=("ai.ephost",))
    sess = _ephost(model)
    got = sess.run(None, {"a": a})[0]
    z = (a.astype(np.float64) @ b + bias)
    from scipy.special import erf

    want = {"": z, "Relu": np.maximum(z, 0), "Gelu": 0.5 * z * (1 + erf(z / np.sqrt(2))),
            "GeluTanh": 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))}[activation]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)
    rows = int(np.prod(a_shape[:-1]))
    assert list(_kernels(sess, "FusedMatMul")[0]._tiles) == [rows]


# -- run-loop chains (host/cpu_ep/fusion.py) --------------------------------------------------------


def _segments(sess):
    from host.runtime.steps import CpuSegment

    return [step for step, _ in sess.executor.steps if isinstance(step, CpuSegment)]


def _steps(sess):
    return [entry for segment in _segments(sess) for entry in segment.steps]


def _prelude(sess):
    return [pair for segment in _segments(sess) for pair in segment.prelude]


def _chains(sess) -> list[tuple[str, tuple[str, ...]]]:
    from host.cpu_ep.fusion import FusedNode

    return [(type(s[0].kernel).__name__, s[0].names) for s in _steps(sess) if isinstance(s[0], FusedNode)]


def _conv_chain_model(outputs=("out",), extra_nodes=()):
    """x -> Conv -> HardSwish -> Conv(depthwise) -> Relu -> Conv(1x1) -> Add(x1) -> Gemm-free tail."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    inits = {
        "w1": rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 1, 3, 3)).astype(np.float32),
        "w3": rng.standard_normal((8, 8, 1, 1)).astype(np.float32), "b3": rng.standard_normal(8).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("HardSwish", ["c1"], ["a1"], name="hswish"),
        helper.make_node("Conv", ["a1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=8, name="dw"),
        helper.make_node("Relu", ["c2"], ["a2"], name="relu"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["c3"], name="project"),
        helper.make_node("Add", ["a1", "c3"], ["out"], name="residual"),
        *extra_nodes,
    ]
    return _model(nodes, {"x": x}, list(outputs), inits), {"x": x}


def test_conv_epilogue_chains_match_onnxruntime():
    model, feeds = _conv_chain_model()
    sess = _ephost(model)
    got = sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)
    # a1 feeds both the depthwise conv and the residual Add: conv1+hswish is a chain, the Add stays with
    # the projection conv.
    assert _chains(sess) == [("_EpilogueChain", ("conv1", "hswish")), ("_EpilogueChain", ("dw", "relu")),
                             ("_EpilogueChain", ("project", "residual"))]


def test_a_chain_value_that_is_a_graph_output_keeps_its_own_value():
    """c1 is asked for: HardSwish must not run in place on it."""
    model, feeds = _conv_chain_model(outputs=("out", "c1", "c2"))
    sess = _ephost(model)
    got = sess.run(None, feeds)
    want = _ort(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)
    names = [c[1] for c in _chains(sess)]
    assert ("conv1", "hswish") not in names and ("dw", "relu") not in names
    assert ("project", "residual") in names


def test_a_chain_value_with_two_readers_is_not_joined():
    extra = [helper.make_node("Sigmoid", ["c2"], ["side"], name="side")]
    model, feeds = _conv_chain_model(outputs=("out", "side"), extra_nodes=extra)
    sess = _ephost(model)
    for g, w in zip(sess.run(None, feeds), _ort(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL)
    assert ("dw", "relu") not in [c[1] for c in _chains(sess)]


@pytest.mark.parametrize("op", ["Mul", "Add"])
def test_an_add_or_mul_by_an_initializer_is_not_joined(op):
    """A scale or bias initializer is not the same-shape operand the compiled epilogue takes: the MatMul
    joins the Mul / Add by a value, but not the one by the initializer."""
    rng = np.random.default_rng(16)
    x, w, r = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 8), (4, 8)))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node(op, ["m", "r"], ["g"], name="by_value"),
             helper.make_node(op, ["g", "scale"], ["y"], name="by_initializer")]
    model = _model(nodes, {"x": x, "r": r}, ["y"], {"w": w, "scale": np.float32(0.5)})
    sess = _ephost(model)
    np.testing.assert_allclose(sess.run(None, {"x": x, "r": r})[0], _ort(model, {"x": x, "r": r})[0], **TOL)
    assert [c[1] for c in _chains(sess)] == [("mm", "by_value")]


def test_profiled_nodes_are_never_joined(tmp_path):
    model, feeds = _conv_chain_model()
    so = SessionOptions()
    so.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)
    assert _chains(sess) == []


def test_chain_failure_names_the_node_that_failed():
    """A residual Add whose operands do not broadcast fails in the chain, naming the Add."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    other = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "other"], ["y"], name="the_add")]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 2, "h", "w"]),
           helper.make_tensor_value_info("other", TensorProto.FLOAT, ["b", 2, "h2", "w2"])]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", 2, "h", "w"])],
                              initializer=[numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    sess = _ephost(model)
    np.testing.assert_allclose(sess.run(None, {"x": x, "other": other})[0], _ort(model, {"x": x, "other": other})[0],
                               **TOL)
    assert _chains(sess) == [("_EpilogueChain", ("conv", "the_add"))]
    from host.errors import KernelError

    with pytest.raises(KernelError, match=r"^node 'the_add' \(Add\) on CPUExecutionProvider failed: "):
        sess.run(None, {"x": x, "other": other[:, :, :2, :2]})


def _se_model(pool: str, gate: str, batch: int, swap_mul: bool, axes=(2, 3), dtype=np.float32):
    rng = np.random.default_rng(14)
    c, r = 6, 3
    x = rng.standard_normal((batch, c, 5, 4)).astype(dtype)
    inits = {"w1": rng.standard_normal((r, c, 1, 1)).astype(dtype), "b1": rng.standard_normal(r).astype(dtype),
             "w2": rng.standard_normal((c, r, 1, 1)).astype(dtype), "b2": rng.standard_normal(c).astype(dtype)}
    if pool == "ReduceMean":
        inits["axes"] = np.array(axes, np.int64)
        pool_node = helper.make_node("ReduceMean", ["x", "axes"], ["p"], keepdims=1, name="pool")
    else:
        pool_node = helper.make_node("GlobalAveragePool", ["x"], ["p"], name="pool")
    gate_attrs = {"alpha": 0.25, "beta": 0.4} if gate == "HardSigmoid" else {}
    nodes = [
        pool_node,
        helper.make_node("Conv", ["p", "w1", "b1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["hr"], name="relu"),
        helper.make_node("Conv", ["hr", "w2", "b2"], ["g"], name="fc2"),
        helper.make_node(gate, ["g"], ["gate"], name="gate", **gate_attrs),
        helper.make_node("Mul", ["gate", "x"] if swap_mul else ["x", "gate"], ["y"], name="scale"),
    ]
    return _model(nodes, {"x": x}, ["y"], inits), {"x": x}


@pytest.mark.parametrize("pool", ["ReduceMean", "GlobalAveragePool"])
@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
@pytest.mark.parametrize("batch,swap_mul", [(1, False), (3, True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squeeze_excite_block_matches_onnxruntime(pool, gate, batch, swap_mul, dtype, monkeypatch):
    from host.cpu_ep import fusion

    def refuse(self, values):
        raise AssertionError("the fast path should serve this block")

    monkeypatch.setattr(fusion._SqueezeExcite, "_one_by_one", refuse)
    model, feeds = _se_model(pool, gate, batch, swap_mul, dtype=dtype)
    sess = _ephost(model)
    got = sess.run(None, feeds)[0]
    want = _ort(model, feeds)[0] if dtype == np.float32 else ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, **TOL)
    assert _chains(sess) == [("_SqueezeExcite", ("pool", "fc1", "relu", "fc2", "gate", "scale"))]


def test_squeeze_excite_over_other_axes_runs_the_kernels_one_by_one():
    """Pooling over one spatial axis only: the block still matches, but its fast path does not apply."""
    model, feeds = _se_model("ReduceMean", "HardSigmoid", 2, False, axes=(3,))
    sess = _ephost(model)
    np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)
    assert [c[0] for c in _chains(sess)] == ["_SqueezeExcite"]


# -- shape ops with initializer shapes / axes: the output shape is kept per input shape ---------------


def _dynamic_model(node, const_name, const, rank, opset=18):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [f"d{i}" for i in range(rank)])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", [x], [y], initializer=[numpy_helper.from_array(const, const_name)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    model = onnx.shape_inference.infer_shapes(model)
    if not model.graph.output[0].type.tensor_type.HasField("shape"):
        model.graph.output[0].type.tensor_type.shape.SetInParent()
    return model


@pytest.mark.parametrize("op,const,shapes", [
    ("Reshape", np.array([0, -1], np.int64), [(2, 3, 4), (5, 2, 2), (2, 3, 4)]),
    ("Reshape", np.array([-1, 2, 0], np.int64), [(3, 4, 5), (6, 2, 1)]),
    ("Unsqueeze", np.array([0, -1], np.int64), [(2, 3), (4, 1), (2, 3)]),
    ("Expand", np.array([3, 1, 4], np.int64), [(1, 5, 1), (3, 2, 1), (1, 5, 1)]),
])
def test_shape_ops_with_initializer_arguments_follow_each_input_shape(op, const, shapes):
    node = helper.make_node(op, ["x", "arg"], ["y"])
    model = _dynamic_model(node, "arg", const, len(shapes[0]))
    sess = _ephost(model)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(16)
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        got = sess.run(None, {"x": x})[0]
        want = ref.run(None, {"x": x})[0]
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert sorted(_kernels(sess, op)[0]._memo) == sorted(set(shapes))


def test_reshape_with_an_initializer_shape_still_checks_the_size():
    from host.errors import KernelError

    model = _dynamic_model(helper.make_node("Reshape", ["x", "arg"], ["y"]), "arg", np.array([4, -1], np.int64), 2)
    sess = _ephost(model)
    assert sess.run(None, {"x": np.zeros((2, 6), np.float32)})[0].shape == (4, 3)
    with pytest.raises(KernelError, match=r"^node '.*' \(Reshape\) on CPUExecutionProvider failed: cannot reshape"):
        sess.run(None, {"x": np.zeros((3, 3), np.float32)})


def test_reshape_with_a_fed_shape_follows_every_run():
    """A shape that is a graph input is not kept: the same x with another shape reshapes anew."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g", [x, shape], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    sess = _ephost(model)
    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    for target in ([3, 4], [4, 3], [-1, 2]):
        got = sess.run(None, {"x": data, "shape": np.array(target, np.int64)})[0]
        np.testing.assert_array_equal(got, data.reshape(target))


# -- RotaryEmbedding over whole heads --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rotary_dim", [0, 8])
@pytest.mark.parametrize("caches_fed", [False, True])
def test_rotary_whole_heads_match_the_reference(dtype, rotary_dim, caches_fed):
    rng = np.random.default_rng(17)
    x = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    angles = rng.standard_normal((2, 5, 4))
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], rotary_embedding_dim=rotary_dim)
    caches = {"cos": cos, "sin": sin}
    model = _model([node], {"x": x} | (caches if caches_fed else {}), ["y"], {} if caches_fed else caches,
                   opset=23)
    sess = _ephost(model)
    for scale in (1, 2):  # fed caches change between runs; bound ones are kept
        feeds = {"x": x * dtype(scale)} | ({"cos": cos * dtype(scale), "sin": sin} if caches_fed else {})
        got = sess.run(None, feeds)[0]
        want = ReferenceEvaluator(model).run(None, feeds)[0]
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    kept = _kernels(sess, "RotaryEmbedding")[0]._full
    assert (kept is None) == caches_fed


# -- Sigmoid as 1 / (1 + exp(-x)) -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_over_its_whole_range(dtype):
    from scipy.special import expit

    x = np.concatenate([np.linspace(-120, 120, 4001), [0.0, -0.0, np.inf, -np.inf, 1e-30, -1e-30]]).astype(dtype)
    model = _model([helper.make_node("Sigmoid", ["x"], ["y"])], {"x": x}, ["y"], {})
    got = _ephost(model).run(None, {"x": x})[0]
    want = expit(x.astype(np.float64))
    assert got.dtype == dtype
    # Within 4 ulp; values below the dtype's smallest normal number may flush to 0.
    np.testing.assert_allclose(got, want, rtol=4 * np.finfo(dtype).eps, atol=np.finfo(dtype).tiny)
    np.testing.assert_array_equal(x, np.concatenate([np.linspace(-120, 120, 4001),
                                                     [0.0, -0.0, np.inf, -np.inf, 1e-30, -1e-30]]).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_tanh_over_its_whole_range(dtype):
    x = np.concatenate([np.linspace(-30, 30, 6001), [0.0, np.inf]]).astype(dtype)
    node = helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")
    got = _ephost(_model([node], {"x": x}, ["y"], {}, opset=20)).run(None, {"x": x})[0]
    x64 = x.astype(np.float64)
    # 0.5 x (1 + tanh(u)) = x * expit(2u), in float64 through scipy (1 + tanh(u) cancels for x << 0).
    from scipy.special import expit

    two_u = 2 * np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)
    want = x64 * expit(two_u)
    want[np.isinf(x64)] = x64[np.isinf(x64)]
    assert got.dtype == dtype
    # Where |2u| <= 20 (|x| below ~5, outputs down to ~1e-8 |x|): within 32 ulp (exp(-2u) magnifies
    # u's rounding by up to 20). Beyond, the magnification grows with |2u| on outputs that are 0 to
    # within 1e-8 |x|: checked absolutely.
    near = np.abs(two_u) <= 20
    np.testing.assert_allclose(got[near], want[near], rtol=32 * np.finfo(dtype).eps, atol=0)
    np.testing.assert_allclose(got[~near], want[~near], rtol=16 * np.finfo(dtype).eps,
                               atol=1e-8 * np.abs(x64[~near & np.isfinite(x64)]).max())


# -- Identity over an initializer (TorchScript exports with the optimizer off) ------------------------


def _identity_weight_model(weight_is_output: bool):
    rng = np.random.default_rng(18)
    x = rng.standard_normal((1, 4, 5, 5)).astype(np.float32)
    w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Identity", ["w0"], ["w"], name="copy_w"),
             helper.make_node("Conv", ["x", "w"], ["y"], group=4, pads=[1, 1, 1, 1], name="dw"),
             helper.make_node("Relu", ["y"], ["out"], name="relu")]
    outputs = ["out", "w"] if weight_is_output else ["out"]
    return _model(nodes, {"x": x}, outputs, {"w0": w}), {"x": x}, w


def test_identity_over_an_initializer_is_stored_up_front_and_binds_the_weights():
    model, feeds, w = _identity_weight_model(False)
    sess = _ephost(model)
    for _ in range(2):
        np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)
    prelude = _prelude(sess)
    assert len(prelude) == 1 and prelude[0][1] is sess.plan.constants[sess.plan.value_ids["w0"]]
    assert "copy_w" not in [getattr(s[0], "name", None) for s in _steps(sess)]
    assert [p[0] for p in _kernels(sess, "Conv")[0]._prepared.values()] == ["dense"]
    assert _chains(sess) == [("_EpilogueChain", ("dw", "relu"))]


def test_identity_over_an_initializer_that_is_a_graph_output_still_runs():
    model, feeds, w = _identity_weight_model(True)
    sess = _ephost(model)
    out, weight = sess.run(None, feeds)
    np.testing.assert_allclose(out, _ort(model, feeds)[0], **TOL)
    np.testing.assert_array_equal(weight, w)
    assert _prelude(sess) == []


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 4, 3, 3), (2, 2, 2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_average_pool_as_a_gemv(shape, dtype):
    rng = np.random.default_rng(19)
    x = rng.standard_normal(shape).astype(dtype)
    model = _model([helper.make_node("GlobalAveragePool", ["x"], ["y"])], {"x": x}, ["y"], {})
    got = _ephost(model).run(None, {"x": x})[0]
    want = x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)


def test_conv_kernel_uses_its_closure_only_for_the_bound_weights_and_bias():
    """bind_constants' contract: what a kernel derives from bound arrays serves only those arrays (a
    kernel also runs outside the CPU run loop, with other weights or bias)."""
    from host.cpu_ep.ops_nn import Conv
    from host.runtime.node import NodeInfo

    rng = np.random.default_rng(20)
    x = rng.standard_normal((1, 6, 3, 3)).astype(np.float32)
    w = rng.standard_normal((4, 6, 1, 1)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    kernel = Conv(NodeInfo("c", "Conv", "", 18, {}, ("x", "w", "b"), ("y",)))
    kernel.bind_constants({1: w, 2: b})
    for _ in range(2):
        kernel._run(x, w, b)
    assert list(kernel._fast) == [x.shape]

    def reference(w_, b_):
        return np.einsum("mc,nchw->nmhw", w_[:, :, 0, 0], x) + b_.reshape(1, -1, 1, 1)

    np.testing.assert_allclose(kernel._run(x, w, b)[0], reference(w, b), **TOL)
    np.testing.assert_allclose(kernel._run(x, w, b * 3)[0], reference(w, b * 3), **TOL)
    np.testing.assert_allclose(kernel._run(x, w * 2, b)[0], reference(w * 2, b), **TOL)
    np.testing.assert_allclose(kernel._run(x, w, None)[0], reference(w, np.zeros(4, np.float32)), **TOL)


@pytest.mark.parametrize("a_shape", [(5, 8), (1, 16, 8), (2, 3, 4, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_by_a_weight_matrix(a_shape, dtype):
    rng = np.random.default_rng(21)
    a = rng.standard_normal(a_shape).astype(dtype)
    b = rng.standard_normal((8, 6)).astype(dtype)
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": a}, ["y"], {"b": b})
    sess = _ephost(model)
    got = sess.run(None, {"a": a})[0]
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL)
    # The kernel with a non-contiguous operand (a transposed view) takes the general path.
    view = np.swapaxes(np.ascontiguousarray(np.swapaxes(a, -1, -2)), -1, -2)
    assert not view.flags.c_contiguous
    np.testing.assert_allclose(_kernels(sess, "MatMul")[0]._run(view, b)[0], want, **TOL)
