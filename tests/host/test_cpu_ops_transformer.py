"""CPU EP transformer kernels (Attention, RMSNormalization, RotaryEmbedding) against
onnx.reference.ReferenceEvaluator, and the ai.ephost fused ops (SkipLayerNormalization, FusedMatMul, BiasGelu)
against their definitions written in NumPy; typed errors; random attention shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from host.cpu_ep import create_kernel, supported_ops
from host.cpu_ep.ops_transformer import EPHOST_DOMAIN
from host.errors import KernelError, ModelError
from host.runtime.node import node_info
from host.runtime.session import InferenceSession
from tests.host.test_cpu_ops import (
    SUM_TOL,
    case,
    check_reference,
    f32,
    idx,
    ours,
    reference,
    rng,
)

ATTN_TOL = {"rtol": 1e-4, "atol": 1e-5}

_S, _T = 5, 7  # query and key lengths
TRANSFORMER = [
    case("Attention", {"q": f32(2, 4, _S, 8), "k": f32(2, 4, _T, 8), "v": f32(2, 4, _T, 6)}, opset=23, tol=ATTN_TOL),
    case("Attention", {"q": f32(2, 4, _S, 8), "k": f32(2, 2, _T, 8), "v": f32(2, 2, _T, 8)}, opset=23, tol=ATTN_TOL,
         id="Attention-gqa"),
    case("Attention", {"q": f32(2, 4, _S, 8), "k": f32(2, 2, _S, 8), "v": f32(2, 2, _S, 8)}, opset=23, tol=ATTN_TOL,
         is_causal=1, id="Attention-gqa-causal"),
    case("Attention", {"q": f32(2, _S, 32), "k": f32(2, _T, 16), "v": f32(2, _T, 16)}, opset=23, tol=ATTN_TOL,
         q_num_heads=4, kv_num_heads=2, id="Attention-3d-gqa"),
    case("Attention", {"q": f32(1, 2, _S, 8), "k": f32(1, 2, _T, 8), "v": f32(1, 2, _T, 8),
                       "mask": rng.integers(0, 2, (_S, _T)).astype(bool) | np.eye(_S, _T, dtype=bool)},
         opset=23, tol=ATTN_TOL, id="Attention-boolmask"),
    case("Attention", {"q": f32(1, 2, _S, 8), "k": f32(1, 2, _T, 8), "v": f32(1, 2, _T, 8),
                       "mask": f32(1, 1, _S, _T)}, opset=23, tol=ATTN_TOL, scale=0.3, id="Attention-floatmask-scale"),
    case("Attention", {"q": f32(1, 2, _S, 8), "k": f32(1, 2, _T, 8), "v": f32(1, 2, _T, 8),
                       "mask": np.array([[True, True, False, True]])}, opset=23, tol=ATTN_TOL, id="Attention-shortmask"),
    case("Attention", {"q": f32(1, 2, 1, 8), "k": f32(1, 2, 1, 8), "v": f32(1, 2, 1, 8), "mask": None,
                       "past_key": f32(1, 2, 4, 8), "past_value": f32(1, 2, 4, 8)}, n_out=3, opset=23, tol=ATTN_TOL,
         is_causal=1, id="Attention-past-causal"),
    case("Attention", {"q": f32(1, 2, _S, 8), "k": f32(1, 2, _T, 8), "v": f32(1, 2, _T, 8)}, n_out=4, opset=23,
         tol=ATTN_TOL, softcap=2.0, qk_matmul_output_mode=3, id="Attention-softcap-mode3"),
    case("Attention", {"q": f32(1, 2, _S, 8), "k": f32(1, 2, _T, 8), "v": f32(1, 2, _T, 8), "mask": f32(_S, _T),
                       "past_key": None, "past_value": None}, n_out=4, opset=23, tol=ATTN_TOL,
         qk_matmul_output_mode=2, id="Attention-mode2"),
    case("RMSNormalization", {"x": f32(2, 3, 8), "scale": f32(8)}, opset=23, tol=SUM_TOL),
    case("RMSNormalization", {"x": f32(2, 3, 8), "scale": f32(3, 8)}, opset=23, axis=-2, epsilon=1e-3,
         tol=SUM_TOL, id="RMSNormalization-axis"),
    case("RotaryEmbedding", {"x": f32(2, 3, 4, 8), "cos": f32(10, 4), "sin": f32(10, 4),
                             "pos": idx(2, 4, high=10, low=0)}, opset=23),
    case("RotaryEmbedding", {"x": f32(2, 4, 12), "cos": f32(10, 2), "sin": f32(10, 2),
                             "pos": idx(2, 4, high=10, low=0)}, opset=23, num_heads=3, rotary_embedding_dim=4,
         interleaved=1, id="RotaryEmbedding-3d-partial-interleaved"),
    case("RotaryEmbedding", {"x": f32(2, 3, 4, 8), "cos": f32(2, 4, 4), "sin": f32(2, 4, 4)}, opset=23,
         id="RotaryEmbedding-no-position-ids"),
]

# Conv's fast paths (ops_nn.Conv._plan): pointwise, depthwise with the (taps, pixels) or the (pixels, taps) copy,

CASES = TRANSFORMER


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), CASES)
def test_matches_reference(node, feeds, opset, tol):
    check_reference(node, feeds, opset, tol)


# -- the ai.ephost fused ops, against their definitions written in NumPy ------------------------------------


def _ephost(op, feeds, n_out=1, **attrs):
    node = helper.make_node(op, list(feeds), [f"y{i}" for i in range(n_out)], name=op, domain=EPHOST_DOMAIN, **attrs)
    return create_kernel(node_info(node, 1)).run(*feeds.values())


def _layer_norm(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def _gelu(x, tanh):
    if tanh:
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_layer_normalization(with_bias):
    x, skip, scale, bias = f32(2, 3, 8), f32(2, 3, 8), f32(8), f32(8)
    feeds = {"x": x, "skip": skip, "scale": scale} | ({"bias": bias} if with_bias else {})
    y, s = _ephost("SkipLayerNormalization", feeds, n_out=2, epsilon=1e-3)
    want = _layer_norm((x + skip).astype(np.float64), scale, bias if with_bias else 0, 1e-3)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s, x + skip)
    assert y.dtype == np.float32


@pytest.mark.parametrize("activation", ["", "Relu", "Gelu", "GeluTanh"])
def test_fused_matmul(activation):
    a, b, bias = f32(2, 3, 4), f32(4, 5), f32(5)
    (y,) = _ephost("FusedMatMul", {"a": a, "b": b, "bias": bias}, activation=activation)
    z = a.astype(np.float64) @ b + bias
    want = {"": z, "Relu": np.maximum(z, 0), "Gelu": _gelu(z, False), "GeluTanh": _gelu(z, True)}[activation]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(approximate):
    x, bias = f32(3, 6), f32(6)
    (y,) = _ephost("BiasGelu", {"x": x, "bias": bias}, approximate=approximate)
    np.testing.assert_allclose(y, _gelu((x + bias).astype(np.float64), approximate == "tanh"), rtol=1e-5, atol=1e-6)


def test_fused_matmul_rejects_unknown_activation():
    with pytest.raises(ModelError, match=r"^node 'FusedMatMul' \(FusedMatMul\): attribute 'activation' is 'Tanh'; "
                                         r"allowed: one of '', 'Relu', 'Gelu', 'GeluTanh'$"):
        _ephost("FusedMatMul", {"a": f32(2, 2), "b": f32(2, 2)}, activation="Tanh")


def test_ephost_ops_run_in_a_session():
    """The session accepts the ai.ephost domain and places its nodes on the CPU EP."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], f32(4, 3).ravel())
    node = helper.make_node("FusedMatMul", ["x", "w"], ["y"], name="fm", domain=EPHOST_DOMAIN, activation="Relu")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [w]), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(EPHOST_DOMAIN, 1)])
    sess = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    xv = f32(2, 4)
    (got,) = sess.run(None, {"x": xv})
    wv = np.frombuffer(w.raw_data, np.float32).reshape(4, 3) if w.raw_data else np.array(w.float_data,
                                                                                          np.float32).reshape(4, 3)
    np.testing.assert_allclose(got, np.maximum(xv @ wv, 0), rtol=1e-5, atol=1e-6)
    assert sess.node_assignment() == {"fm": "CPUExecutionProvider"}


