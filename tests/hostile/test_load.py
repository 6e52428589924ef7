"""Load: 8 threads x 50 runs on one session give the sequential results; a plugin that fails one
call in ten does not poison the session (every other run is right, later runs all are).

The reference for every input is the same session's sequential result, itself checked against
NumPy. The hostile plugin (mock device: copies, per-thread streams, notifications) runs with
`concurrent` (it says concurrent runs are safe) and, for the fault test, `fail_every=10`.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading

import cffi
import numpy as np
import pytest

from host.errors import KernelError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.hostile.driver import MAIN_MODEL, SHAPE, options

THREADS, RUNS = 8, 50


@pytest.fixture(scope="module")
def hostile(hostile_libs):
    ffi = cffi.FFI()
    ffi.cdef("void Hostile_Configure(const char* spec); int Hostile_Live(void);")
    lib = ffi.dlopen(str(hostile_libs["hostile"]))  # kept referenced for the module (shared counters)
    yield hostile_libs["hostile"], lib
    lib.Hostile_Configure(b"")


def _inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(THREADS * RUNS)]


def _hammer(session, inputs, expected):
    """Every thread runs its share of the inputs; returns (wrong results, errors) per thread."""
    start = threading.Barrier(THREADS)

    def worker(t: int):
        start.wait()
        wrong, errors = [], []
        for i in range(t, len(inputs), THREADS):
            try:
                y = session.run(None, {"X": inputs[i]})[0]
            except KernelError as exc:
                errors.append(str(exc))
                continue
            if not np.array_equal(y, expected[i]):
                wrong.append(i)
        return wrong, errors

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(worker, range(THREADS)))


def test_concurrent_runs_equal_sequential(hostile):
    path, lib = hostile
    lib.Hostile_Configure(b"concurrent")
    base = lib.Hostile_Live()
    inputs = _inputs()
    with Environment() as env:
        env.register_plugin("hostile", path)
        with InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) as s:
            assert s.executor.concurrent, "the plugin says concurrent runs are safe"
            expected = [s.run(None, {"X": x})[0] for x in inputs]
            np.testing.assert_allclose(expected[0], np.maximum(2 * inputs[0], 0) * 2)
            results = _hammer(s, inputs, expected)
    assert [r for r in results if r != ([], [])] == []
    assert lib.Hostile_Live() == base


def test_one_failing_call_in_ten_does_not_poison_the_session(hostile):
    path, lib = hostile
    lib.Hostile_Configure(b"concurrent")
    base, statuses = lib.Hostile_Live(), len(hostapi.STATUSES)
    inputs = _inputs()
    with Environment() as env:
        env.register_plugin("hostile", path)
        with InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) as s:
            expected = [s.run(None, {"X": x})[0] for x in inputs]
            lib.Hostile_Configure(b"concurrent;fail_every=10")
            results = _hammer(s, inputs, expected)
            lib.Hostile_Configure(b"concurrent")
            after = [s.run(None, {"X": x})[0] for x in inputs[:40]]
    errors = [e for _, errs in results for e in errs]
    assert [w for w, _ in results if w] == [], "a run that did not fail gave a wrong result"
    # Each run makes 1 (its first call failed) or 2 Compute calls, and every 10th call fails.
    assert len(inputs) // 10 <= len(errors) <= 2 * len(inputs) // 10, len(errors)
    for e in errors:
        assert re.search(r"^node 'add[01]' \(Add\) on HostileEP failed \(FAIL\): HostileEP: injected failure in "
                         r"Compute call \d+ \(one call in 10 fails\)$", e), e
    for y, want in zip(after, expected[:40]):
        np.testing.assert_array_equal(y, want)
    assert lib.Hostile_Live() == base
    assert len(hostapi.STATUSES) == statuses


@pytest.mark.gpu
def test_concurrent_runs_on_the_gpu_equal_sequential(cuda_plugin_path):
    """The same load on the CUDA plugin: 8 threads x 50 runs on one session (GPU machine only)."""
    with Environment() as env:
        env.register_plugin("cuda", cuda_plugin_path)
        if not env.plugin("cuda").factories[0].devices:
            pytest.skip("no CUDA device: the CUDA EP would fall back to the CPU EP")
        inputs = _inputs()
        with InferenceSession(MAIN_MODEL, options(), providers=["CUDAExecutionProvider"], env=env) as s:
            assert "CUDAExecutionProvider" in s.node_assignment().values()
            expected = [s.run(None, {"X": x})[0] for x in inputs]
            np.testing.assert_allclose(expected[0], np.maximum(2 * inputs[0], 0) * 2, rtol=1e-6)
            results = _hammer(s, inputs, expected)
    assert [r for r in results if r != ([], [])] == []


def test_cpu_sessions_sharing_the_kernel_pool_give_one_result_per_input():
    """The CPU EP's packed GEMM and attention share their work with one process-wide worker pool
    (native/kernels_pool.c). Two sessions of a transformer block at a size that uses it (intra_op 2 and 4),
    threads coming and going in rounds of 1-8: every result is the bits of the sequential one (whichever
    run held the pool or computed alone), and that one is onnxruntime's answer."""
    import onnxruntime

    from host.cli import zoo
    from host.cpu_ep import native
    from host.runtime.options import SessionOptions

    if native.LIB is None:
        pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
    model = zoo.transformer_block(seq=256).SerializeToString()
    sessions = []
    for threads in (2, 4):
        so = SessionOptions()
        so.intra_op_num_threads = threads
        sessions.append(InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"]))
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1, 256, 256)).astype(np.float32) for _ in range(6)]
    expected = [sessions[0].run(None, {"input": x})[0] for x in inputs]
    ref = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    for x, y in zip(inputs, expected):
        np.testing.assert_allclose(y, ref.run(None, {"input": x})[0], rtol=1e-4, atol=1e-4)
    assert native.LIB.ep_pool_workers() >= 1  # the products above were shared with the pool

    def worker(t: int):
        return [i for k in range(4) for i in [(t + k) % len(inputs)]
                if not np.array_equal(sessions[(t + k) % 2].run(None, {"input": inputs[i]})[0], expected[i])]

    for n in (1, 2, 4, 8, 3):
        with concurrent.futures.ThreadPoolExecutor(n) as pool:  # new threads each round
            assert [w for wrong in pool.map(worker, range(n)) for w in wrong] == []
