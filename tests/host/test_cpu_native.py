"""The CPU EP's compiled kernels (host/cpu_ep/native, docs/cpu_ep.md "Third pass").

Each kernel is checked two ways: called directly against NumPy/scipy formulas in float64 (hypothesis draws
the GEMM and convolution geometries), and inside a session, where the run loop chooses it as a real model
would; a spy on the library proves the compiled kernel ran, and the result is compared with onnxruntime,
onnx's ReferenceEvaluator or a NumPy definition. The fallback (no library, a stale build, the switch off)
is tested here too; the NumPy paths themselves are tested with the library off in test_cpu_speed_paths.py.
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx.reference import ReferenceEvaluator
from scipy.special import erf, expit

from host.cpu_ep import native
from host.optimizer import GraphOptimizationLevel
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.host.test_cpu_speed_paths import _ephost, _model, _ort
from tests.models import available_models, load

LIB = native.LIB
TOL = {"rtol": 1e-4, "atol": 1e-5}
F32 = np.float32


def test_the_library_is_built_and_loaded():
    """CI runs build.py first: the tests below must exercise the compiled kernels, not skip them."""
    assert LIB is not None, native.LOAD_ERROR


def test_pointers_come_from_the_api_modules_builtin_when_it_is_loaded():
    """native.ptr is the API module's own from_buffer (a builtin, cheaper than cffi.FFI's Python wrapper)
    while that module's lib is in use, and cffi.FFI's for any other; both point at the array's data."""
    if native.API_MODULE is None:
        pytest.skip("the ABI-mode library is loaded (no API module built): ptr is cffi.FFI's by design")
    x = np.arange(4, dtype=np.float32)
    assert type(native.ptr).__name__ == "builtin_function_or_method"
    assert native.ffi.cast("float *", native.ptr(x))[3] == 3.0
    try:
        native.use(None)
        assert native.ptr == native.ffi.from_buffer
    finally:
        native.use(LIB)
    assert type(native.ptr).__name__ == "builtin_function_or_method"


class _Spy:
    """Stands for the library and counts calls per function."""

    def __init__(self, lib):
        self._lib = lib
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def call(*args):
            self.calls[name] += 1
            return fn(*args)

        return call


@pytest.fixture
def spy():
    if LIB is None:
        pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
    s = _Spy(LIB)
    native.use(s)
    yield s
    native.use(LIB)


@pytest.fixture
def numpy_only():
    native.use(None)
    yield
    native.use(LIB)


def _both(model, feeds, spy, fn: str, times: int = 1):
    """The session's outputs with the compiled kernels (checking that `fn` ran `times` per run)."""
    sess = _ephost(model)
    got = sess.run(None, feeds)
    assert spy.calls[fn] == times, dict(spy.calls)
    return got


# -- elementwise math ------------------------------------------------------------------------------------

_X = np.concatenate([np.linspace(-90, 90, 120001), [0.0, -0.0, 1e-30, -1e-30, 3.5, -3.5]]).astype(F32)
_SPECIAL = np.array([np.nan, np.inf, -np.inf], F32)


def _act(step, x, alpha=0.2, beta=0.5):
    y = np.empty_like(x)
    LIB.ep_bias_act(native.ptr(x), native.NULL, native.ptr(y), 1, x.size, step, native.NULL, alpha, beta)
    return y


def _references(x):
    x = x.astype(np.float64)
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    return {
        native.RELU: np.maximum(x, 0),
        native.GELU: 0.5 * x * (1 + erf(x / math.sqrt(2))),
        native.GELU_TANH: 0.5 * x * (1 + np.tanh(u)),
        native.SIGMOID: expit(x),
        native.HARD_SWISH: x * np.clip(x / 6 + 0.5, 0, 1),
        native.HARD_SIGMOID: np.clip(0.2 * x + 0.5, 0, 1),
        native.SILU: x * expit(x),
    }


@pytest.mark.parametrize("step", ["RELU", "GELU", "GELU_TANH", "SIGMOID", "HARD_SWISH", "HARD_SIGMOID", "SILU"])
def test_epilogue_steps_over_their_whole_range(spy, step):
    code = getattr(native, step)
    with np.errstate(all="ignore"):
        want = _references(_X)[code]
        special = _references(_SPECIAL)[code]
    got = _act(code, _X)
    # exp and erf are float32 polynomials: a few ulp of float32 (tanh-GELU's own formula rounds u in float32);
    # erf-GELU for x below -4 is 0.5 x (1 + erf) with erf within an ulp of -1: an absolute error of x * 6e-8.
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 if code == native.GELU else 2e-7)
    if code == native.GELU:  # 1 + erf(x) never goes negative: GELU keeps the sign of x
        assert (got[_X < 0] <= 0).all() and (got[_X > 0] > 0).all()
    # NaN stays NaN, infinities go where the float64 formulas (NumPy's ufuncs) take them.
    np.testing.assert_array_equal(_act(code, _SPECIAL), special.astype(F32))


