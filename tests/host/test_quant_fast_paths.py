"""The quantized kernels' per-run fast paths: what they derive once from initializers (BoundParams in
host/cpu_ep/ops_quant.py) must give the same integers as the path that derives it at every run, and a
feed that overrides an initializer must be used, not what was derived from the initializer. Also the
MaxPool tile path (kernel = strides, no padding) that the quantized CNN's 8-bit pool takes.
References: onnxruntime's CPU provider on the same model and inputs."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from tests.host import test_quantized
from tests.host.test_quantized import MODELS


def _quantized(tmp_dir: str, name: str, fmt: str) -> str:
    """test_quantized's model, leaving that module's RNG where it was (its own cases draw their data
    from it, and some accept no more than a few one-step differences on that data)."""
    state = test_quantized.RNG.get_state()
    try:
        return test_quantized._quantized(tmp_dir, name, fmt)
    finally:
        test_quantized.RNG.set_state(state)


def _ort(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _initializers_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """The model with every initializer turned into a graph input, and the feeds holding their values
    (fresh arrays at every run: the kernels then derive their parameters at every call)."""
    moved = onnx.ModelProto.FromString(model.SerializeToString())
    feeds = {}
    for init in list(moved.graph.initializer):
        arr = numpy_helper.to_array(init)
        feeds[init.name] = arr
        moved.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(arr.shape)))
    del moved.graph.initializer[:]
    return moved, feeds


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer's INFO chatter, for this module only
    yield str(tmp_path_factory.mktemp("fast_paths"))
    root.setLevel(level)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fmt", ["qop", "dynamic"])  # (a QDQ model's groups fuse only over constants)
def test_bound_parameters_give_the_per_call_integers(quant_dir, name, fmt):
    model = onnx.load(_quantized(quant_dir, name, fmt))
    moved, params = _initializers_as_inputs(model)
    bound, per_call = host.InferenceSession(model.SerializeToString()), host.InferenceSession(moved.SerializeToString())
    rng = np.random.RandomState(3)
    for _ in range(3):  # later runs take the memoized parameters
        x = rng.rand(*MODELS[name][1]).astype(np.float32)
        got = bound.run(None, {"x": x})[0]
        copies = {k: v.copy() for k, v in params.items()}
        np.testing.assert_array_equal(got, per_call.run(None, {"x": x, **copies})[0])
        if fmt == "qop":  # the QOperator graph runs on onnxruntime's integer kernels too
            np.testing.assert_allclose(got, _ort(model).run(None, {"x": x})[0], atol=0.05)


def _qlinear_matmul_model(params: dict, fed: tuple) -> onnx.ModelProto:
    """QLinearMatMul with `params` as initializers, except those named in `fed` (graph inputs)."""
    node = helper.make_node("QLinearMatMul", ["a", *params], ["y"])
    inputs = [helper.make_tensor_value_info("a", TensorProto.UINT8, [3, 16])]
    inputs += [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.asarray(params[k]).dtype),
                                             list(np.shape(params[k]))) for k in fed]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in params.items() if k not in fed]
    graph = helper.make_graph([node], "qmm", inputs, [helper.make_tensor_value_info("y", TensorProto.UINT8, [3, 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_parameters_fed_at_run_time_are_read_at_every_run():
    """Scales and weights that change from run to run (graph inputs): nothing derived from one run's
    values may serve the next; the bound ones beside them keep their derived form."""
    rng = np.random.RandomState(0)
    params = {"a_scale": np.float32(0.02), "a_zp": np.uint8(120), "b": rng.randint(0, 255, (16, 8)).astype(np.uint8),
              "b_scale": np.float32(0.01), "b_zp": np.uint8(128), "y_scale": np.float32(0.05), "y_zp": np.uint8(100)}
    model = _qlinear_matmul_model(params, fed=("b", "y_scale"))
    eph, ref = host.InferenceSession(model.SerializeToString()), _ort(model)
    a = rng.randint(0, 255, (3, 16)).astype(np.uint8)
    results = []
    for y_scale, seed in ((0.05, 1), (0.2, 1), (0.2, 2), (0.05, 1)):
        feeds = {"a": a, "b": np.random.RandomState(seed).randint(0, 255, (16, 8)).astype(np.uint8),
                 "y_scale": np.array(y_scale, np.float32)}
        results.append(eph.run(None, feeds)[0])
        np.testing.assert_array_equal(results[-1], ref.run(None, feeds)[0])
    assert not np.array_equal(results[0], results[1]) and not np.array_equal(results[1], results[2])
    # the same feed objects, written in place between runs (a caller reusing its buffers)
    feeds = {"a": a, "b": np.random.RandomState(1).randint(0, 255, (16, 8)).astype(np.uint8),
             "y_scale": np.array(0.05, np.float32)}
    first = eph.run(None, feeds)[0]
    feeds["y_scale"][...] = 0.2
    feeds["b"][:] = np.random.RandomState(2).randint(0, 255, (16, 8))
    np.testing.assert_array_equal(eph.run(None, feeds)[0], ref.run(None, feeds)[0])
    np.testing.assert_array_equal(first, results[0])


@pytest.mark.parametrize("kernel", [[2, 2], [3, 2], [1, 1]])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.float32])
def test_maxpool_over_whole_tiles(kernel, dtype):
    x = (np.random.RandomState(4).rand(2, 3, 6, 8) * 200 - (100 if dtype == np.int8 else 0)).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=kernel, strides=kernel)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", elem, list(x.shape))],
                              [helper.make_tensor_value_info("y", elem, [2, 3, 6 // kernel[0], 8 // kernel[1]])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    got = host.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    expected = _ort(model).run(None, {"x": x})[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_dynamic_quantization_parameters_are_the_float32_ones():
    """DynamicQuantizeLinear's scale and zero point in Python floats (ops_quant.dynamic_params) against
    the float32 formula in NumPy, over ranges of every magnitude, an all-zero range and a one-sided one."""
    from host.cpu_ep.ops_quant import dynamic_params

    f32 = np.float32
    rng = np.random.RandomState(0)
    lows = -np.abs(rng.randn(3000)) * 2.0 ** rng.randint(-30, 30, 3000) * (rng.rand(3000) < 0.9)
    highs = np.abs(rng.randn(3000)) * 2.0 ** rng.randint(-30, 30, 3000)
    for lo, hi in [*zip(lows.astype(f32), highs.astype(f32)), (f32(0), f32(0)), (f32(0), f32(3.5))]:
        scale = f32((f32(hi) - f32(lo)) / f32(255))
        scale = scale if scale != 0 else f32(1)
        zp = f32(np.clip(np.rint(f32(0) - f32(lo) / scale), 0, 255))
        assert dynamic_params(float(lo), float(hi)) == (scale, zp), (lo, hi)


_EDGES = np.array([0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5, 254.5, 255.5, 32766.5, -32768.5,
                   65534.5, 1e9, -1e9, np.inf, -np.inf, np.nan, 3.0000002, 1e-30], dtype=np.float32)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16])
@pytest.mark.parametrize("zero_point", [0, 3, -7])
def test_the_compiled_saturate_gives_numpys_integers(dtype, zero_point, monkeypatch):
    """ep_quantize against Saturate's NumPy path (rint half to even, + zero point, clip, convert; NaN to 0)
    on halfway values, bounds, infinities and NaN, as it is (op 0), multiplied (Requantize) and divided
    (QuantizeLinear) by a float32 scale."""
    from host.cpu_ep import native, ops_quant

    if native.LIB is None:
        pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
    if zero_point < 0 and np.dtype(dtype).kind == "u":
        zero_point = -zero_point
    sat = ops_quant.Saturate(np.asarray(zero_point, dtype=dtype), np.dtype(dtype))
    rng = np.random.default_rng(abs(zero_point))
    values = np.concatenate([_EDGES, (rng.standard_normal(300) * 200).astype(np.float32)])
    scale = np.float32(0.37)
    with np.errstate(invalid="ignore"):
        for op, prepared in ((0, values), (ops_quant._MULTIPLY, values * scale), (ops_quant._DIVIDE, values / scale)):
            got = sat.scaled(values, None if op == 0 else scale, op)
            monkeypatch.setattr(native, "LIB", None)
            want = sat(prepared.copy())
            monkeypatch.undo()
            assert got is not None and got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, want)
        assert sat(values.copy()).dtype == np.dtype(dtype)  # __call__ takes the compiled path too


def test_the_compiled_saturate_leaves_what_it_does_not_take_to_numpy():
    """float64 values, a per-axis zero point, int32 and 4-bit types: None (NumPy's path serves them)."""
    from host.cpu_ep import ops_quant

    values = np.arange(6, dtype=np.float32)
    assert ops_quant.Saturate(None, np.dtype(np.uint8)).scaled(values.astype(np.float64), None, 0) is None
    assert ops_quant.Saturate(np.array([1, 2, 3], np.uint8), np.dtype(np.uint8)).scaled(values, None, 0) is None
    assert ops_quant.Saturate(None, np.dtype(np.int32)).scaled(values, None, 0) is None
