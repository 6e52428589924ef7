"""The CUDA EP through the host: models against the CPU EP, options observed, threads, lifetimes.

GPU tests run with `pytest -m gpu` on a machine with a GPU; the no-device path runs in CI.
"""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest

import abi
import host
from abi import sdk
from host.cli import zoo
from host.errors import InvalidArgument, KernelError
from host.runtime.session import InferenceSession, RunOptions
from plugin_cuda.options import OptionError, parse_options

CUDA = "CUDAExecutionProvider"
CUDA_MODULE = f"_ephost_cuda_v{abi.ABI_VERSION}"  # the module name build.py gives the CUDA plugin


# ---- options: parsed without a GPU -------------------------------------------------------------------
def test_options_defaults_and_prefixes():
    o = parse_options({"ep.cuda.device_id": "0", "use_tf32": "false", "gpu_external_alloc": "0x10",
                       "gpu_external_free": "4096"}, 1)
    assert (o.device_id, o.use_tf32, o.gpu_external_alloc, o.gpu_external_free) == (0, False, 16, 4096)
    assert parse_options({}, 1).min_num_runs_before_cuda_graph_capture == 2
    assert parse_options({"user_compute_stream": "0x1234"}, 1).unified_stream


@pytest.mark.parametrize("opts, message", [
    ({"bogus": "1"}, r"^unknown option 'bogus' for CUDAExecutionProvider; allowed: "),
    ({"use_tf32": "yes"}, r"^option use_tf32='yes': expected a boolean; allowed: 0, 1, true, false$"),
    ({"device_id": "3"}, r"^option device_id=3: no such CUDA device; allowed: 0\.\.0$"),
    ({"device_id": "-1"}, r"^option device_id='-1': must be >= 0$"),
    ({"user_compute_stream": "0xZZ"}, r"^option user_compute_stream='0xZZ': expected an address"),
    ({"gpu_external_alloc": "1"}, r"^option gpu_external_alloc needs both gpu_external_alloc and gpu_external_free"),
    ({"gpu_external_empty_cache": "1"}, r"^option gpu_external_empty_cache needs gpu_external_alloc"),
    ({"user_compute_stream": "1", "gpu_external_alloc": "1", "gpu_external_free": "2"},
     r"^options user_compute_stream and gpu_external_alloc cannot be combined"),
    ({"device_id": "0", "ep.cuda.device_id": "0"}, r"^option 'device_id' given twice"),
    ({"arena.max_mem": "1.5"}, r"^option arena.max_mem='1.5': expected a decimal integer"),
])
def test_bad_options_name_the_option(opts, message):
    with pytest.raises(OptionError, match=message):
        parse_options(opts, 1)


def test_no_device_falls_back_to_cpu_with_a_warning(cuda_plugin_path, monkeypatch):
    """CI's path: without a GPU the plugin loads, lists no device and the session runs on the CPU."""
    from plugin_cuda.plugin import probe_devices

    if probe_devices()[1]:
        pytest.skip("a CUDA device is present; this test covers machines without one")
    env = host.Environment()
    env.register_plugin("cuda", cuda_plugin_path)
    assert env.plugin("cuda").factories[0].devices == []
    m = zoo.mlp(layers=2, hidden=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = InferenceSession(m, providers=[CUDA], env=env)
    assert any("CUDAExecutionProvider has no device" in str(w.message) for w in caught)
    assert set(s.node_assignment().values()) == {"CPUExecutionProvider"}
    feeds = zoo.random_inputs(m)
    ref = InferenceSession(m).run(None, feeds)[0]
    np.testing.assert_allclose(s.run(None, feeds)[0], ref, rtol=1e-6)
    s.close()
    env.close()


# ---- GPU -------------------------------------------------------------------------------------------------
def cuda_eps():
    return [o for o in sdk.runtime(CUDA_MODULE)._objects.values() if type(o).__name__ == "CudaEp"]


def compare_with_cpu(genv, model, options=None, rtol=1e-4, atol=1e-5):
    feeds = zoo.random_inputs(model)
    ref = InferenceSession(model).run(None, feeds)
    s = InferenceSession(model, providers=[(CUDA, options or {"use_tf32": "0"})], env=genv)
    got = s.run(None, feeds)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol)
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("name, builder", [
    ("mlp", lambda: zoo.mlp(layers=4, hidden=64, batch=2)),
    ("mlp_gemm", lambda: zoo.mlp(layers=4, hidden=64, batch=2, use_gemm=True)),
    ("cnn", lambda: zoo.cnn(batch=2, size=16)),
    ("transformer", lambda: zoo.transformer_block(batch=1, seq=16, hidden=64, heads=4, ffn=128)),
])
def test_models_match_cpu_ep(genv, name, builder):
    # FP32 math (use_tf32=0): tolerances are those of float32 accumulation order differences.
    s = compare_with_cpu(genv, builder(), rtol=2e-4, atol=2e-4)
    on_gpu = [n for n, ep in s.node_assignment().items() if ep == CUDA]
    assert len(on_gpu) >= 0.8 * len(s.node_assignment()), s.node_assignment()
    s.close()