def test_bias_and_residual_steps():
    rng = np.random.default_rng(1)
    x, bias, res = rng.standard_normal((5, 7)).astype(F32), rng.standard_normal(7).astype(F32), \
        rng.standard_normal((5, 7)).astype(F32)
    y = np.empty_like(x)
    LIB.ep_bias_act(native.ptr(x), native.ptr(bias), native.ptr(y), 5, 7, native.program([native.RELU, native.ADD]),
                    native.ptr(res), 0.0, 0.0)
    np.testing.assert_allclose(y, np.maximum(x + bias, 0) + res, rtol=1e-6)
    LIB.ep_bias_act(native.ptr(x), native.NULL, native.ptr(y), 5, 7, native.program([native.MUL, native.ADD]),
                    native.ptr(res), 0.0, 0.0)
    np.testing.assert_allclose(y, x * res + res, rtol=1e-6)


def test_program_holds_at_most_six_steps():
    assert native.program([native.RELU, native.ADD]) == native.RELU | native.ADD << 4
    with pytest.raises(ValueError, match="^an epilogue program holds at most 6 steps, got 7$"):
        native.program([native.RELU] * 7)


# -- GEMM ---------------------------------------------------------------------------------------------------

_STEPS = [native.RELU, native.GELU, native.GELU_TANH, native.HARD_SWISH, native.HARD_SIGMOID, native.SIGMOID,
          native.ADD, native.SILU, native.MUL]


def _apply(z, steps, res, alpha, beta):
    for s in steps:
        if s == native.ADD:
            z = z + res
        elif s == native.MUL:
            z = z * res
        elif s == native.HARD_SIGMOID:
            z = np.clip(alpha * z + beta, 0, 1)
        else:
            z = _references(z)[s]
    return z


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 70), st.integers(1, 70), st.integers(0, 2), st.booleans(),
       st.lists(st.sampled_from(_STEPS), max_size=3))
