"""CPU EP kernels added for real exports (indexing, TopK/CumSum, Resize, Einsum, Attention, RMSNormalization,
RotaryEmbedding, the ai.ephost fused ops) against onnx.reference.ReferenceEvaluator, onnxruntime, or NumPy
formulas written out here. The onnx backend node tests (tests/host/test_backend.py) run these ops too.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from host.cpu_ep import create_kernel, supported_ops
from host.cpu_ep.ops_transformer import EPHOST_DOMAIN
from host.errors import KernelError, ModelError
from host.runtime.node import node_info
from host.runtime.session import InferenceSession
from tests.host.test_cpu_ops import SUM_TOL, assert_same, case, f32, i64, ours, reference

rng = np.random.default_rng(23)
ATTN_TOL = {"rtol": 1e-4, "atol": 1e-5}


def idx(*shape, high, low=None):
    """int64 indices in [low, high), negatives included by default (ONNX counts them from the end)."""
    return rng.integers(-high if low is None else low, high, size=shape).astype(np.int64)


def _unique_rows(n, k, dims):
    """n distinct index tuples (k coordinates within dims): ScatterND with reduction 'none' needs them."""
    flat = rng.choice(math.prod(dims[:k]), size=n, replace=False)
    return np.stack(np.unravel_index(flat, dims[:k]), axis=-1).astype(np.int64)


INDEXING = [
    case("GatherElements", {"data": f32(3, 4), "indices": idx(3, 2, high=4)}, axis=1),
    case("GatherElements", {"data": f32(3, 4, 2), "indices": idx(2, 4, 2, high=3)}, axis=0, id="GatherElements-ax0"),
    case("GatherND", {"data": f32(3, 4, 5), "indices": idx(2, 2, high=3, low=0)}),
    case("GatherND", {"data": f32(3, 4, 5), "indices": np.array([[[1, -1]], [[0, 2]]], np.int64)}, id="GatherND-neg"),
    case("GatherND", {"data": f32(2, 4, 5), "indices": idx(2, 3, 1, high=4)}, batch_dims=1, id="GatherND-batch1"),
    case("GatherND", {"data": f32(2, 3, 4, 5), "indices": idx(2, 3, 2, high=4, low=0)}, batch_dims=2,
         id="GatherND-batch2"),
    case("ScatterND", {"data": f32(4, 5), "indices": _unique_rows(3, 2, (4, 5)), "updates": f32(3)}),
    case("ScatterND", {"data": f32(4, 5, 2), "indices": _unique_rows(2, 1, (4,)), "updates": f32(2, 5, 2)},
         id="ScatterND-slices"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[1], [1], [3]], np.int64), "updates": f32(3, 5)},
         reduction="add", id="ScatterND-add-dup"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[1], [1], [3]], np.int64), "updates": f32(3, 5)},
         reduction="mul", id="ScatterND-mul-dup"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[2], [2]], np.int64), "updates": f32(2, 5)},
         reduction="max", id="ScatterND-max"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[0], [0]], np.int64), "updates": f32(2, 5)},
         reduction="min", id="ScatterND-min"),
    case("ScatterElements", {"data": f32(3, 4), "indices": np.array([[1, 0, 3], [2, -1, 0]], np.int64),
                             "updates": f32(2, 3)}, axis=1),
    case("ScatterElements", {"data": f32(3, 4), "indices": np.array([[1, 1], [2, 1]], np.int64), "updates": f32(2, 2)},
         axis=0, reduction="add", id="ScatterElements-add"),
    case("ScatterElements", {"data": f32(3, 4), "indices": np.array([[1, 1], [2, 1]], np.int64), "updates": f32(2, 2)},
         axis=0, reduction="max", id="ScatterElements-max"),
    case("OneHot", {"indices": np.array([[0, 2], [-1, 5]], np.int64), "depth": np.array(4, np.int64),
                    "values": np.array([0.5, 2.0], np.float32)}),
    case("OneHot", {"indices": np.array([[1, 0, 3], [2, -4, 9]], np.int64), "depth": np.array(4, np.int64),
                    "values": np.array([-1, 7], np.float32)}, axis=0, id="OneHot-axis0"),
    case("NonZero", {"x": (f32(3, 4) > 0.5)}),
    case("NonZero", {"x": np.array([[0, 2, 0], [1, 0, 3]], np.int32)}, id="NonZero-int"),
    case("TopK", {"x": f32(3, 6), "k": i64(3)}, n_out=2),
    case("TopK", {"x": np.array([[3, 1, 3, 2, 1, 3]], np.float32), "k": i64(4)}, n_out=2, id="TopK-ties"),
    case("TopK", {"x": np.array([[3, 1, 3, 2, 1, 3]], np.int64), "k": i64(4)}, n_out=2, largest=0,
         id="TopK-smallest-ties"),
    case("TopK", {"x": f32(4, 3, 2), "k": i64(2)}, n_out=2, axis=0, id="TopK-axis0"),
    case("TopK", {"x": f32(3, 6)}, n_out=2, opset=9, k=2, id="TopK-opset9-attr"),
    case("CumSum", {"x": f32(3, 4), "axis": np.array(1, np.int64)}, tol=SUM_TOL),
    case("CumSum", {"x": f32(3, 4), "axis": np.array(0, np.int32)}, exclusive=1, tol=SUM_TOL, id="CumSum-excl"),
    case("CumSum", {"x": f32(3, 4), "axis": np.array(-1, np.int64)}, reverse=1, tol=SUM_TOL, id="CumSum-rev"),
    case("CumSum", {"x": np.arange(12, dtype=np.int64).reshape(3, 4), "axis": np.array(1, np.int64)}, exclusive=1,
         reverse=1, id="CumSum-excl-rev-int"),
]

ELEMENTWISE = [
    case("HardSwish", {"x": f32(3, 5, low=-5, high=5)}),
    case("Mish", {"x": f32(3, 5, low=-10, high=10)}, opset=18),
    case("IsInf", {"x": np.array([1.0, np.inf, -np.inf, np.nan, 0.0], np.float32)}),
    case("IsInf", {"x": np.array([1.0, np.inf, -np.inf, np.nan], np.float32)}, detect_positive=0, id="IsInf-neg"),
    case("IsInf", {"x": np.array([1.0, np.inf, -np.inf, np.nan], np.float32)}, detect_negative=0, id="IsInf-pos"),
    case("Mod", {"a": np.array([-7, 7, -7, 7, 5], np.int64), "b": np.array([3, -3, -3, 3, 5], np.int64)}),
    case("Mod", {"a": np.array([-7, 7, -7, 7], np.int32), "b": np.array([3, -3, -3, 3], np.int32)}, fmod=1,
         id="Mod-fmod-int"),
    case("Mod", {"a": f32(3, 4, low=-9, high=9), "b": f32(4, low=1, high=3)}, fmod=1, id="Mod-fmod-float"),
    # Pow by a scalar 2, 3, 0.5 or 1 takes products / sqrt (ops_elementwise.Pow); 1.5 and a (1, 1) exponent do not.
    case("Pow", {"a": f32(3, 4), "b": np.array(2.0, np.float32)}, id="Pow-square"),
    case("Pow", {"a": f32(3, 4), "b": np.array([3.0], np.float32)}, id="Pow-cube"),
    case("Pow", {"a": f32(3, 4, low=0.1, high=4), "b": np.array(0.5, np.float32)}, id="Pow-sqrt"),
    case("Pow", {"a": f32(3, 4), "b": np.array(1, np.int64)}, id="Pow-one-int"),
    case("Pow", {"a": f32(3, 4, low=0.1, high=4), "b": np.array(1.5, np.float32)}, id="Pow-1.5"),
    case("Pow", {"a": f32(4), "b": np.array([[2.0]], np.float32)}, id="Pow-square-broadcast-up"),
    case("Einsum", {"a": f32(2, 3, 4), "b": f32(2, 4, 5)}, equation="bij,bjk->bik", tol=SUM_TOL),
    case("Einsum", {"a": f32(3, 4)}, equation="ij->ji", id="Einsum-transpose"),
    case("Einsum", {"a": f32(3, 3)}, equation="ii", id="Einsum-trace-implicit"),
    case("Einsum", {"a": f32(2, 3, 4), "b": f32(4, 5), "c": f32(5)}, equation="...j,jk,k->...", tol=SUM_TOL,
         id="Einsum-ellipsis-3"),
]


def _resize(x, scales=None, sizes=None, roi=None, opset=19, **attrs):
    inputs = {"x": x, "roi": roi, "scales": scales, "sizes": sizes}
    tid = "Resize-" + "-".join(f"{k}={v}" for k, v in attrs.items()) + ("-sizes" if sizes is not None else "")
    return case("Resize", inputs, opset=opset, tol=SUM_TOL, id=tid, **attrs)


_IMG = f32(1, 2, 4, 5)
_UP = np.array([1, 1, 2, 1.5], np.float32)
_DOWN = np.array([1, 1, 0.6, 0.8], np.float32)
RESIZE = [
    _resize(_IMG, _UP, mode="nearest"),
    _resize(_IMG, _UP, mode="nearest", nearest_mode="floor", coordinate_transformation_mode="asymmetric"),
    _resize(_IMG, _UP, mode="nearest", nearest_mode="ceil", coordinate_transformation_mode="align_corners"),
    _resize(_IMG, _UP, mode="nearest", nearest_mode="round_prefer_ceil",
            coordinate_transformation_mode="half_pixel"),
    _resize(_IMG, _DOWN, mode="nearest"),
    _resize(_IMG, _UP, mode="linear"),
    _resize(_IMG, _DOWN, mode="linear"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="align_corners"),
    _resize(_IMG, _DOWN, mode="linear", coordinate_transformation_mode="align_corners"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="half_pixel_symmetric"),
    _resize(_IMG, _UP, mode="linear", coordinate_transformation_mode="asymmetric"),
    _resize(_IMG, _UP, mode="cubic"),
    _resize(_IMG, _DOWN, mode="cubic", exclude_outside=1),
    _resize(_IMG, _UP, mode="cubic", cubic_coeff_a=-0.5, coordinate_transformation_mode="asymmetric"),
    _resize(_IMG, sizes=np.array([1, 2, 7, 3], np.int64), mode="linear"),
    _resize(_IMG, sizes=np.array([7, 8], np.int64), mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
    _resize(_IMG, sizes=np.array([7, 8], np.int64), mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_smaller"),
    _resize(f32(1, 1, 9, 11), np.array([1, 1, 0.4, 0.7], np.float32), mode="linear", antialias=1),
    _resize(f32(1, 1, 9, 11), np.array([1, 1, 0.4, 1.5], np.float32), mode="cubic", antialias=1),
    _resize(f32(1, 1, 9, 11), sizes=np.array([1, 1, 3, 4], np.int64), mode="cubic", antialias=1, exclude_outside=1),
    _resize(_IMG, np.array([1, 1, 0.8, 1.2], np.float32), roi=np.array([0, 0, 0.2, 0.1, 1, 1, 1.1, 0.9], np.float32),
            mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-3.0),
]
# Resize-10 takes (X, scales); onnx's reference fails on that form, so only onnxruntime checks it.
RESIZE_10 = case("Resize", {"x": _IMG, "scales": np.array([1, 1, 2, 3], np.float32)}, opset=10, mode="nearest",
                 id="Resize-opset10")

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
# im2col with groups and batches.
CONV_PATHS = [
    case("Conv", {"x": f32(2, 6, 5, 7), "w": f32(4, 6, 1, 1), "b": f32(4)}, tol=SUM_TOL, id="Conv-pointwise"),
    case("Conv", {"x": f32(1, 4, 20, 18), "w": f32(4, 1, 3, 3), "b": f32(4)}, group=4, pads=[1, 1, 1, 1],
         tol=SUM_TOL, id="Conv-depthwise-taps-pixels"),
    case("Conv", {"x": f32(2, 3, 9, 9), "w": f32(6, 1, 5, 5)}, group=3, pads=[2, 1, 2, 1], strides=[2, 1],
         tol=SUM_TOL, id="Conv-depthwise-multiplier2"),
    case("Conv", {"x": f32(1, 5, 6, 6), "w": f32(5, 1, 5, 5)}, group=5, pads=[2, 2, 2, 2], dilations=[1, 2],
         tol=SUM_TOL, id="Conv-depthwise-pixels-taps-dilated"),
    case("Conv", {"x": f32(2, 4, 9, 8), "w": f32(6, 2, 3, 3), "b": f32(6)}, group=2, strides=[2, 2],
         pads=[1, 0, 1, 1], tol=SUM_TOL, id="Conv-im2col-groups-batch2"),
    case("Conv", {"x": f32(1, 3, 16, 16), "w": f32(8, 3, 3, 3)}, strides=[2, 2], auto_pad="SAME_UPPER",
         tol=SUM_TOL, id="Conv-im2col-same-upper"),
]

# Recurrent layers and ConvTranspose (ops_rnn.py, ops_conv_transpose.py); the attribute-by-attribute checks
# against onnxruntime are in test_cpu_rnn.py and test_cpu_conv_transpose.py.
RECURRENT = [
    case("RNN", {"X": f32(3, 2, 4), "W": f32(1, 5, 4), "R": f32(1, 5, 5), "B": f32(1, 10)}, n_out=2, hidden_size=5,
         tol=SUM_TOL),
    case("GRU", {"X": f32(3, 2, 4), "W": f32(2, 9, 4), "R": f32(2, 9, 3), "B": f32(2, 18)}, n_out=2, hidden_size=3,
         direction="bidirectional", tol=SUM_TOL),
    case("LSTM", {"X": f32(3, 2, 4), "W": f32(1, 12, 4), "R": f32(1, 12, 3), "B": f32(1, 24)}, n_out=3,
         hidden_size=3, tol=SUM_TOL),
    # group 1: onnx's reference ConvTranspose fails on groups (test_cpu_conv_transpose.py checks them)
    case("ConvTranspose", {"x": f32(2, 4, 5, 6), "w": f32(4, 3, 3, 2), "b": f32(3)}, strides=[2, 1],
         pads=[1, 0, 0, 1], tol=SUM_TOL),
]

NEW_CASES = INDEXING + ELEMENTWISE + RESIZE + TRANSFORMER + CONV_PATHS + RECURRENT


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), NEW_CASES)
def test_matches_reference(node, feeds, opset, tol):
    want = reference(node, feeds, opset)
    got = ours(node, feeds, opset)
    assert len(got) >= len(want)
    for g, w in zip(got, want):
        assert_same(g, w, tol)


def _ort_single(node, feeds, opset):
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


# onnxruntime as a second reference where its CPU kernels implement the op at that opset.
ORT_CASES = [p for p in INDEXING + ELEMENTWISE + RESIZE
             if p.values[0].op_type not in ("NonZero",) and not p.id.startswith("Resize-")
             or p.id in ("Resize-mode=linear", "Resize-mode=nearest", "Resize-mode=cubic")] + [RESIZE_10]


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), ORT_CASES)
def test_matches_onnxruntime(node, feeds, opset, tol):
    want = _ort_single(node, feeds, opset)
    got = ours(node, feeds, opset)
    for g, w in zip(got, want):
        assert_same(g, w, tol)


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


def test_every_new_op_has_a_case():
    covered = {p.values[0].op_type for p in NEW_CASES} | set(EPHOST_OPS)
    assert {op for domain, op in supported_ops() if domain == EPHOST_DOMAIN} == set(EPHOST_OPS)
    new_ops = {"GatherElements", "GatherND", "ScatterND", "ScatterElements", "OneHot", "NonZero", "TopK", "CumSum",
               "HardSwish", "Mish", "IsInf", "Mod", "Einsum", "Resize", "Attention", "RMSNormalization",
               "RotaryEmbedding", "SkipLayerNormalization", "FusedMatMul", "BiasGelu"}
    registered = {op for _, op in supported_ops()}
    assert new_ops <= registered
    assert new_ops <= covered


# -- errors: bad input names what was expected and what arrived ------------------------------------------------


def test_gather_elements_index_out_of_range():
    node = helper.make_node("GatherElements", ["d", "i"], ["y"], name="ge", axis=1)
    with pytest.raises(KernelError, match=r"^node 'ge' \(GatherElements\) on CPUExecutionProvider failed: index 4 at "
                                          r"position \(0, 1\) is out of range for a dimension of 4$"):
        ours(node, {"d": f32(2, 4), "i": np.array([[0, 4], [1, 1]], np.int64)}, 17)


def test_attention_3d_needs_head_counts():
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], name="att")
    with pytest.raises(KernelError, match=r"^node 'att' \(Attention\) on CPUExecutionProvider failed: 3-D Q of shape "
                                          r"\(1, 2, 8\) needs a head count \(q_num_heads / kv_num_heads\) dividing its "
                                          r"last dimension; got 0$"):
        ours(node, {"q": f32(1, 2, 8), "k": f32(1, 2, 8), "v": f32(1, 2, 8)}, 23)


def test_resize_rejects_an_unknown_mode():
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], name="rs", mode="bilinear")
    with pytest.raises(ModelError, match=r"^node 'rs' \(Resize\): attribute 'mode' is 'bilinear'; allowed: one of "
                                         r"'nearest', 'linear', 'cubic'$"):
        ours(node, {"x": f32(1, 1, 4, 4), "s": np.array([1, 1, 0.5, 0.5], np.float32)}, 19)


def test_topk_k_too_large():
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk")
    with pytest.raises(KernelError, match=r"^node 'tk' \(TopK\) on CPUExecutionProvider failed: k = 7 is outside "
                                          r"\[0, 6\] \(the size of axis 1\)$"):
        ours(node, {"x": f32(2, 6), "k": i64(7)}, 17)


def test_scatternd_reduction_needs_opset_16():
    node = helper.make_node("ScatterND", ["d", "i", "u"], ["y"], name="sc", reduction="add")
    with pytest.raises(ModelError, match=r"^node 'sc' \(ScatterND\): attribute 'reduction' is 'add'; "
                                         r"allowed: one of 'none'$"):
        ours(node, {"d": f32(2), "i": np.array([[0]], np.int64), "u": f32(1)}, 13)


# -- property tests: random shapes against the reference ------------------------------------------------------


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


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(2, 7), st.integers(1, 7), st.sampled_from(["nearest", "linear", "cubic"]),
       st.sampled_from(["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_resize_random(h, w, out_h, mode, coord, antialias, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((1, 1, h, w)).astype(np.float32)
    sizes = np.array([1, 1, out_h, int(r.integers(1, 9))], np.int64)
    extra = {"antialias": 1} if antialias and mode != "nearest" else {}
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="rs", mode=mode,
                            coordinate_transformation_mode=coord, **extra)
    feeds = {"x": x, "sizes": sizes}
    (want,) = reference(node, feeds, 19)
    (got,) = ours(node, feeds, 19)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_gather_scatter_nd_random(b, n, m, batch_dims, seed):
    r = np.random.default_rng(seed)
    data = r.standard_normal((b, n, m, 2)).astype(np.float32)
    k = int(r.integers(1, 4 - batch_dims))
    dims = data.shape[batch_dims:batch_dims + k]
    indices = np.stack([r.integers(-d, d, size=(*data.shape[:batch_dims], 3)) for d in dims], axis=-1)
    node = helper.make_node("GatherND", ["d", "i"], ["y"], name="g", batch_dims=batch_dims)
    feeds = {"d": data, "i": indices.astype(np.int64)}
    assert_same(ours(node, feeds, 13)[0], reference(node, feeds, 13)[0], {})
    upd_shape = (5, *data.shape[k:])
    idx = np.stack([r.integers(0, d, size=5) for d in data.shape[:k]], axis=-1).astype(np.int64)
    node = helper.make_node("ScatterND", ["d", "i", "u"], ["y"], name="s", reduction="add")
    feeds = {"d": data, "i": idx, "u": r.standard_normal(upd_shape).astype(np.float32)}
    assert_same(ours(node, feeds, 18)[0], reference(node, feeds, 18)[0], SUM_TOL)
