"""com.microsoft QLinearSoftmax's compiled pass (ep_qlinear_softmax, host/cpu_ep/ops_quant_ms.py) against the
NumPy path it replaces, bit for bit (the row sums in NumPy's own order), and against onnxruntime within one
quantization step: random shapes (rows of 1 to 300 codes: NumPy's three ways of summing), int8 and uint8 codes
and outputs, zero points and scales, the `opset` < 13 form that coerces to 2-D."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from host.cpu_ep import native
from host.cpu_ep import ops_quant_ms as ms
from host.runtime.node import node_info

pytestmark = pytest.mark.skipif(native.LIB is None, reason="the compiled kernels are not built (python build.py)")


def _node(axis: int, opset: int):
    return helper.make_node("QLinearSoftmax", ["x", "x_scale", "x_zp", "y_scale", "y_zp"], ["y"], domain=ms.MS,
                            axis=axis, opset=opset)


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 5, 8, 13, 64, 128, 129, 300]))
    lead = draw(st.sampled_from([(1,), (3,), (2, 2)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x_type, y_type = (draw(st.sampled_from([np.int8, np.uint8])) for _ in range(2))
    info = np.iinfo(x_type)
    x = rng.integers(info.min, info.max + 1, (*lead, n)).astype(x_type)
    feeds = {"x": x, "x_scale": np.float32(draw(st.sampled_from([0.003, 0.02, 0.1, 0.5]))),
             "x_zp": x_type(rng.integers(info.min, info.max + 1)),
             "y_scale": np.float32(draw(st.sampled_from([1 / 256, 1 / 255, 1 / 128]))),
             "y_zp": y_type(np.iinfo(y_type).min)}
    old = draw(st.booleans())  # opset 1/11 form: the tail from axis as rows, here the whole last axis
    return feeds, (-1 if not old else x.ndim - 1), 11 if old else 13


def _numpy_path(kernel, feeds, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(native, "LIB", None)
        return kernel._run(*feeds.values())[0]


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_the_compiled_pass_gives_the_numpy_paths_bits(case):
    feeds, axis, opset = case
    kernel = ms.QLinearSoftmax(node_info(_node(axis, opset), 1))
    got = kernel._run(*feeds.values())[0]
    with pytest.MonkeyPatch.context() as mp:
        want = _numpy_path(kernel, feeds, mp)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def _onnxruntime(feeds, axis, opset) -> np.ndarray:
    consts = [numpy_helper.from_array(np.asarray(v), k) for k, v in feeds.items() if k != "x"]
    x = feeds["x"]
    elem = TensorProto.INT8 if x.dtype == np.int8 else TensorProto.UINT8
    graph = helper.make_graph([_node(axis, opset)], "g", [helper.make_tensor_value_info("x", elem, list(x.shape))],
                              [helper.make_tensor_value_info("y", elem, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms.MS, 1)])
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_the_compiled_pass_is_within_one_step_of_onnxruntime(case):
    feeds, axis, opset = case
    if feeds["x"].dtype != feeds["y_zp"].dtype:  # onnxruntime's kernel takes one 8-bit type for both
        feeds["y_zp"] = feeds["x"].dtype.type(np.iinfo(feeds["x"].dtype).min)
    got = ms.QLinearSoftmax(node_info(_node(axis, opset), 1))._run(*feeds.values())[0]
    want = _onnxruntime(feeds, axis, opset)
    assert got.dtype == want.dtype
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1