def test_gemm_with_bias_and_epilogue(m, k, n, bias_kind, transposed, steps):
    rng = np.random.default_rng(m * 10000 + k * 100 + n)
    a, b = rng.standard_normal((m, k)).astype(F32), rng.standard_normal((k, n)).astype(F32)
    bias = rng.standard_normal({0: 1, 1: n, 2: m}[bias_kind]).astype(F32)
    res = rng.standard_normal((m, n)).astype(F32)
    at = np.ascontiguousarray(a.T)
    c = np.empty((m, n), F32)
    ptr, null = native.ptr, native.NULL
    LIB.ep_gemm(ptr(a), ptr(at) if transposed else null, ptr(b), ptr(bias) if bias_kind else null, bias_kind,
                ptr(c), m, k, n, native.program(steps), ptr(res), 0.3, 0.4)
    z = a.astype(np.float64) @ b
    z += {0: 0, 1: bias[None, :], 2: bias[:, None]}[bias_kind]
    np.testing.assert_allclose(c, _apply(z, steps, res, 0.3, 0.4), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("n", [128, 160, 300])
def test_gemm_rows_have_the_same_bits_at_any_row_count(n):
    """Rows in 4-row tiles and the rows after them (row_wide, 128 columns at a time, then 32-column tiles)
    sum over k in the same order: each output row is the same whether computed alone or among others."""
    rng = np.random.default_rng(n)
    k = 37
    a, b, bias = (rng.standard_normal(s).astype(F32) for s in ((9, k), (k, n), (n,)))

    def product(rows):
        c = np.empty((len(rows), n), F32)
        LIB.ep_gemm(native.ptr(rows), native.NULL, native.ptr(b), native.ptr(bias), 1, native.ptr(c), len(rows), k, n,
                    0, native.NULL, 0.0, 0.0)
        return c

    whole = product(a)
    np.testing.assert_allclose(whole, a.astype(np.float64) @ b + bias, rtol=1e-4, atol=1e-4)
    for m in range(1, 10):
        np.testing.assert_array_equal(product(np.ascontiguousarray(a[:m])), whole[:m])
    for i in range(9):
        np.testing.assert_array_equal(product(np.ascontiguousarray(a[i:i + 1]))[0], whole[i])


def test_large_products_are_left_to_blas():
    """The compiled GEMM is a single-threaded loop: products past GEMM_MAX_MACS, or whose walked operand is
    wider than GEMM_MAX_PANEL, go to np.dot (a 4096-wide MLP took minutes per run on the compiled loop)."""
    assert native.gemm_fits(16, 64, 64) and native.gemm_fits(16, 512, 512)
    assert not native.gemm_fits(1024, 1024, 1024)            # too many multiply-adds
    assert not native.gemm_fits(1, 1024, 1024)               # few, but a 4 MiB panel walked by columns
    assert native.conv_gemm_fits(64, 64, 1024) and not native.conv_gemm_fits(1024, 1024, 4)  # narrow: taps x m


@pytest.mark.parametrize("case", ["matmul", "fused-matmul", "pointwise-conv", "conv3x3"])
def test_large_products_run_outside_the_library_with_the_same_result(spy, case):
    rng = np.random.default_rng(15)
    if case in ("matmul", "fused-matmul"):
        a, w, bias = (rng.standard_normal(s).astype(F32) for s in ((2, 1024), (1024, 1024), (1024,)))
        if case == "matmul":
            node, consts = helper.make_node("MatMul", ["a", "w"], ["y"]), {"w": w}
        else:
            node = helper.make_node("FusedMatMul", ["a", "w", "bias"], ["y"], domain="ai.ephost", activation="Relu")
            consts = {"w": w, "bias": bias}
        model = _model([node], {"a": a}, ["y"], consts, domains=("ai.ephost",) if case != "matmul" else ())
        want = a.astype(np.float64) @ w + (bias if case != "matmul" else 0)
        want = np.maximum(want, 0) if case != "matmul" else want
        feeds = {"a": a}
    else:
        k = 1 if case == "pointwise-conv" else 3
        x, w = rng.standard_normal((1, 256, 40, 40)).astype(F32), rng.standard_normal((256, 256, k, k)).astype(F32)
        model = _model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[k // 2] * 4)], {"x": x}, ["y"], {"w": w})
        feeds = {"x": x}
        want = _ort(model, feeds)[0]
    (got,) = _ephost(model).run(None, feeds)
    assert not (spy.calls["ep_gemm"] or spy.calls["ep_conv2d"]), dict(spy.calls)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# -- ops in a session ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["", "Relu", "Gelu", "GeluTanh"])
def test_fused_matmul(spy, activation):
    rng = np.random.default_rng(2)
    a, b, bias = (rng.standard_normal(s).astype(F32) for s in ((2, 16, 64), (64, 40), (40,)))
    node = helper.make_node("FusedMatMul", ["a", "b", "bias"], ["y"], domain="ai.ephost", activation=activation)
    model = _model([node], {"a": a}, ["y"], {"b": b, "bias": bias}, domains=("ai.ephost",))
    (got,) = _both(model, {"a": a}, spy, "ep_gemm")
    z = a.astype(np.float64) @ b + bias
    want = {"": z, "Relu": np.maximum(z, 0), "Gelu": 0.5 * z * (1 + erf(z / math.sqrt(2))),
            "GeluTanh": 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))}[activation]
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("case", ["matmul", "gemm-transB", "gemm-bias"])
def test_matmul_and_gemm(spy, case):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 24)).astype(F32)
    if case == "matmul":
        node, consts = helper.make_node("MatMul", ["a", "w"], ["y"]), {"w": rng.standard_normal((24, 9)).astype(F32)}
    else:
        consts = {"w": rng.standard_normal((9, 24)).astype(F32), "c": rng.standard_normal(9).astype(F32)}
        names = ["a", "w", "c"] if case == "gemm-bias" else ["a", "w"]
        node = helper.make_node("Gemm", names, ["y"], transB=1)
        if case != "gemm-bias":
            del consts["c"]
    model = _model([node], {"a": a}, ["y"], consts)
    (got,) = _both(model, {"a": a}, spy, "ep_gemm")
    np.testing.assert_allclose(got, _ort(model, {"a": a})[0], **TOL)