EPHOST_OPS = ("SkipLayerNormalization", "FusedMatMul", "BiasGelu")  # each has a test_<name> above



def test_the_ephost_domain_holds_exactly_the_fused_ops_tested_here():
    assert {op for domain, op in supported_ops() if domain == EPHOST_DOMAIN} == set(EPHOST_OPS)


def test_attention_3d_needs_head_counts():
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], name="att")
    with pytest.raises(KernelError, match=r"^node 'att' \(Attention\) on CPUExecutionProvider failed: 3-D Q of shape "
                                          r"\(1, 2, 8\) needs a head count \(q_num_heads / kv_num_heads\) dividing its "
                                          r"last dimension; got 0$"):
        ours(node, {"q": f32(1, 2, 8), "k": f32(1, 2, 8), "v": f32(1, 2, 8)}, 23)



# -- random shapes against the reference ---------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(1, 6), st.booleans(), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_attention_random(batch, kv_heads, s, t, causal, masked, seed):
    r = np.random.default_rng(seed)
    heads = kv_heads * int(r.integers(1, 3))
    q = r.standard_normal((batch, heads, s, 4)).astype(np.float32)
    k = r.standard_normal((batch, kv_heads, t, 4)).astype(np.float32)
    v = r.standard_normal((batch, kv_heads, t, 3)).astype(np.float32)
    feeds = {"q": q, "k": k, "v": v}
    if masked:
        feeds["mask"] = r.integers(0, 2, (s, t)).astype(bool)
    node = helper.make_node("Attention", list(feeds), ["y"], name="att", is_causal=int(causal))
    (want,) = reference(node, feeds, 23)
    (got,) = ours(node, feeds, 23)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


