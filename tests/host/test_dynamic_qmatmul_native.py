"""DynamicQuantizeMatMul's compiled call (ep_dynamic_qmatmul, host/cpu_ep/ops_quant_ms.py) against the NumPy
path it replaces, bit for bit, and against onnxruntime's com.microsoft kernel: random shapes, int8 and uint8
B with per-tensor or per-column zero points and scales, with and without a bias, A of one sign only, all
zeros, or with a NaN (which the compiled call leaves to the NumPy path)."""

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
from tests.property import strategies as s

pytestmark = pytest.mark.skipif(native.LIB is None, reason="the compiled kernels are not built (python build.py)")


def _kernel(with_zp: bool, with_bias: bool):
    names = ["a", "b", "b_scale", "b_zp" if with_zp else "", "bias" if with_bias else ""]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("DynamicQuantizeMatMul", names, ["y"], domain=ms.MS)
    return ms.DynamicQuantizeMatMul(node_info(node, 1))


def _onnxruntime(feeds: dict) -> np.ndarray:
    names = list(feeds)
    node = helper.make_node("DynamicQuantizeMatMul", names, ["y"], domain=ms.MS)
    consts = [numpy_helper.from_array(v, k) for k, v in feeds.items() if k != "a"]
    k, n = feeds["b"].shape
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(feeds["a"].shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms.MS, 1)])
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"a": feeds["a"]})[0]


@st.composite
def cases(draw):
    rows = draw(st.sampled_from([(1,), (3,), (2, 4), (1, 1, 5)]))
    k, n = draw(st.integers(1, 48)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sign = draw(st.sampled_from(["both", "positive", "negative", "zeros"]))
    a = rng.standard_normal((*rows, k)).astype(np.float32) * np.float32(draw(st.sampled_from([1e-3, 1.0, 300.0])))
    a = {"both": a, "positive": np.abs(a), "negative": -np.abs(a), "zeros": np.zeros_like(a)}[sign]
    dtype = draw(st.sampled_from([np.int8, np.uint8]))
    info = np.iinfo(dtype)
    b = rng.integers(info.min, info.max + 1, (k, n)).astype(dtype)
    per_column = draw(st.booleans())
    width = n if per_column else 1
    feeds = {"a": a, "b": b, "b_scale": rng.uniform(1e-3, 0.1, width).astype(np.float32)}
    with_zp, with_bias = draw(st.booleans()), draw(st.booleans())
    if with_zp or with_bias:
        feeds["b_zp"] = rng.integers(info.min, info.max + 1, width).astype(dtype)
    if with_bias:
        feeds["bias"] = rng.standard_normal(n).astype(np.float32)
    return feeds


@given(feeds=cases())
@settings(deadline=None, max_examples=s.budget(60))
def test_the_compiled_call_gives_the_numpy_paths_bits_and_onnxruntimes_results(feeds):
    kernel = _kernel("b_zp" in feeds, "bias" in feeds)
    args = list(feeds.values())
    compiled = kernel._compiled(*args, *([None] * (5 - len(args))))
    assert compiled is not None  # every drawn case is small and well-formed: the compiled call takes it
    native_lib, native.LIB = native.LIB, None
    try:
        (numpy_path,) = kernel.run(*args)  # the NumPy path, with the library hidden
    finally:
        native.LIB = native_lib
    assert compiled.dtype == np.float32 and compiled.shape == numpy_path.shape
    np.testing.assert_array_equal(compiled.view(np.uint32), numpy_path.view(np.uint32))
    want = _onnxruntime(feeds)
    np.testing.assert_allclose(compiled, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_a_nan_or_a_large_product_is_left_to_the_numpy_path():
    kernel = _kernel(False, False)
    b = np.ones((4, 3), np.int8)
    scale = np.array([0.5], np.float32)
    a = np.array([[1.0, np.nan, 0.0, 2.0]], np.float32)
    assert kernel._compiled(a, b, scale, None, None) is None
    assert np.isnan(kernel.run(a, b, scale)[0]).all()
    big = np.ones((64, 128), np.float32)
    assert kernel._compiled(big, np.ones((128, 64), np.int8), scale, None, None) is None  # 2**19 MACs


# -- QLinearMatMul and com.microsoft QLinearAdd ------------------------------------------------------------


def _numpy_path(kernel, args) -> np.ndarray:
    """The kernel's NumPy path: the compiled library hidden for one run."""
    native_lib, native.LIB = native.LIB, None
    try:
        return kernel.run(*args)[0]
    finally:
        native.LIB = native_lib


def _int8(draw, rng, shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


@st.composite
def qmatmul_cases(draw):
    rows = draw(st.sampled_from([(1,), (4,), (2, 3)]))
    k, n = draw(st.integers(1, 48)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a_type = draw(st.sampled_from([np.int8, np.uint8]))
    # onnxruntime's kernels: uint8 x uint8, uint8 x int8 and int8 x int8, the output of A's type
    b_type = np.int8 if a_type == np.int8 else draw(st.sampled_from([np.int8, np.uint8]))
    y_type = a_type
    width = n if draw(st.booleans()) else 1
    scale = st.sampled_from([1e-3, 0.02, 0.3])
    return {"a": _int8(draw, rng, (*rows, k), a_type), "a_scale": np.array(draw(scale), np.float32),
            "a_zero_point": _int8(draw, rng, (), a_type), "b": _int8(draw, rng, (k, n), b_type),
            "b_scale": rng.uniform(1e-3, 0.05, width).astype(np.float32), "b_zero_point": _int8(draw, rng, width, b_type),
            "y_scale": np.array(draw(scale), np.float32), "y_zero_point": _int8(draw, rng, (), y_type)}


def _reference(op: str, domain: str, feeds: dict, out: np.dtype, runtime_inputs: tuple = ("a",)) -> np.ndarray:
    node = helper.make_node(op, list(feeds), ["y"], domain=domain)
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(feeds[k].dtype), list(feeds[k].shape))
              for k in runtime_inputs]
    consts = [numpy_helper.from_array(v, k) for k, v in feeds.items() if k not in runtime_inputs]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(np.dtype(out)), None)],
                              consts)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    session = onnxruntime.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, {k: feeds[k] for k in runtime_inputs})[0]


