"""The compiled Softmax/LogSoftmax (kernels_rows.c's ep_softmax) inside a session, against onnxruntime.

The spy (test_cpu_native.py) proves the compiled kernel ran; odd row lengths exercise the lanes' tails,
rows of -inf, +inf and NaN the special values, opset 11's coerced 2-D form an axis that is not the last.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from host.cpu_ep import native
from tests.host import test_cpu_native
from tests.host.test_cpu_speed_paths import _ephost, _model, _ort

TOL = {"rtol": 1e-5, "atol": 1e-6}
LIB = native.LIB


@pytest.fixture
def spy():
    """test_cpu_native's spy: counts the library's calls."""
    assert LIB is not None, native.LOAD_ERROR
    s = test_cpu_native._Spy(LIB)
    native.use(s)
    yield s
    native.use(LIB)


@pytest.fixture
def numpy_only():
    native.use(None)
    yield
    native.use(LIB)


def _run(op: str, x: np.ndarray, opset: int = 18, **attrs):
    model = _model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": x}, ["y"], {}, opset=opset)
    return _ephost(model).run(None, {"x": x})[0], _ort(model, {"x": x})[0]


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 17), (8, 2, 33, 129), (5, 1000)])
def test_compiled_softmax_matches_onnxruntime(spy, op, shape):
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 8).astype(np.float32)
    got, want = _run(op, x)
    assert spy.calls["ep_softmax"] == 1
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_compiled_softmax_of_large_and_masked_scores(spy, op):
    """Scores far from 0 (exp would overflow unshifted) and rows partly at -inf, as a causal mask makes."""
    x = np.random.default_rng(1).uniform(-300, 300, (6, 37)).astype(np.float32)
    x[np.triu_indices(6, 1, 37)] = -np.inf
    got, want = _run(op, x)
    assert spy.calls["ep_softmax"] == 1
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_compiled_softmax_special_rows_as_numpy_path(spy, numpy_only, op):
    """A row holding NaN, +inf or only -inf: NaN, as the NumPy path gives (x - max(x) is NaN there)."""
    x = np.zeros((4, 19), np.float32)
    x[0, 5], x[1, 18], x[2, :] = np.nan, np.inf, -np.inf
    x[3] = np.arange(19)
    want = _ephost(_model([helper.make_node(op, ["x"], ["y"])], {"x": x}, ["y"], {})).run(None, {"x": x})[0]
    native.use(spy)
    got = _ephost(_model([helper.make_node(op, ["x"], ["y"])], {"x": x}, ["y"], {})).run(None, {"x": x})[0]
    assert spy.calls["ep_softmax"] == 1
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[:3]).all()
    np.testing.assert_allclose(got[3], want[3], **TOL)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_compiled_softmax_opset_11_coerces_to_2d(spy, axis):
    x = np.random.default_rng(axis).standard_normal((3, 4, 5)).astype(np.float32)
    got, want = _run("Softmax", x, opset=11, axis=axis)
    assert spy.calls["ep_softmax"] == 1
    np.testing.assert_allclose(got, want, **TOL)


def test_softmax_over_an_inner_axis_keeps_the_numpy_path(spy):
    x = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    got, want = _run("Softmax", x, axis=1)
    assert spy.calls["ep_softmax"] == 0
    np.testing.assert_allclose(got, want, **TOL)