@pytest.mark.gpu
def test_tf32_is_within_tf32_tolerance(genv):
    # TF32 keeps 10 mantissa bits: relative error ~1e-3 per product, so rtol 2e-2 over 64-term sums.
    compare_with_cpu(genv, zoo.mlp(layers=3, hidden=64, batch=4), {"use_tf32": "1"}, rtol=2e-2, atol=2e-2).close()


@pytest.mark.gpu
def test_iobinding_with_cupy_buffers(genv):
    import cupy as cp

    m = zoo.mlp(layers=3, hidden=32, batch=4)
    feeds = zoo.random_inputs(m)
    ref = InferenceSession(m).run(None, feeds)[0]
    s = InferenceSession(m, providers=[(CUDA, {"use_tf32": "0"})], env=genv)
    b = s.io_binding()
    name = s.get_inputs()[0].name
    b.bind_input(name, cp.asarray(feeds[name]))
    out = cp.zeros(ref.shape, cp.float32)
    b.bind_output(s.get_outputs()[0].name, out)
    s.run_with_iobinding(b)
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-4, atol=1e-5)
    b.bind_output(s.get_outputs()[0].name)  # unbound: the EP allocates, DLPack hands it out
    s.run_with_iobinding(b)
    dev = b.get_outputs()[0]
    np.testing.assert_allclose(cp.asnumpy(cp.from_dlpack(dev)), ref, rtol=1e-4, atol=1e-5)
    s.close()


@pytest.mark.gpu
def test_bad_option_at_session_creation(genv):
    with pytest.raises(InvalidArgument, match=r"option use_tf32='maybe': expected a boolean"):
        InferenceSession(zoo.mlp(layers=1, hidden=8), providers=[(CUDA, {"use_tf32": "maybe"})], env=genv)
    # the environment is still usable
    compare_with_cpu(genv, zoo.mlp(layers=1, hidden=8)).close()


class CountingAllocator:
    """C functions (cffi callbacks) for the external-allocator options, with their own counters."""

    def __init__(self):
        import cffi
        import cupy as cp

        self.ffi = ffi = cffi.FFI()
        self.counts = {"alloc": 0, "free": 0, "empty": 0}
        self.live = {}

        @ffi.callback("void*(size_t)")
        def alloc(size):
            self.counts["alloc"] += 1
            ptr = cp.cuda.runtime.malloc(max(size, 1))
            self.live[ptr] = size
            return ffi.cast("void*", ptr)

        @ffi.callback("void(void*)")
        def free(p):
            self.counts["free"] += 1
            ptr = int(ffi.cast("uintptr_t", p))
            self.live.pop(ptr, None)
            cp.cuda.runtime.free(ptr)

        @ffi.callback("void(void)")
        def empty():
            self.counts["empty"] += 1

        self._callbacks = (alloc, free, empty)  # the addresses stay valid while this object lives

    def options(self) -> dict[str, str]:
        addr = [str(int(self.ffi.cast("uintptr_t", f))) for f in self._callbacks]
        return {"gpu_external_alloc": addr[0], "gpu_external_free": addr[1], "gpu_external_empty_cache": addr[2],
                "use_tf32": "0"}


@pytest.mark.gpu
def test_external_allocator_counts_and_is_per_session(genv):
    a, b = CountingAllocator(), CountingAllocator()
    s = compare_with_cpu(genv, zoo.mlp(layers=2, hidden=32), a.options())
    assert a.counts["alloc"] > 0
    before = dict(a.counts)
    other = compare_with_cpu(genv, zoo.mlp(layers=2, hidden=32))  # no external allocator
    assert a.counts["alloc"] == before["alloc"]
    changed = compare_with_cpu(genv, zoo.mlp(layers=2, hidden=32), b.options())  # new functions take effect
    assert b.counts["alloc"] > 0 and a.counts["alloc"] == before["alloc"]
    for sess in (other, s, changed):
        sess.close()
    gc.collect()
    for allocator in (a, b):
        assert allocator.counts["empty"] == 1
        assert allocator.counts["free"] == allocator.counts["alloc"] - len(allocator.live)