@given(feeds=qmatmul_cases())
@settings(deadline=None, max_examples=s.budget(60))
def test_qlinear_matmul_compiled_gives_the_numpy_paths_bits(feeds):
    from host.cpu_ep.ops_quant import QLinearMatMul

    kernel = QLinearMatMul(node_info(helper.make_node("QLinearMatMul", list(feeds), ["y"]), 10))
    args = list(feeds.values())
    compiled = kernel._compiled(*args)
    assert compiled is not None
    want = _numpy_path(kernel, args)
    assert compiled.dtype == want.dtype == feeds["y_zero_point"].dtype and compiled.shape == want.shape
    np.testing.assert_array_equal(compiled, want)
    ort = _reference("QLinearMatMul", "", feeds, compiled.dtype)
    assert np.abs(compiled.astype(np.int32) - ort.astype(np.int32)).max() <= 1  # onnxruntime rounds its own way


@st.composite
def qadd_cases(draw):
    shape = draw(st.sampled_from([(5,), (2, 7), (1, 4, 16)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b_shape = shape if draw(st.booleans()) else shape[-1:]
    a_type = b_type = c_type = draw(st.sampled_from([np.int8, np.uint8]))  # onnxruntime: one type T for all three
    scale = st.sampled_from([1e-3, 0.02, 0.3])
    return {"a": _int8(draw, rng, shape, a_type), "a_scale": np.array(draw(scale), np.float32),
            "a_zero_point": _int8(draw, rng, (), a_type), "b": _int8(draw, rng, b_shape, b_type),
            "b_scale": np.array(draw(scale), np.float32), "b_zero_point": _int8(draw, rng, (), b_type),
            "c_scale": np.array(draw(scale), np.float32), "c_zero_point": _int8(draw, rng, (), c_type)}


@given(feeds=qadd_cases())
@settings(deadline=None, max_examples=s.budget(60))
def test_qlinear_add_compiled_gives_the_numpy_paths_bits(feeds):
    kernel = ms.QLinearAdd(node_info(helper.make_node("QLinearAdd", list(feeds), ["y"], domain=ms.MS), 1))
    args = list(feeds.values())
    ratio_a, ratio_b, fixed, sat = ms.QLinearAdd._params(*(feeds[k] for k in (
        "a_scale", "a_zero_point", "b_scale", "b_zero_point", "c_scale", "c_zero_point")))
    compiled = ms._compiled_add(feeds["a"], feeds["b"], ratio_a, ratio_b, fixed, sat)
    assert compiled is not None
    want = _numpy_path(kernel, args)
    assert compiled.dtype == want.dtype and compiled.shape == want.shape
    np.testing.assert_array_equal(compiled, want)
    ort = _reference("QLinearAdd", ms.MS, feeds, compiled.dtype, runtime_inputs=("a", "b"))
    assert np.abs(compiled.astype(np.int32) - ort.astype(np.int32)).max() <= 1
