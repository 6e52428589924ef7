"""CPU EP kernels GridSample, NonMaxSuppression, Unique, and the opset 24..27 ops (Swish, TensorScatter,
CausalConvWithState, Attention-24/25's external cache and sliding window) against onnxruntime, on random
cases the onnx backend node tests (tests/host/test_backend.py) do not hold. Kernels are built directly
(create_kernel) so the ops of opsets past the session's window are checked too."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from host.cpu_ep import create_kernel
from host.errors import InvalidArgument, KernelError
from host.runtime.node import node_info

rng = np.random.default_rng(26)
# The ops this module checks against onnxruntime (test_cpu_ops.py's every-op check reads it).
TESTED_OPS = {"GridSample", "NonMaxSuppression", "Unique", "Swish", "TensorScatter", "CausalConvWithState",
              "LinearAttention"}


def f32(*shape, low=-1.0, high=1.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def _ort(node, feeds: dict, opset: int) -> list[np.ndarray]:
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _ours(node, feeds: dict, opset: int) -> tuple[np.ndarray, ...]:
    kernel = create_kernel(node_info(node, opset))
    return kernel.run(*[feeds[name] if name else None for name in node.input])


def _check(node, feeds, opset, rtol=1e-5, atol=1e-5):
    ours, theirs = _ours(node, feeds, opset), _ort(node, feeds, opset)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# ---- GridSample --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_gridsample_2d(mode, padding, align):
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding, align_corners=align)
    # The grid reaches past [-1, 1] so that every padding rule is exercised.
    _check(node, {"x": f32(2, 3, 5, 4), "grid": f32(2, 6, 7, 2, low=-1.6, high=1.6)}, 20, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_gridsample_3d(mode, padding):
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding)
    _check(node, {"x": f32(1, 2, 3, 4, 5), "grid": f32(1, 2, 3, 4, 3, low=-1.4, high=1.4)}, 20, rtol=1e-4)


def test_gridsample_opset16_names_and_bad_grid():
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode="bicubic", padding_mode="border")
    _check(node, {"x": f32(1, 2, 4, 4), "grid": f32(1, 3, 3, 2, low=-1.2, high=1.2)}, 16, rtol=1e-4)
    with pytest.raises(InvalidArgument, match=r"^GridSample's grid must have shape \(N=1, \*out \(2 dims\), 2\)"):
        _ours(node, {"x": f32(1, 2, 4, 4), "grid": f32(1, 3, 3, 3)}, 16)


# ---- NonMaxSuppression ---------------------------------------------------------------------------------
def _boxes(batch, n):
    corner = rng.uniform(0, 10, size=(batch, n, 2))
    size = rng.uniform(0.5, 4, size=(batch, n, 2))
    return np.concatenate([corner, corner + size], axis=-1).astype(np.float32)


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("score_threshold", [None, 0.3])
def test_nonmaxsuppression_random(center, score_threshold):
    names = ["boxes", "scores", "max", "iou", "st"][:4 + (score_threshold is not None)]
    node = helper.make_node("NonMaxSuppression", names, ["sel"], center_point_box=center)
    scores = rng.uniform(0, 1, size=(2, 3, 40)).astype(np.float32)
    scores[0, 0, 5:9] = 0.5  # ties: the lower box index first
    feeds = {"boxes": _boxes(2, 40), "scores": scores, "max": np.array([7], np.int64),
             "iou": np.array([0.2], np.float32)}
    if score_threshold is not None:
        feeds["st"] = np.array([score_threshold], np.float32)
    _check(node, feeds, 11)


def test_nonmaxsuppression_without_limit_selects_nothing():
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["sel"])
    feeds = {"boxes": _boxes(1, 5), "scores": rng.uniform(size=(1, 1, 5)).astype(np.float32)}
    _check(node, feeds, 11)


# ---- Unique --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_unique_random(sorted_, axis):
    attrs = {"sorted": sorted_} if axis is None else {"sorted": sorted_, "axis": axis}
    node = helper.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], **attrs)
    x = rng.integers(0, 3, size=(6, 4)).astype(np.float32)
    x[3] = x[1]  # a repeated row for the axis cases
    _check(node, {"x": x}, 11)


# ---- opsets 24..27 ---------------------------------------------------------------------------------------
def test_swish():
    _check(helper.make_node("Swish", ["x"], ["y"], alpha=0.7), {"x": f32(3, 5, low=-6, high=6)}, 24)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensorscatter(mode):
    node = helper.make_node("TensorScatter", ["cache", "update", "where"], ["present"], mode=mode, axis=2)
    starts = np.array([0, 5, 3], np.int64) if mode == "circular" else np.array([0, 3, 1], np.int64)
    _check(node, {"cache": f32(3, 2, 7, 4), "update": f32(3, 2, 3, 4), "where": starts}, 24)


def test_tensorscatter_linear_overflow_is_an_error():
    node = helper.make_node("TensorScatter", ["cache", "update", "where"], ["present"])
    with pytest.raises(InvalidArgument, match=r"^TensorScatter: write_indices \[5\] plus 3 updates leave"):
        _ours(node, {"cache": f32(1, 6, 2), "update": f32(1, 3, 2), "where": np.array([5], np.int64)}, 24)


@pytest.mark.parametrize("with_past", [False, True])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_conv_with_state(with_past, activation):
    names = ["x", "w", "b", "past"] if with_past else ["x", "w", "b"]
    node = helper.make_node("CausalConvWithState", names, ["y", "present"], activation=activation)
    feeds = {"x": f32(2, 3, 6), "w": f32(3, 1, 4), "b": f32(3)}
    if with_past:
        feeds["past"] = f32(2, 3, 3)
    _check(node, feeds, 27)


@pytest.mark.parametrize("causal", [0, 1])
def test_attention24_external_cache(causal):
    node = helper.make_node("Attention", ["q", "k", "v", "mask", "", "", "nonpad"], ["y"], is_causal=causal)
    feeds = {"q": f32(2, 4, 3, 8), "k": f32(2, 2, 9, 8), "v": f32(2, 2, 9, 8),
             "mask": rng.integers(0, 2, size=(3, 9)).astype(bool) | (np.arange(9) < 2),
             "nonpad": np.array([5, 9], np.int64)}
    _check(node, feeds, 24)


@pytest.mark.parametrize("left, right, causal", [(2, -1, 1), (1, 1, 0), (-1, 0, 0), (0, 2, 0)])
def test_attention25_sliding_window(left, right, causal):
    node = helper.make_node("Attention", ["q", "k", "v"], ["y", "present_k", "present_v", "qk"],
                            left_window_size=left, right_window_size=right, is_causal=causal,
                            q_num_heads=4, kv_num_heads=2, qk_matmul_output_mode=3)
    _check(node, {"q": f32(2, 5, 32), "k": f32(2, 5, 16), "v": f32(2, 5, 16)}, 25)


def test_attention_external_cache_with_past_is_an_error():
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv", "nonpad"], ["y"])
    feeds = {"q": f32(1, 1, 2, 4), "k": f32(1, 1, 2, 4), "v": f32(1, 1, 2, 4), "pk": f32(1, 1, 3, 4),
             "pv": f32(1, 1, 3, 4), "nonpad": np.array([4], np.int64)}
    with pytest.raises(KernelError, match=r"^node '.*' \(Attention\) on CPUExecutionProvider failed: "
                                          r"nonpad_kv_seqlen \(an external cache\) cannot be combined"):
        _ours(node, feeds, 24)


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention_gqa_with_past(rule):
    names = ["q", "k", "v", "past", "decay" if "gated" in rule else "", "beta" if "delta" in rule else ""]
    while not names[-1]:
        names.pop()
    node = helper.make_node("LinearAttention", names, ["y", "present"], update_rule=rule, q_num_heads=4,
                            kv_num_heads=2)
    feeds = {"q": f32(2, 5, 4 * 3), "k": f32(2, 5, 2 * 3), "v": f32(2, 5, 2 * 6), "past": f32(2, 2, 3, 6)}
    if "gated" in rule:
        feeds["decay"] = f32(2, 5, 2 * 3, low=-0.5, high=0.0)  # per head and key dimension
    if "delta" in rule:
        feeds["beta"] = f32(2, 5, 2, low=0.0, high=1.0)
    _check(node, feeds, 27)