def test_layer_normalization_with_statistics(spy):
    rng = np.random.default_rng(4)
    x, scale, bias = (rng.standard_normal(s).astype(F32) for s in ((2, 7, 48), (48,), (48,)))
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv_std"], epsilon=1e-3)
    model = _model([node], {"x": x}, ["y", "mean", "inv_std"], {"scale": scale, "bias": bias}, opset=18)
    got = _both(model, {"x": x}, spy, "ep_layernorm")
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_layer_normalization(spy, with_bias):
    rng = np.random.default_rng(5)
    x, skip, scale, bias = (rng.standard_normal(s).astype(F32) for s in ((3, 16, 64), (3, 16, 64), (64,), (64,)))
    names = ["x", "skip", "scale"] + (["bias"] if with_bias else [])
    node = helper.make_node("SkipLayerNormalization", names, ["y", "sum"], domain="ai.ephost", epsilon=1e-5)
    consts = {"scale": scale} | ({"bias": bias} if with_bias else {})
    model = _model([node], {"x": x, "skip": skip}, ["y", "sum"], consts, domains=("ai.ephost",))
    y, s = _both(model, {"x": x, "skip": skip}, spy, "ep_layernorm")
    s64 = x.astype(np.float64) + skip
    mu = s64.mean(-1, keepdims=True)
    want = (s64 - mu) / np.sqrt(((s64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + (bias if with_bias else 0)
    np.testing.assert_allclose(y, want, **TOL)
    np.testing.assert_array_equal(s, x + skip)


def test_rms_normalization(spy):
    rng = np.random.default_rng(6)
    # Small values: epsilon is a tenth of the mean square, so a kernel that drops it fails.
    x, scale = (rng.standard_normal((2, 9, 32)) * 0.03).astype(F32), rng.standard_normal(32).astype(F32)
    node = helper.make_node("RMSNormalization", ["x", "scale"], ["y"], epsilon=1e-4)
    model = _model([node], {"x": x}, ["y"], {"scale": scale}, opset=23)
    (got,) = _both(model, {"x": x}, spy, "ep_rmsnorm")
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], **TOL)


@pytest.mark.parametrize("op,attrs,fn", [("Gelu", {}, "ep_bias_act"), ("Gelu", {"approximate": "tanh"}, "ep_bias_act"),
                                         ("Sigmoid", {}, "ep_bias_act"), ("HardSwish", {}, "ep_bias_act"),
                                         ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, "ep_bias_act")])
def test_activations(spy, op, attrs, fn):
    x = np.random.default_rng(7).standard_normal((4, 33)).astype(F32) * 4
    model = _model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": x}, ["y"], {}, opset=20)
    (got,) = _both(model, {"x": x}, spy, fn)
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(spy, approximate):
    rng = np.random.default_rng(8)
    x, bias = rng.standard_normal((16, 40)).astype(F32), rng.standard_normal(40).astype(F32)
    node = helper.make_node("BiasGelu", ["x", "bias"], ["y"], domain="ai.ephost", approximate=approximate)
    model = _model([node], {"x": x}, ["y"], {"bias": bias}, domains=("ai.ephost",))
    (got,) = _both(model, {"x": x}, spy, "ep_bias_act")
    z = x.astype(np.float64) + bias
    want = (0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))) if approximate == "tanh"
            else 0.5 * z * (1 + erf(z / math.sqrt(2))))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- attention and rotary, with the (batch, heads, seq, size) views a Transpose makes -----------------------


