"""The compiled batched MatMul (kernels_gemm.c's ep_matmul_batched) over the strided views attention
leaves (Split, Reshape, Transpose), and Where's copy path for a broadcast mask, against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from host.cpu_ep import native, ops_math
from tests.host import test_cpu_native
from tests.host.test_cpu_speed_paths import _ephost, _model, _ort

LIB = native.LIB
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def spy(monkeypatch):
    """Counts the library's calls; products of any size take the compiled path (BATCHED_MIN_MACS 0)."""
    monkeypatch.setattr(ops_math, "BATCHED_MIN_MACS", 0)
    assert LIB is not None, native.LOAD_ERROR
    s = test_cpu_native._Spy(LIB)
    native.use(s)
    yield s
    native.use(LIB)


def _attention(b, s, h, d):
    """GPT-2's attention as exported: one projection split into q, k, v, heads by Reshape + Transpose."""
    nodes = [helper.make_node("Split", ["x"], ["q0", "k0", "v0"], axis=2, num_outputs=3),
             *[helper.make_node("Reshape", [f"{n}0", "heads"], [f"{n}1"]) for n in "qkv"],
             helper.make_node("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["p"]),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    x = np.random.default_rng(b * s + h * d).standard_normal((b, s, 3 * h * d), dtype=np.float32)
    return _model(nodes, {"x": x}, ["y"], {"heads": np.array([b, s, h, d], np.int64)}), {"x": x}


@pytest.mark.parametrize("b,s,h,d", [(3, 7, 2, 5), (2, 33, 4, 16), (1, 1, 1, 1)])
def test_attention_matmuls_over_views_run_compiled(spy, b, s, h, d):
    model, feeds = _attention(b, s, h, d)
    got = _ephost(model).run(None, feeds)[0]
    assert spy.calls["ep_matmul_batched"] == 2
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)


def test_small_batched_products_keep_numpy(spy, monkeypatch):
    monkeypatch.setattr(ops_math, "BATCHED_MIN_MACS", 1 << 21)
    model, feeds = _attention(1, 16, 2, 32)  # 2 x 16 x 32 x 16 multiply-adds a product
    got = _ephost(model).run(None, feeds)[0]
    assert spy.calls["ep_matmul_batched"] == 0
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)


def test_three_batch_axes_above_one_keep_numpy(spy):
    rng = np.random.default_rng(0)
    a, c = rng.standard_normal((2, 3, 2, 4, 5), dtype=np.float32), rng.standard_normal((2, 3, 2, 5, 6), dtype=np.float32)
    model = _model([helper.make_node("MatMul", ["a", "c"], ["y"])], {"a": a, "c": c}, ["y"], {})
    got = _ephost(model).run(None, {"a": a, "c": c})[0]
    assert spy.calls["ep_matmul_batched"] == 0
    np.testing.assert_allclose(got, _ort(model, {"a": a, "c": c})[0], **TOL)


def test_contiguous_3d_batches_run_compiled(spy):
    rng = np.random.default_rng(1)
    a, c = rng.standard_normal((5, 9, 17), dtype=np.float32), rng.standard_normal((5, 17, 40), dtype=np.float32)
    model = _model([helper.make_node("MatMul", ["a", "c"], ["y"])], {"a": a, "c": c}, ["y"], {})
    got = _ephost(model).run(None, {"a": a, "c": c})[0]
    assert spy.calls["ep_matmul_batched"] == 1
    np.testing.assert_allclose(got, _ort(model, {"a": a, "c": c})[0], **TOL)


def test_where_of_a_broadcast_mask_matches_onnxruntime():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 37, 41), dtype=np.float32)
    cond = rng.random((1, 1, 37, 41)) > 0.4
    fill = np.array(-3.4e38, np.float32)
    model = _model([helper.make_node("Where", ["c", "x", "f"], ["y"])], {"c": cond, "x": x}, ["y"], {"f": fill})
    got = _ephost(model).run(None, {"c": cond, "x": x})[0]
    np.testing.assert_array_equal(got, _ort(model, {"c": cond, "x": x})[0])
