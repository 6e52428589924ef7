"""ConvTranspose on the CPU EP against onnxruntime's CPU kernel: 1-D/2-D/3-D, groups, strides, dilations,
pads, output_padding, output_shape, every auto_pad, bias, float16/float64; onnx's backend node tests of the
op; the errors onnxruntime also raises (an output the matching Conv would not map back onto the input)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import helper

import host
from host.errors import KernelError, ModelError


def make_case(rng, nd=2, n=2, c=4, mg=3, group=1, size=5, kernel=3, bias=True, dtype=np.float32, **attrs):
    """(model, feeds): one ConvTranspose over random X (n, c, size+i...) and W (c, mg, kernel...)."""
    kernel = kernel if isinstance(kernel, list) else [kernel - i % 2 for i in range(nd)]
    xs, ws = [n, c, *[size + i for i in range(nd)]], [c, mg, *kernel]
    if group > 1:
        attrs["group"] = group
    feeds = {"x": rng.standard_normal(xs).astype(dtype), "w": rng.standard_normal(ws).astype(dtype)}
    if bias:
        feeds["b"] = rng.standard_normal(mg * group).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("ConvTranspose", list(feeds), ["y"], name="ct", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, elem, v.shape) for k, v in feeds.items()],
                              [helper.make_tensor_value_info("y", elem, [None] * (nd + 2))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)]), feeds


def assert_match(model, feeds, rtol=1e-4, atol=1e-4):
    ours = host.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=atol)


def _cases():
    for nd in (1, 2, 3):
        s = [2] * nd
        yield nd, {}
        yield nd, dict(strides=s)
        yield nd, dict(strides=s, kernel=2, bias=False)  # taps that do not overlap: the transpose path
        yield nd, dict(strides=[3] * nd, kernel=[3] * nd)
        yield nd, dict(strides=s, dilations=s)
        yield nd, dict(strides=s, pads=[1] * nd + [2] * nd)
        yield nd, dict(strides=s, output_padding=[1] * nd)
        yield nd, dict(strides=s, output_shape=[12 + i for i in range(nd)])  # one cell past the natural size
        yield nd, dict(strides=s, output_shape=[9 + i for i in range(nd)], output_padding=[1] * nd)
        for auto_pad in ("SAME_UPPER", "SAME_LOWER", "VALID"):
            yield nd, dict(strides=s, auto_pad=auto_pad)
            yield nd, dict(strides=[3] * nd, kernel=2, auto_pad=auto_pad)
            yield nd, dict(strides=s, auto_pad=auto_pad, output_shape=[9 + i for i in range(nd)])
        yield nd, dict(strides=s, group=2)
        yield nd, dict(strides=s, kernel=2, group=4, mg=1)  # depthwise
        yield nd, dict(kernel_shape=[3, 2, 3][:nd], bias=False)
        yield nd, dict(n=1, c=6, group=3, mg=2, strides=[3, 2, 3][:nd], dilations=[2, 1, 2][:nd],
                       pads=[0, 1, 2][:nd] + [2, 0, 1][:nd], output_padding=[1, 1, 0][:nd])


CASES = list(_cases())


@pytest.mark.parametrize("nd,kw", CASES, ids=[f"{nd}d-" + "-".join(f"{k}={v}" for k, v in kw.items()) for nd, kw in CASES])
def test_matches_onnxruntime(nd, kw):
    assert_match(*make_case(np.random.default_rng(len(kw)), nd=nd, **kw))


@given(nd=st.integers(1, 3), group=st.sampled_from([1, 2]), stride=st.integers(1, 3), kernel=st.integers(1, 3),
       dilation=st.integers(1, 2), pad=st.integers(0, 1), adj=st.booleans(), size=st.integers(1, 4),
       seed=st.integers(0, 99))
def test_random_geometry_matches_onnxruntime(nd, group, stride, kernel, dilation, pad, adj, size, seed):
    attrs = dict(strides=[stride] * nd, dilations=[dilation] * nd, pads=[pad] * nd + [0] * nd)
    if adj and stride > 1:
        attrs["output_padding"] = [stride - 1] * nd
    if (size - 1) * stride + (kernel - 1) * dilation + 1 - pad <= 0:
        return  # no output cell: onnxruntime refuses, as ephost does
    assert_match(*make_case(np.random.default_rng(seed), nd=nd, n=1, c=2 * group, mg=2, group=group, size=size,
                            kernel=[kernel] * nd, **attrs))


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-9), (np.float16, 1e-2)])
def test_float64_and_float16(dtype, tol):
    """float64 in float64, float16 through float32; onnxruntime runs the float32 model as the reference."""
    model, feeds = make_case(np.random.default_rng(1), dtype=dtype, strides=[2, 2], pads=[1, 0, 0, 1])
    ours = host.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    model32, _ = make_case(np.random.default_rng(1), strides=[2, 2], pads=[1, 0, 0, 1])
    feeds32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    ref = ort.InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds32)[0]
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours.astype(np.float32), ref, rtol=max(tol, 1e-5), atol=max(tol, 1e-5))


# onnx's backend node tests of these ops run in tests/host/test_backend.py (the whole suite).


# ---- errors ----------------------------------------------------------------------------------------------
def _run(**kw):
    model, feeds = make_case(np.random.default_rng(2), **kw)
    return host.InferenceSession(model.SerializeToString()).run(None, feeds)


def test_output_padding_must_stay_below_the_stride():
    """onnxruntime: "output_padding (1) may be too large for stride (1)"; the spec bounds it by
    max(stride, dilation), which a dilation alone does not make consistent."""
    with pytest.raises(KernelError, match=r"^node 'ct' \(ConvTranspose\) on CPUExecutionProvider failed: spatial "
                                          r"axis 0: an output of 10 cells does not fit the input's 5 \(a Conv of it "
                                          r"gives 6; .*output_padding 1\)"):
        _run(nd=1, dilations=[2], output_padding=[1])
    with pytest.raises(KernelError, match=r"failed: output_padding\[0\] = 2 must be less than max\(stride, "
                                          r"dilation\) = 2$"):
        _run(nd=1, strides=[2], output_padding=[2])


def test_output_shape_too_large():
    with pytest.raises(KernelError, match=r"spatial axis 1: an output of 30 cells does not fit the input's 6 "
                                          r"\(a Conv of it gives 15;"):
        _run(strides=[2, 2], output_shape=[11, 30])


def test_output_shape_length():
    with pytest.raises(ModelError, match=r"^node 'ct' \(ConvTranspose\): attribute 'output_shape' is "
                                         r"\[2, 3, 11, 12\]; allowed: a list of 2 ints \(the spatial axes\)$"):
        _run(strides=[2, 2], output_shape=[2, 3, 11, 12])


def test_channels_and_bias_are_checked():
    model, feeds = make_case(np.random.default_rng(3), group=2, mg=3)
    for vi in model.graph.input:  # unknown dims: the kernel, not the feed check, sees the shapes
        for dim in vi.type.tensor_type.shape.dim:
            dim.dim_param = "n"
    sess = host.InferenceSession(model.SerializeToString())
    with pytest.raises(KernelError, match=r"failed: W \(5, 3, 3, 2\) must have X's 4 input channels first, a "
                                          r"multiple of group=2$"):
        sess.run(None, {**feeds, "w": np.zeros((5, 3, 3, 2), np.float32)})
    with pytest.raises(KernelError, match=r"failed: B must have shape \(6,\) \(the output channels\), got \(3,\)$"):
        sess.run(None, {**feeds, "b": np.zeros(3, np.float32)})