def _masks(rng, b, h, s, t):
    dead = np.zeros((b, 1, s, t), F32)
    dead[:, :, 1, :] = -np.inf  # a row with no attendable key: zeros
    return {"none": None, "float": rng.standard_normal((1, h, s, t)).astype(F32), "bool": rng.random((s, t)) > 0.3,
            "dead-row": dead}


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("mask_kind", ["none", "float", "bool", "dead-row"])
@pytest.mark.parametrize("layout", ["3d", "3d-split", "4d-transposed", "4d-mixed"])
def test_attention(spy, causal, mask_kind, layout):
    rng = np.random.default_rng(9)
    b, h, s, d = 2, 3, 7, 8
    mask = _masks(rng, b, h, s, s)[mask_kind]
    qkv = {n: rng.standard_normal((b, s, h * d)).astype(F32) for n in "qkv"}
    names = ["q", "k", "v"] + ([] if mask is None else ["mask"])
    if layout == "3d":
        nodes = [helper.make_node("Attention", names, ["y"], q_num_heads=h, kv_num_heads=h, is_causal=causal)]
    elif layout == "3d-split":  # column blocks of one fused projection (GPT-2): views the kernel copies
        qkv = {"qkv": np.concatenate([qkv["q"], qkv["k"], qkv["v"]], axis=2)}
        nodes = [helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=2, num_outputs=3),
                 helper.make_node("Attention", names, ["y"], q_num_heads=h, kv_num_heads=h, is_causal=causal)]
    elif layout == "4d-mixed":  # a contiguous query, keys and values through a Transpose: strides differ
        qkv["q"] = qkv["q"].reshape(b, s, h, d).transpose(0, 2, 1, 3).copy()
        nodes = [n for x in "kv" for n in (helper.make_node("Reshape", [x, "shape"], [x + "r"]),
                                           helper.make_node("Transpose", [x + "r"], [x + "t"], perm=[0, 2, 1, 3]))]
        names = ["q", "kt", "vt"] + names[3:]
        nodes.append(helper.make_node("Attention", names, ["y"], is_causal=causal, scale=0.3))
    else:  # Reshape + Transpose to (b, h, s, d): the kernel reads the Transpose's strided view
        nodes = [n for x in "qkv" for n in (helper.make_node("Reshape", [x, "shape"], [x + "r"]),
                                            helper.make_node("Transpose", [x + "r"], [x + "t"], perm=[0, 2, 1, 3]))]
        names = ["qt", "kt", "vt"] + names[3:]
        nodes.append(helper.make_node("Attention", names, ["y"], is_causal=causal, scale=0.3))
    feeds = qkv | ({} if mask is None else {"mask": mask})
    consts = {"shape": np.array([b, s, h, d], np.int64)} if layout.startswith("4d") else {}
    model = _model(nodes, feeds, ["y"], consts, opset=23)
    (got,) = _both(model, feeds, spy, "ep_attention")
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_attention_grouped_heads(spy, causal, layout):
    """Grouped-query attention (6 query heads over 2 key/value heads, as the optimizer leaves Llama's
    repeated K/V): query head h reads kv head h // 3."""
    rng = np.random.default_rng(12)
    b, h, g, s, d = 2, 6, 2, 5, 8
    mask = _masks(rng, b, h, s, s)["float"]
    if layout == "3d":
        feeds = {"q": rng.standard_normal((b, s, h * d)), "k": rng.standard_normal((b, s, g * d)),
                 "v": rng.standard_normal((b, s, g * d))}
        attrs = {"q_num_heads": h, "kv_num_heads": g}
    else:
        feeds = {"q": rng.standard_normal((b, h, s, d)), "k": rng.standard_normal((b, g, s, d)),
                 "v": rng.standard_normal((b, g, s, d))}
        attrs = {}
    feeds = {k: v.astype(F32) for k, v in feeds.items()} | {"mask": mask}
    nodes = [helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], is_causal=causal, scale=0.3, **attrs)]
    model = _model(nodes, feeds, ["y"], {}, opset=23)
    (got,) = _both(model, feeds, spy, "ep_attention")
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("caches_fed", [False, True])
@pytest.mark.parametrize("shared_caches", [True, False])
def test_rotary_on_a_transposed_view(spy, shared_caches, caches_fed):
    rng = np.random.default_rng(10)
    b, s, h, d = 2, 5, 3, 8
    x = rng.standard_normal((b, s, h, d)).astype(F32)
    angles = rng.standard_normal((1 if shared_caches else b, s, d // 2))
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1, 3]),
             helper.make_node("RotaryEmbedding", ["xt", "cos", "sin"], ["y"])]
    caches = {"cos": cos, "sin": sin}
    feeds = {"x": x} | (caches if caches_fed else {})
    model = _model(nodes, feeds, ["y"], {} if caches_fed else caches, opset=23)
    (got,) = _both(model, feeds, spy, "ep_rotary_halves")
    if shared_caches:
        cos, sin = np.repeat(cos, b, 0), np.repeat(sin, b, 0)  # the reference wants the batch spelled out
    want = ReferenceEvaluator(nodes[1]).run(None, {"xt": np.ascontiguousarray(x.transpose(0, 2, 1, 3)),
                                                   "cos": cos, "sin": sin})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("shared_caches", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_rotary_3d_with_num_heads(spy, shared_caches, layout, compiled):
    """The 3-D form (batch, seq, heads*size) that the optimizer's Rotary3D writes, compiled in one call: for a
    contiguous input the output is written in the 3-D layout (no copy); a view's heads are read in place."""
    rng = np.random.default_rng(12)
    b, s, h, d = 2, 5, 3, 8
    angles = rng.standard_normal((1 if shared_caches else b, s, d // 2))
    caches = {"cos": np.cos(angles).astype(F32), "sin": np.sin(angles).astype(F32)}
    if layout == "contiguous":
        feeds = {"x": rng.standard_normal((b, s, h * d)).astype(F32)}
        nodes = [helper.make_node("Identity", ["x"], ["x3"])]
    else:  # a Transpose's view: (seq, batch, hidden) -> (batch, seq, hidden)
        feeds = {"x": rng.standard_normal((s, b, h * d)).astype(F32)}
        nodes = [helper.make_node("Transpose", ["x"], ["x3"], perm=[1, 0, 2])]
    nodes.append(helper.make_node("RotaryEmbedding", ["x3", "cos", "sin"], ["y"], num_heads=h))
    model = _model(nodes, feeds, ["y"], caches, opset=23)
    if not compiled:
        native.use(None)
    try:
        (got,) = _ephost(model).run(None, feeds)
    finally:
        native.use(spy)
    assert spy.calls["ep_rotary_halves"] == (1 if compiled else 0), dict(spy.calls)
    x3 = feeds["x"] if layout == "contiguous" else np.ascontiguousarray(feeds["x"].transpose(1, 0, 2))
    cos, sin = (np.repeat(c, b, 0) if shared_caches else c for c in (caches["cos"], caches["sin"]))
    want = ReferenceEvaluator(nodes[1]).run(None, {"x3": x3, "cos": cos, "sin": sin})[0]
    assert got.shape == (b, s, h * d)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _swiglu(mul_order: tuple[bool, bool], sigmoid_output: bool):
    """y = silu(x Wg) * (x Wu) as exporters write it: MatMul, Sigmoid, Mul(g, sigmoid), MatMul, Mul; the
    operand orders of both Muls drawn; with `sigmoid_output` the sigmoid's value is a graph output too."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 16, 24)).astype(F32)
    weights = {"wg": rng.standard_normal((24, 40)).astype(F32), "wu": rng.standard_normal((24, 40)).astype(F32)}
    silu_in = ["g", "sg"] if mul_order[0] else ["sg", "g"]
    gate_in = ["a", "u"] if mul_order[1] else ["u", "a"]
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", silu_in, ["a"]), helper.make_node("MatMul", ["x", "wu"], ["u"]),
             helper.make_node("Mul", gate_in, ["y"])]
    return _model(nodes, {"x": x}, ["y"] + (["sg"] if sigmoid_output else []), weights), {"x": x}


@pytest.mark.parametrize("mul_order", [(True, True), (False, False)])
@pytest.mark.parametrize("sigmoid_output", [False, True])
def test_swiglu_runs_as_two_gemms_with_epilogues(spy, mul_order, sigmoid_output):
    """Llama's MLP: MatMul -> SiLU joins as one compiled GEMM with a SILU step; the up projection's MatMul
    takes the gating Mul as a MUL step. A sigmoid value that is a graph output keeps its own node."""
    model, feeds = _swiglu(mul_order, sigmoid_output)
    got = _ephost(model).run(None, feeds)
    assert spy.calls["ep_gemm"] == 2, dict(spy.calls)
    assert spy.calls["ep_bias_act"] == (1 if sigmoid_output else 0), dict(spy.calls)  # Sigmoid on its own
    for g, w in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("mul_order", [(True, False), (False, True)])
def test_swiglu_chain_without_the_library(numpy_only, mul_order):
    model, feeds = _swiglu(mul_order, False)
    np.testing.assert_allclose(_ephost(model).run(None, feeds)[0], _ort(model, feeds)[0], **TOL)


def test_first_element_of_views():
    base = np.arange(24, dtype=F32).reshape(2, 3, 4)
    assert native.first_element(base) is not None
    assert native.first_element(base.transpose(2, 0, 1)) is not None  # a whole permuted array
    assert native.first_element(base[:, 1:]) is None                 # starts past the base's start
    assert native.first_element(base[:, ::-1]) is None               # a negative stride
    assert native.first_element(base[..., :2].transpose(2, 0, 1)) is None  # part of the base


# -- convolutions, their chains and squeeze-and-excitation ------------------------------------------------


@st.composite
def conv_cases(draw):
    kind = draw(st.sampled_from(["pointwise", "depthwise", "dense"]))
    c = draw(st.integers(1, 20))
    m = c if kind == "depthwise" else draw(st.integers(1, 40))
    k = [1, 1] if kind == "pointwise" else [draw(st.integers(1, 5)) for _ in range(2)]
    dil = [1, 1] if kind == "pointwise" else [draw(st.integers(1, 2)) for _ in range(2)]
    strides = [1, 1] if kind == "pointwise" else [draw(st.integers(1, 3)) for _ in range(2)]
    pads = [0] * 4 if kind == "pointwise" else [draw(st.integers(0, 2)) for _ in range(4)]
    size = [draw(st.integers(max(1, (kk - 1) * dd + 1), 20)) for kk, dd in zip(k, dil)]
    return kind, c, m, k, dil, strides, pads, size, draw(st.booleans()), draw(st.sampled_from(["", "HardSwish",
                                                                                               "Relu", "Add"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_cases())
def test_conv_and_its_epilogue_chain_match_onnxruntime(case):
    kind, c, m, k, dil, strides, pads, size, bias, epilogue = case
    rng = np.random.default_rng(c * 1000 + m * 10 + sum(size))
    x = rng.standard_normal((1, c, *size)).astype(F32)
    w = rng.standard_normal((m, 1 if kind == "depthwise" else c, *k)).astype(F32)
    consts = {"w": w} | ({"b": rng.standard_normal(m).astype(F32)} if bias else {})
    attrs = {"group": c if kind == "depthwise" else 1, "strides": strides, "pads": pads, "dilations": dil}
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y0"], **attrs)]
    feeds = {"x": x}
    if epilogue == "Add":
        out = [(s + p0 + p1 - ((kk - 1) * dd + 1)) // st_ + 1
               for s, p0, p1, kk, dd, st_ in zip(size, pads[:2], pads[2:], k, dil, strides)]
        feeds["r"] = rng.standard_normal((1, m, *out)).astype(F32)
        nodes.append(helper.make_node("Add", ["y0", "r"], ["y"]))
    elif epilogue:
        nodes.append(helper.make_node(epilogue, ["y0"], ["y"]))
    model = _model(nodes, feeds, ["y" if epilogue else "y0"], consts)
    spy = _Spy(LIB)
    native.use(spy)
    try:
        got = _ephost(model).run(None, feeds)[0]
    finally:
        native.use(LIB)
    if k == [1, 1] and strides == [1, 1] and not any(pads) and attrs["group"] == 1:
        fn = "ep_gemm"  # pointwise (a depthwise 1x1 over one channel too)
    elif c == m and (kind == "depthwise" or c == 1):
        fn = "ep_depthwise2d"  # one filter per channel (group 1 over one channel too)
    else:
        fn = "ep_conv2d"
    assert spy.calls[fn] == 1, dict(spy.calls)
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)


@pytest.mark.parametrize("case", ["bound", "weights-fed", "residual-broadcasts", "matmul-residual"])
def test_chains_with_operands_their_closures_do_not_take(spy, case):
    """A chain's per-shape closure serves bound weights and a same-shape residual; anything else takes the
    general compiled call or the kernels one by one, with the same result."""
    rng = np.random.default_rng(14)
    if case == "matmul-residual":
        x, w, r = (rng.standard_normal(s).astype(F32) for s in ((6, 16), (16, 16), (6, 16)))
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "r"], ["y"])]
        feeds, consts = {"x": x, "r": r}, {"w": w}
    else:
        x, w = rng.standard_normal((1, 8, 5, 5)).astype(F32), rng.standard_normal((12, 8, 1, 1)).astype(F32)
        r = rng.standard_normal((1, 12, 1, 1) if case == "residual-broadcasts" else (1, 12, 5, 5)).astype(F32)
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("HardSwish", ["c"], ["h"]),
                 helper.make_node("Add", ["h", "r"], ["y"])]
        feeds, consts = {"x": x, "r": r}, {"w": w}
        if case == "weights-fed":
            feeds, consts = feeds | consts, {}
    model = _model(nodes, feeds, ["y"], consts)
    sess = _ephost(model)
    for _ in range(2):  # the second run goes through the kept closure where there is one
        np.testing.assert_allclose(sess.run(None, feeds)[0], _ort(model, feeds)[0], **TOL)
    assert spy.calls["ep_gemm"] == 2  # the producer is compiled in every case (a broadcast Add then runs apart)


@pytest.mark.parametrize("stride,pad,dilation", [(1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 0, 1)])
def test_depthwise_over_wide_rows(spy, stride, pad, dilation):
    """Outputs of 16 columns or more take the row loop (narrower ones go channels last: the hypothesis test)."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 6, 35, 37)).astype(F32)
    consts = {"w": rng.standard_normal((6, 1, 3, 5)).astype(F32), "b": rng.standard_normal(6).astype(F32)}
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=6, strides=[stride, stride], pads=[pad, 2 * pad] * 2,
                            dilations=[dilation, dilation])
    model = _model([node], {"x": x}, ["y"], consts)
    (got,) = _both(model, {"x": x}, spy, "ep_depthwise2d")
    assert got.shape[3] >= 16
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], **TOL)


