"""CUDA graph capture and replay with the CUDA EP (seeds 002, 003). GPU only."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import abi
from abi import sdk
from host.cli import zoo
from host.errors import GraphCaptureError
from host.runtime.session import InferenceSession, RunOptions

CUDA = "CUDAExecutionProvider"
pytestmark = pytest.mark.gpu


def graph_session(genv, model, **opts):
    options = {"enable_cuda_graph": "1", "use_tf32": "0", **{k.replace("__", "."): v for k, v in opts.items()}}
    return InferenceSession(model, providers=[(CUDA, options)], env=genv)


def bind(cp, s, feeds):
    b = s.io_binding()
    ins = {}
    for arg in s.get_inputs():
        ins[arg.name] = cp.asarray(feeds[arg.name])
        b.bind_input(arg.name, ins[arg.name])
    outs = {}
    ref = InferenceSession(s.graph.model).run(None, feeds)
    for arg, r in zip(s.get_outputs(), ref):
        outs[arg.name] = cp.zeros(r.shape, r.dtype)
        b.bind_output(arg.name, outs[arg.name])
    # A user-stream session does not order itself after CuPy's stream; and a stream sync, not a
    # device sync, so that a graph another thread is capturing is not invalidated.
    cp.cuda.get_current_stream().synchronize()
    return b, ins, outs


def cpu_ref(model, feeds):
    return InferenceSession(model).run(None, feeds)


def the_ep():
    eps = [o for o in sdk.runtime(f"_ephost_cuda_v{abi.ABI_VERSION}")._objects.values() if type(o).__name__ == "CudaEp"]
    return eps[-1]


def ro_with(**entries):
    ro = RunOptions()
    for k, v in entries.items():
        ro.add_run_config_entry(k, str(v))
    return ro


@pytest.mark.parametrize("builder", [lambda: zoo.mlp(layers=4, hidden=64, batch=2),
                                     lambda: zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128)])
def test_capture_replay_equals_eager_and_sees_new_data(cp, genv, builder):
    m = builder()
    feeds = zoo.random_inputs(m)
    s = graph_session(genv, m)
    b, ins, outs = bind(cp, s, feeds)
    s.run_with_iobinding(b)  # warm-up x2 + capture inside this call
    assert s.fallbacks["graph_captured"] == 1 and s.capture.captured(0)
    out_name = s.get_outputs()[0].name
    np.testing.assert_allclose(cp.asnumpy(outs[out_name]), cpu_ref(m, feeds)[0], rtol=2e-4, atol=2e-4)
    name = s.get_inputs()[0].name
    new = {name: np.random.default_rng(7).standard_normal(feeds[name].shape).astype(np.float32)}
    ins[name][...] = cp.asarray(new[name])  # copy into the bound buffer
    s.run_with_iobinding(b)
    assert s.fallbacks["replay_stream_sync"] == 1
    np.testing.assert_allclose(cp.asnumpy(outs[out_name]), cpu_ref(m, new)[0], rtol=2e-4, atol=2e-4)
    s.close()


@pytest.mark.device_memory
def test_replay_allocates_nothing(cp, genv):
    m = zoo.mlp(layers=4, hidden=64)
    s = graph_session(genv, m)
    b, _, _ = bind(cp, s, zoo.random_inputs(m))
    s.run_with_iobinding(b)
    ep = the_ep()
    pool_before, free_before = ep.memory.total_bytes(), cp.cuda.runtime.memGetInfo()[0]
    for _ in range(200):
        s.run_with_iobinding(b)
    assert ep.memory.total_bytes() == pool_before
    assert cp.cuda.runtime.memGetInfo()[0] == free_before
    assert ep.stats["capture_allocations"] == 0
    s.close()


def test_graph_ids_one_to_three(cp, genv):
    m = zoo.mlp(layers=2, hidden=32)
    feeds = zoo.random_inputs(m)
    s = graph_session(genv, m)
    b, ins, outs = bind(cp, s, feeds)
    for gid in (1, 2, 3):
        s.run_with_iobinding(b, ro_with(gpu_graph_id=gid))
    assert all(s.capture.captured(g) for g in (1, 2, 3)) and not s.capture.captured(0)
    for gid in (3, 1, 2):
        outs[s.get_outputs()[0].name][...] = 0
        s.run_with_iobinding(b, ro_with(gpu_graph_id=gid))
        np.testing.assert_allclose(cp.asnumpy(outs[s.get_outputs()[0].name]), cpu_ref(m, feeds)[0],
                                   rtol=2e-4, atol=2e-4)
    s.capture.release(2)
    assert not s.capture.captured(2)
    s.close()


@pytest.mark.parametrize("opts", [{"arena__use_cuda_mempool": "1"}, {"user_compute_stream": None}])
def test_capture_with_mempool_or_user_stream(cp, genv, opts):
    user = cp.cuda.Stream(non_blocking=True)
    if "user_compute_stream" in opts:
        opts = {"user_compute_stream": hex(user.ptr)}
    m = zoo.mlp(layers=3, hidden=64)
    feeds = zoo.random_inputs(m)
    s = graph_session(genv, m, **opts)
    b, _, outs = bind(cp, s, feeds)
    for _ in range(3):
        s.run_with_iobinding(b)
    assert s.capture.captured(0)
    np.testing.assert_allclose(cp.asnumpy(outs[s.get_outputs()[0].name]), cpu_ref(m, feeds)[0], rtol=2e-4, atol=2e-4)
    s.close()


def _long_model():
    # Heavy enough that one replay takes tens of milliseconds on an H100.
    return zoo.mlp(layers=24, hidden=4096, batch=4096)


def test_async_replay_returns_before_the_gpu_is_done(cp, genv):
    m = _long_model()
    feeds = zoo.random_inputs(m)
    s = graph_session(genv, m, use_tf32="0")
    b, ins, outs = bind(cp, s, feeds)
    s.run_with_iobinding(b)
    cp.cuda.Device().synchronize()
    cap = the_ep().graphs._tls.v.graphs[0]
    t0 = time.perf_counter()
    s.run_with_iobinding(b, ro_with(disable_synchronize_execution_providers=1))
    call = time.perf_counter() - t0
    assert not cap.state.stream.done  # still running when the call returned
    cap.state.stream.synchronize()
    total = time.perf_counter() - t0
    assert s.fallbacks["replay_async"] == 1
    assert call < total / 4, (call, total)
    out = cp.asnumpy(outs[s.get_outputs()[0].name])
    assert np.isfinite(out).all()
    s.close()


def test_v5_stream_sync_does_not_wait_for_another_sessions_graph(cp, genv):
    long_s = graph_session(genv, _long_model())
    lb, _, _ = bind(cp, long_s, zoo.random_inputs(long_s.graph.model))
    long_s.run_with_iobinding(lb)
    small = zoo.mlp(layers=2, hidden=32)
    feeds = zoo.random_inputs(small)
    small_s = graph_session(genv, small)
    sb, _, souts = bind(cp, small_s, feeds)
    small_s.run_with_iobinding(sb)
    cp.cuda.Device().synchronize()
    long_stream = the_ep().graphs  # noqa: F841 - kept for debugging
    long_s.run_with_iobinding(lb, ro_with(disable_synchronize_execution_providers=1))
    t0 = time.perf_counter()
    small_s.run_with_iobinding(sb)  # synchronous, but only on its own graph stream
    small_time = time.perf_counter() - t0
    busy = [not c.state.stream.done for ep in [o for o in sdk.runtime(f"_ephost_cuda_v{abi.ABI_VERSION}")._objects.values()
                                                if type(o).__name__ == "CudaEp"]
            for c in getattr(getattr(ep.graphs._tls, "v", None), "graphs", {}).values()]
    assert any(busy), "the long graph should still be running"
    cp.cuda.Device().synchronize()
    np.testing.assert_allclose(cp.asnumpy(souts[small_s.get_outputs()[0].name]), cpu_ref(small, feeds)[0],
                               rtol=2e-4, atol=2e-4)
    assert small_time < 0.01, small_time
    long_s.close()
    small_s.close()


def test_forced_capture_failure_falls_back_to_eager(cp, genv, caplog):
    m = zoo.mlp(layers=3, hidden=32)
    feeds = zoo.random_inputs(m)
    s = graph_session(genv, m, debug_force_capture_failure="1")
    b, _, outs = bind(cp, s, feeds)
    with pytest.warns(RuntimeWarning, match=r"did not capture graph 0 within \d+ runs; running eagerly"):
        s.run_with_iobinding(b)
    assert not s.capture.captured(0)
    assert the_ep().stats["capture_failures"] == 1
    np.testing.assert_allclose(cp.asnumpy(outs[s.get_outputs()[0].name]), cpu_ref(m, feeds)[0], rtol=2e-4, atol=2e-4)
    # no sticky CUDA error: the device still works
    assert float(cp.arange(4).sum()) == 6.0
    s.close()


def test_rebind_after_capture_is_an_error(cp, genv):
    m = zoo.mlp(layers=2, hidden=16)
    feeds = zoo.random_inputs(m)
    s = graph_session(genv, m)
    b, _, _ = bind(cp, s, feeds)
    s.run_with_iobinding(b)
    name = s.get_inputs()[0].name
    b.bind_input(name, cp.asarray(feeds[name]))
    with pytest.raises(GraphCaptureError, match=rf"^graph 0 was captured with input '{name}' at a fixed buffer"):
        s.run_with_iobinding(b)
    s.close()


def test_four_threads_with_their_own_graphs(cp, genv):
    m = zoo.mlp(layers=3, hidden=64)
    s = graph_session(genv, m)
    name = s.get_inputs()[0].name
    errors = []

    def worker(seed):
        # Each thread works on its own stream and synchronises only it: a device-wide sync (or the
        # legacy default stream) while another thread captures would invalidate that capture.
        try:
            rng = np.random.default_rng(seed)
            feeds = {name: rng.standard_normal((1, 64)).astype(np.float32)}
            mine = cp.cuda.Stream(non_blocking=True)
            with mine:
                b, ins, outs = bind(cp, s, feeds)
            for i in range(10):
                x = rng.standard_normal((1, 64)).astype(np.float32)
                with mine:
                    ins[name][...] = cp.asarray(x)
                mine.synchronize()
                s.run_with_iobinding(b)
                got = outs[s.get_outputs()[0].name].get(stream=mine)
                if i >= 3 and not np.allclose(got, cpu_ref(m, {name: x})[0], rtol=2e-4, atol=2e-4):
                    errors.append((seed, i))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s.close()
