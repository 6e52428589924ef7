"""Col2Im, AffineGrid, DeformConv and MelWeightMatrix on the CPU EP against onnxruntime's CPU EP, beyond
the few cases of onnx's backend suite (tests/host/test_backend.py): strides, pads, dilations, groups,
offset groups, N-D and odd sizes, and their typed errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from host.errors import InvalidArgument
from host.runtime.session import InferenceSession

rng = np.random.default_rng(26)
FLOAT = TensorProto.FLOAT


# Output ranks: the checker wants a shape (symbolic dims do) on the graph output.
RANKS = {"Col2Im": lambda f: 2 + f["image"].size, "AffineGrid": lambda f: f["size"].size,
         "DeformConv": lambda f: f["x"].ndim, "MelWeightMatrix": lambda f: 2}


def _model(op, names, feeds, opset, **attrs):
    node = helper.make_node(op, names, ["y"], name="n", **attrs)
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    out_type = attrs.get("output_datatype", helper.np_dtype_to_tensor_dtype(next(iter(feeds.values())).dtype))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", out_type, [f"d{i}" for i in range(RANKS[op](feeds))])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _both(op, feeds, opset, names=None, by_onnx=False, **attrs):
    """(ephost's output, onnxruntime's output) of a one-node model; onnx's ReferenceEvaluator's with by_onnx
    (types onnxruntime has no kernel for)."""
    model = _model(op, names or list(feeds), feeds, opset, **attrs)
    (got,) = InferenceSession(model).run(None, feeds)
    if by_onnx:
        (want,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)
    else:
        (want,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    return got, want


def _ephost(op, feeds, opset, names=None, **attrs):
    return InferenceSession(_model(op, names or list(feeds), feeds, opset, **attrs)).run(None, feeds)[0]


# ---- Col2Im --------------------------------------------------------------------------------------------------
def _blocks(image, block, strides, dilations, pads):
    nd = len(image)
    return [(image[i] + pads[i] + pads[i + nd] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
            for i in range(nd)]


@pytest.mark.parametrize(("image", "block", "strides", "dilations", "pads", "dtype"), [
    ([7, 6], [3, 2], [2, 1], [1, 2], [1, 0, 2, 1], np.float32),
    ([5, 8], [2, 3], [1, 3], [2, 1], [0, 2, 1, 0], np.float64),
    ([9], [4], [2], [2], [1, 2], np.float32),
    ([4, 5, 3], [2, 2, 2], [1, 2, 1], [1, 1, 2], [1, 0, 1, 0, 1, 1], np.float32),
    ([6, 6], [3, 3], [3, 3], [1, 1], [0, 0, 0, 0], np.int32),
])
def test_col2im_matches_onnxruntime(image, block, strides, dilations, pads, dtype):
    n_blocks = int(np.prod(_blocks(image, block, strides, dilations, pads)))
    data = rng.uniform(-3, 3, (2, 3 * int(np.prod(block)), n_blocks)).astype(dtype)
    feeds = {"x": data, "image": np.array(image, np.int64), "block": np.array(block, np.int64)}
    # onnxruntime's Col2Im takes float only, and outside 2-D it ignores dilations (onnxruntime 1.32: its 1-D and
    # 3-D results with dilations differ from onnx's reference, which ephost's match; its 2-D ones agree).
    by_onnx = dtype != np.float32 or (len(image) != 2 and max(dilations) > 1)
    got, want = _both("Col2Im", feeds, 18, by_onnx=by_onnx, strides=strides, dilations=dilations, pads=pads)
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 3, *image)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_col2im_wrong_block_count_is_invalid_argument():
    feeds = {"x": np.zeros((1, 4, 5), np.float32), "image": np.array([3, 3], np.int64),
             "block": np.array([2, 2], np.int64)}
    with pytest.raises(InvalidArgument, match=r"^Col2Im: input must have shape \(N, C \* 4 \(the block size\), 4 "
                                              r"\(the block positions \[2, 2\]\)\); got \[1, 4, 5\]$"):
        _ephost("Col2Im", feeds, 18)


# ---- AffineGrid ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize(("size", "dtype"), [
    ([2, 3, 5, 4], np.float32), ([2, 1, 1, 3], np.float32), ([2, 1, 1, 1], np.float64),
    ([2, 2, 3, 1, 4], np.float32), ([2, 1, 2, 5, 3], np.float64),
])
def test_affine_grid_matches_onnxruntime(size, dtype, align_corners):
    nd = len(size) - 2
    feeds = {"theta": rng.standard_normal((2, nd, nd + 1)).astype(dtype), "size": np.array(size, np.int64)}
    got, want = _both("AffineGrid", feeds, 20, align_corners=align_corners)
    assert got.dtype == want.dtype and got.shape == want.shape == (2, *size[2:], nd)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_affine_grid_size_of_the_wrong_rank_is_invalid_argument():
    feeds = {"theta": np.zeros((2, 2, 3), np.float32), "size": np.array([2, 1, 4, 4, 4], np.int64)}
    with pytest.raises(InvalidArgument, match=r"^AffineGrid: size must be \(N, C, H, W\) with N = 2 \(theta's batch\) "
                                              r"and sizes >= 0 for theta of shape \[2, 2, 3\]; got \[2, 1, 4, 4, 4\]$"):
        _ephost("AffineGrid", feeds, 20)


# ---- DeformConv ----------------------------------------------------------------------------------------------
def _deform_feeds(n, c, m, spatial, kernel, group, offset_group, strides, dilations, pads, bias, mask, scale):
    nd = len(spatial)
    out = _blocks(spatial, kernel, strides, dilations, pads)
    taps = offset_group * int(np.prod(kernel))
    feeds = {"x": rng.standard_normal((n, c, *spatial)).astype(np.float32),
             "w": rng.standard_normal((m, c // group, *kernel)).astype(np.float32),
             "offset": (scale * rng.standard_normal((n, taps * nd, *out))).astype(np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(m).astype(np.float32)
    if mask:
        feeds["mask"] = rng.uniform(0, 1, (n, taps, *out)).astype(np.float32)
    names = ["x", "w", "offset", "b" if bias else "", "mask" if mask else ""]
    while not names[-1]:
        names.pop()
    attrs = {"kernel_shape": kernel, "group": group, "offset_group": offset_group, "strides": strides,
             "dilations": dilations, "pads": pads}
    return feeds, names, attrs


@pytest.mark.parametrize(("n", "c", "m", "spatial", "kernel", "group", "offset_group", "strides", "dilations",
                          "pads", "bias", "mask", "scale"), [
    (2, 4, 6, [7, 6], [3, 2], 2, 2, [2, 1], [1, 2], [1, 0, 2, 1], True, True, 2.0),
    (1, 6, 4, [5, 5], [3, 3], 2, 3, [1, 1], [1, 1], [1, 1, 1, 1], False, True, 1.0),
    (2, 4, 4, [6, 5], [2, 2], 4, 1, [1, 2], [2, 1], [0, 1, 1, 0], True, False, 5.0),  # depthwise, far offsets
    (1, 3, 2, [4, 4], [1, 1], 1, 1, [1, 1], [1, 1], [0, 0, 0, 0], False, False, 0.5),
])
def test_deform_conv_matches_onnxruntime(n, c, m, spatial, kernel, group, offset_group, strides, dilations, pads,
                                         bias, mask, scale):
    feeds, names, attrs = _deform_feeds(n, c, m, spatial, kernel, group, offset_group, strides, dilations, pads,
                                        bias, mask, scale)
    got, want = _both("DeformConv", feeds, 22, names=names, **attrs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_deform_conv_1d_is_the_2d_case_of_height_one():
    # onnxruntime takes 4-D X only: a 1-D convolution must equal the 2-D one over a single row whose taps
    # move only along the width (their height offsets are 0).
    feeds, names, attrs = _deform_feeds(2, 4, 6, [9], [3], 2, 2, [2], [1], [1, 2], True, True, 2.0)
    got = _ephost("DeformConv", feeds, 22, names=names, **attrs)
    off = feeds["offset"]  # (N, taps * 1, W_out): per tap its width offset
    off2 = np.stack([np.zeros_like(off), off], axis=2).reshape(off.shape[0], -1, 1, off.shape[-1])
    feeds2 = {"x": feeds["x"][:, :, None], "w": feeds["w"][:, :, None], "offset": off2, "b": feeds["b"],
              "mask": feeds["mask"][:, :, None]}
    attrs2 = {"kernel_shape": [1, 3], "group": 2, "offset_group": 2, "strides": [1, 2], "dilations": [1, 1],
              "pads": [0, 1, 0, 2]}
    _, want = _both("DeformConv", feeds2, 22, names=names, **attrs2)
    np.testing.assert_allclose(got, want[:, :, 0], rtol=1e-5, atol=1e-5)


def test_deform_conv_offset_of_the_wrong_shape_is_invalid_argument():
    feeds, names, attrs = _deform_feeds(1, 2, 2, [4, 4], [2, 2], 1, 1, [1, 1], [1, 1], [0, 0, 0, 0], False, False, 1)
    feeds["offset"] = feeds["offset"][:, :4]
    with pytest.raises(InvalidArgument, match=r"^DeformConv: offset must have shape \[1, 8, 3, 3\] \(N, offset_group "
                                              r"\* prod\(kernel\) \* 2, \*output\) for X \[1, 2, 4, 4\] and kernel "
                                              r"\[2, 2\]; got \[1, 4, 3, 3\]$"):
        _ephost("DeformConv", feeds, 22, names=names, **attrs)


# ---- MelWeightMatrix -----------------------------------------------------------------------------------------
def _mel_feeds(mels, dft, rate, low, high):
    feeds = {"mels": mels, "dft": dft, "rate": rate}
    feeds = {k: np.array(v, np.int64) for k, v in feeds.items()}
    return feeds | {"low": np.array(low, np.float32), "high": np.array(high, np.float32)}


@pytest.mark.parametrize(("mels", "dft", "rate", "low", "high", "out_type"), [
    (40, 512, 16000, 20.0, 8000.0, TensorProto.FLOAT),
    (80, 400, 16000, 0.0, 8000.0, TensorProto.DOUBLE),
    (10, 64, 22050, 300.0, 4000.0, TensorProto.FLOAT),
    (3, 8, 100, 10.0, 50.0, TensorProto.FLOAT16),  # narrow bands: zero-width rising edges
])
def test_mel_weight_matrix_matches_onnxruntime(mels, dft, rate, low, high, out_type):
    # onnxruntime makes no float16 matrix.
    got, want = _both("MelWeightMatrix", _mel_feeds(mels, dft, rate, low, high), 17,
                      by_onnx=out_type == TensorProto.FLOAT16, output_datatype=out_type)
    assert got.dtype == want.dtype and got.shape == want.shape == (dft // 2 + 1, mels)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_mel_weight_matrix_past_nyquist_is_invalid_argument():
    with pytest.raises(InvalidArgument, match=r"^MelWeightMatrix: upper_edge_hertz 8192\.0 maps to spectrogram bin "
                                              r"12, past the last of the 9 bins of dft_length 16 at sample_rate 8192 "
                                              r"\(allowed: up to about sample_rate / 2\)$"):
        _ephost("MelWeightMatrix", _mel_feeds(8, 16, 8192, 0.0, 8192.0), 17)
