"""Kernels that share their work with the packed GEMM's worker pool (kernels_pool.c): attention over whole
heads. At any thread count each output is computed by one thread, in the same order, so a run at the
session's bound of threads gives the bits of a run at one thread; both against onnx's reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from host.cpu_ep import native, ops_attention, packed_gemm
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.host.test_cpu_native import _masks, _Spy
from tests.host.test_cpu_speed_paths import _model

F32 = np.float32


class _ThreadSpy(_Spy):
    """Counts calls and keeps ep_attention's last argument (its thread count)."""

    def __init__(self, lib):
        super().__init__(lib)
        self.threads: list[int] = []

    def __getattr__(self, name):
        call = super().__getattr__(name)
        if name != "ep_attention":
            return call

        def attention(*args):
            self.threads.append(args[-1])
            return call(*args)

        return attention


def _session(model, threads: int):
    so = SessionOptions()
    so.intra_op_num_threads = threads
    return InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])


@pytest.fixture
def spy(monkeypatch):
    if native.LIB is None:
        pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
    lib = native.LIB
    s = _ThreadSpy(lib)
    native.use(s)
    monkeypatch.setattr(packed_gemm, "THREADED_MACS", 1 << 10)  # these small heads still get threads
    yield s
    native.use(lib)


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("mask_kind", ["none", "float", "bool", "dead-row"])
def test_attention_at_three_threads_gives_the_bits_of_one(spy, causal, mask_kind):
    """5 batches x 6 query heads over 2 key/value heads (grouped), an odd key count: 30 heads in units."""
    rng = np.random.default_rng(21)
    b, h, g, s, t, d = 5, 6, 2, 9, 11, 8
    feeds = {"q": rng.standard_normal((b, h, s, d)), "k": rng.standard_normal((b, g, t, d)),
             "v": rng.standard_normal((b, g, t, d))}
    feeds = {k: v.astype(F32) for k, v in feeds.items()}
    mask = _masks(rng, b, h, s, t)[mask_kind]
    names = ["q", "k", "v"]
    if mask is not None:
        feeds["mask"], names = mask, names + ["mask"]
    model = _model([helper.make_node("Attention", names, ["y"], is_causal=causal, scale=0.3)], feeds, ["y"], {},
                   opset=23)
    one = _session(model, 1).run(None, feeds)[0]
    three = _session(model, 3).run(None, feeds)[0]
    assert spy.threads == [1, 3]
    np.testing.assert_array_equal(three, one)
    np.testing.assert_allclose(three, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_attention_threads_follow_the_work(monkeypatch):
    """One thread below THREADED_MACS multiply-adds, one per THREADED_MACS above it, never more than the
    run's bound."""
    monkeypatch.setattr(packed_gemm.threads.POOLS, "share", lambda: 4)
    macs = packed_gemm.THREADED_MACS
    assert ops_attention.native_threads((1, 1, 1, 1, 1, 1, 1)) == 1
    assert ops_attention.native_threads((4, 4, 64, 64, 64, 64, 1)) == 4 * 4 * 64 * 64 * 128 // macs == 2
    assert ops_attention.native_threads((8, 16, 512, 512, 64, 64, 1)) == 4


def test_a_batch_1_product_over_a_large_weight_has_the_same_bits_at_any_bound_and_under_concurrency():
    """x (1 x 4096) @ W (4096 x 1000): OpenBLAS's GEMV rounds differently at 1 and at 2 threads, and runs
    that overlap share the bound (fewer BLAS threads each). Over a weight the product is the packed GEMM's,
    whose outputs are each one thread's in-order sum: a session at 1 thread, one at 2 and 8 threads running
    the second at once all give the same bits; onnxruntime's answer within float32 rounding."""
    from concurrent.futures import ThreadPoolExecutor

    import onnxruntime

    if native.LIB is None:
        pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
    rng = np.random.default_rng(41)
    feeds = {"x": rng.standard_normal((1, 4096)).astype(F32)}
    w = rng.standard_normal((4096, 1000)).astype(F32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], feeds, ["y"], {"w": w})
    one, two = _session(model, 1), _session(model, 2)
    want = one.run(None, feeds)[0]
    np.testing.assert_array_equal(two.run(None, feeds)[0], want)
    with ThreadPoolExecutor(8) as pool:
        for y in pool.map(lambda _: two.run(None, feeds)[0], range(64)):
            np.testing.assert_array_equal(y, want)
    ref = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(want, ref.run(None, feeds)[0], rtol=1e-4, atol=1e-3)