@pytest.mark.parametrize("stride,size", [(1, 21), (2, 40), (1, 5)])
def test_depthwise_writes_only_its_output(stride, size):
    """Called directly on an output buffer with a tail of sentinels: partial 16-column blocks (and the
    channels-last path) must store exactly the output's elements."""
    rng = np.random.default_rng(15)
    c, k, pad = 3, 3, 1
    out = (size + 2 * pad - k) // stride + 1
    x, w = rng.standard_normal((c, size, size)).astype(F32), rng.standard_normal((c, 1, k, k)).astype(F32)
    n = c * out * out
    y = np.full(n + 32, 7.0, F32)
    geom = native.conv_geometry(C=c, H=size, W=size, M=c, KH=k, KW=k, SH=stride, SW=stride, PH=pad, PW=pad, DH=1,
                                DW=1, OH=out, OW=out)
    assert LIB.ep_depthwise2d(native.ptr(x), native.ptr(w), native.NULL, native.ptr(y), geom, 0, native.NULL, 0.0,
                              0.0) == 0
    np.testing.assert_array_equal(y[n:], 7.0)
    model = _model([helper.make_node("Conv", ["x", "w"], ["y"], group=c, strides=[stride] * 2, pads=[pad] * 4)],
                   {"x": x[None]}, ["y"], {"w": w})
    np.testing.assert_allclose(y[:n].reshape(1, c, out, out), _ort(model, {"x": x[None]})[0], **TOL)


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
def test_squeeze_excite(spy, gate):
    rng = np.random.default_rng(11)
    c, r = 24, 8
    x = rng.standard_normal((2, c, 5, 5)).astype(F32)
    consts = {"w1": rng.standard_normal((r, c, 1, 1)).astype(F32), "b1": rng.standard_normal(r).astype(F32),
              "w2": rng.standard_normal((c, r, 1, 1)).astype(F32), "b2": rng.standard_normal(c).astype(F32)}
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Conv", ["hr", "w2", "b2"], ["g"]),
             helper.make_node(gate, ["g"], ["gs"], **({"alpha": 0.2, "beta": 0.5} if gate == "HardSigmoid" else {})),
             helper.make_node("Mul", ["x", "gs"], ["y"])]
    model = _model(nodes, {"x": x}, ["y"], consts)
    (got,) = _both(model, {"x": x}, spy, "ep_squeeze_excite")
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], **TOL)