@pytest.mark.gpu
def test_user_compute_stream_carries_the_work(genv):
    import cupy as cp

    spin = cp.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }''', "spin")
    user = cp.cuda.Stream(non_blocking=True)
    m = zoo.mlp(layers=2, hidden=32, batch=2)
    feeds = zoo.random_inputs(m)
    ref = InferenceSession(m).run(None, feeds)[0]
    s = InferenceSession(m, providers=[(CUDA, {"user_compute_stream": hex(user.ptr), "use_tf32": "0"})], env=genv)
    assert s.fallbacks["serialised_runs"] == 1  # a user stream means one stream: no concurrent runs
    b = s.io_binding()
    name = s.get_inputs()[0].name
    with user:  # with a user stream, the caller orders its own writes on it
        x = cp.asarray(feeds[name])
        out = cp.zeros(ref.shape, cp.float32)
    b.bind_input(name, x)
    b.bind_output(s.get_outputs()[0].name, out)
    s.run_with_iobinding(b)  # the first run uploads the weights and waits for that upload
    with user:
        spin((1,), (1,), (np.int64(2_000_000_000),))  # ~1 s on the user's stream
    ro = RunOptions()
    ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
    s.run_with_iobinding(b, ro)
    assert not user.done  # the EP's work is queued behind the spin on the caller's stream
    user.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-4, atol=1e-5)
    s.close()
    assert user.done  # the borrowed stream was not destroyed: it still answers queries


@pytest.mark.gpu
@pytest.mark.parametrize("flag, key", [("1", "copies_default_stream"), ("0", "copies_compute_stream")])
def test_copies_follow_do_copy_in_default_stream(genv, flag, key):
    s = compare_with_cpu(genv, zoo.mlp(layers=2, hidden=16), {"do_copy_in_default_stream": flag, "use_tf32": "0"})
    ep = [e for e in cuda_eps() if e.opts.do_copy_in_default_stream == (flag == "1")][-1]
    assert ep.stats[key] >= 2  # the input host->device and the output device->host
    other = "copies_compute_stream" if key == "copies_default_stream" else "copies_default_stream"
    assert ep.stats[other] == 0
    s.close()


@pytest.mark.gpu
def test_stream_ordered_pool_and_max_mem(genv):
    compare_with_cpu(genv, zoo.mlp(layers=2, hidden=32), {"arena.use_cuda_mempool": "1", "use_tf32": "0"}).close()
    m = zoo.mlp(layers=2, hidden=1024, batch=1024)
    s = InferenceSession(m, providers=[(CUDA, {"arena.max_mem": str(1 << 20)})], env=genv)
    with pytest.raises(host.EphostError, match=r"out of memory .*requested \d+ bytes|CUDA out of memory: requested"):
        s.run(None, zoo.random_inputs(m))
    s.close()


@pytest.mark.gpu
def test_eight_threads_fifty_runs_concurrently(genv):
    m = zoo.mlp(layers=3, hidden=64, batch=2)
    s = InferenceSession(m, providers=[(CUDA, {"use_tf32": "0"})], env=genv)
    assert s.fallbacks["concurrent_runs"] == 1
    name = s.get_inputs()[0].name
    cpu = InferenceSession(m)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(50):
            x = rng.standard_normal((2, 64)).astype(np.float32)
            want = cpu.run(None, {name: x})[0]
            got = s.run(None, {name: x})[0]
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ep = cuda_eps()[-1]
    assert ep.stats["untagged_scratch"] == 0
    s.close()


@pytest.mark.gpu
def test_host_v3_means_untagged_scratch_and_serialised_runs(cuda_plugin_path):
    env = host.Environment(api_version=3)
    env.register_plugin("cuda3", cuda_plugin_path)
    m = zoo.mlp(layers=2, hidden=16)
    s = InferenceSession(m, providers=[(CUDA, {"use_tf32": "0"})], env=env)
    assert s.fallbacks["serialised_runs"] == 1
    feeds = zoo.random_inputs(m)
    np.testing.assert_allclose(s.run(None, feeds)[0], InferenceSession(m).run(None, feeds)[0], rtol=1e-4, atol=1e-5)
    assert sdk.runtime(CUDA_MODULE).record.fallbacks["no_concurrent_run_claim"] >= 1
    s.close()
    gc.collect()
    env.close()


@pytest.mark.gpu
@pytest.mark.device_memory
def test_thousand_sessions_return_memory_to_baseline(genv):
    import cupy as cp

    m = zoo.mlp(layers=2, hidden=64)
    feeds = zoo.random_inputs(m)
    gc.collect()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    for _ in range(1000):
        s = InferenceSession(m, providers=[CUDA], env=genv)
        s.run(None, feeds)
        s.close()
    gc.collect()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    assert free_before - free_after < 64 << 20, (free_before, free_after)  # cuBLAS/CuPy caches, no leak per session
    assert sum(1 for _ in cuda_eps()) == 0


@pytest.mark.gpu
def test_kernel_error_leaves_session_usable(genv):
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, "k"])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, ["k2", 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"], name="mm")], "g",
                                            [a, b], [y]), opset_imports=[helper.make_opsetid("", 17)])
    s = InferenceSession(m, providers=[(CUDA, {"use_tf32": "0"})], env=genv)
    assert s.node_assignment() == {"mm": CUDA}
    # Symbolic dims: a compiled partition planned per input-shape signature; the bad signature's plan
    # fails to build, names its shapes, and leaves nothing behind.
    with pytest.raises(KernelError, match=r"^fused node 'CUDAExecutionProvider_fused_0' \(nodes 'mm'\) on "
                                          r"CUDAExecutionProvider failed .* at input shapes \[\(2, 4\), \(5, 3\)\]: "
                                          r"MatMul node 'mm': MatMul got shapes \(2, 4\) and \(5, 3\)"):
        s.run(None, {"A": np.ones((2, 4), np.float32), "B": np.ones((5, 3), np.float32)})
    got = s.run(None, {"A": np.ones((2, 4), np.float32), "B": np.ones((4, 3), np.float32)})[0]
    np.testing.assert_allclose(got, np.full((2, 3), 4.0, np.float32))
    s.close()