# -- fallback ------------------------------------------------------------------------------------------------


def test_float64_and_views_keep_the_numpy_paths(spy):
    rng = np.random.default_rng(12)
    x, scale = rng.standard_normal((4, 16)), rng.standard_normal(16)
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y"])
    model = _model([node], {"x": x}, ["y"], {"scale": scale}, opset=18)
    got = _ephost(model).run(None, {"x": x})[0]
    assert not spy.calls
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-10)


def test_a_missing_or_stale_library_is_not_opened(tmp_path, monkeypatch):
    assert native.load(tmp_path / "nothing.so") is None
    assert native.LOAD_ERROR == (f"{tmp_path / 'nothing.so'} not found (reinstall ephost (`pip install .` compiles "
                                 f"them), or run `ephost build` or `python build.py`)")
    monkeypatch.setattr(native, "source_hash", lambda: "0" * 16)
    assert native.load() is None
    assert "was built from another kernels.c" in native.LOAD_ERROR
    monkeypatch.undo()
    monkeypatch.setattr(native, "SOURCE", tmp_path / "kernels.c")  # an install without the C source
    assert native.load() is None
    assert native.LOAD_ERROR.startswith(f"{tmp_path / 'kernels.c'} cannot be read")
    monkeypatch.undo()
    assert native.load() is not None and native.LOAD_ERROR is None


def test_the_switch_turns_the_library_off():
    code = "from host.cpu_ep import native; print(native.LIB is None, native.LOAD_ERROR)"
    env = dict(os.environ, EPHOST_CPU_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True disabled by EPHOST_CPU_NATIVE=0"


@pytest.mark.parametrize("name", available_models())
def test_real_models_without_the_library_match_onnxruntime(numpy_only, name):
    """The NumPy fallback on every fixture at the default level (test_real_models.py runs them with the library)."""
    import onnxruntime as ort

    path, feeds, _ = load(name)
    so = SessionOptions()
    so.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
    got = InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"]).run(None, feeds)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)
