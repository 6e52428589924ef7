"""The packed GEMM (kernels_gemm.c, host/cpu_ep/packed_gemm.py): products beyond native.gemm_fits over a
bound weight, called directly against float64 NumPy at odd sizes and inside sessions against onnxruntime,
with a spy proving the compiled kernel ran."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from scipy.special import erf

from host.cpu_ep import native, packed_gemm
from host.optimizer import GraphOptimizationLevel
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.host import test_cpu_native
from tests.host.test_cpu_speed_paths import _ephost, _model, _ort

LIB = native.LIB
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture
def spy():
    assert LIB is not None, native.LOAD_ERROR
    s = test_cpu_native._Spy(LIB)
    native.use(s)
    yield s
    native.use(LIB)


def _packed(b: np.ndarray) -> np.ndarray:
    k, n = b.shape
    p = np.empty(LIB.ep_packed_b_size(k, n), np.float32)
    LIB.ep_pack_b(native.ptr(b), native.ptr(p), k, n, n, 1)
    return p


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (13, 257, 33), (25, 300, 77), (400, 520, 64), (7, 40, 31)])
@pytest.mark.parametrize("threads", [1, 3])
def test_packed_gemm_with_bias_gelu_and_residual_matches_float64(m, k, n, threads):
    """Row counts off the 12/8/4/2 tiles, K across several 256-row blocks, N off the 32-column panels,
    more rows than a 384-row block; the epilogue adds the residual after Gelu."""
    rng = np.random.default_rng(m * k + n)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    bias, res = rng.standard_normal(n, dtype=np.float32), rng.standard_normal((m, n), dtype=np.float32)
    y = np.empty((m, n), np.float32)
    prog = native.program([native.GELU, native.ADD])
    LIB.ep_gemm_packed(native.ptr(a), native.ptr(_packed(b)), native.ptr(bias), native.ptr(y), m, k, n, prog,
                       native.ptr(res), 0.0, 0.0, threads)
    z = a.astype(np.float64) @ b + bias
    want = 0.5 * z * (1 + erf(z / np.sqrt(2))) + res
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_pack_of_a_transposed_weight_equals_pack_of_its_copy():
    b = np.random.default_rng(0).standard_normal((45, 70), dtype=np.float32)
    bt = np.ascontiguousarray(b.T)  # (70, 45): element (k, n) of b at bt[n * 45 ... ] with strides (1, 45)
    p = np.empty(LIB.ep_packed_b_size(45, 70), np.float32)
    LIB.ep_pack_b(native.ptr(bt), native.ptr(p), 45, 70, 1, 45)
    np.testing.assert_array_equal(p, _packed(b))


def _large(op_nodes, k=520, n=300, rows=(2, 40), seed=0, **inits):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*rows, k), dtype=np.float32)
    w = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in inits.items()}
    return _model(op_nodes, {"x": x}, ["y"], w), {"x": x}


def test_matmul_over_a_large_weight_runs_the_packed_gemm(spy):
    model, feeds = _large([helper.make_node("MatMul", ["x", "w"], ["y"])], w=(520, 300))
    assert not native.gemm_fits(80, 520, 300)
    sess = _ephost(model)
    for _ in range(2):  # the second run reuses the packed weight
        got = sess.run(None, feeds)[0]
    assert spy.calls["ep_gemm_packed"] == 2 and spy.calls["ep_pack_b"] == 1
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)


def test_gemm_with_transposed_weight_and_bias_runs_the_packed_gemm(spy):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((70, 520), dtype=np.float32)
    w, c = rng.standard_normal((300, 520), dtype=np.float32), rng.standard_normal(300, dtype=np.float32)
    model = _model([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)], {"x": x}, ["y"], {"w": w, "c": c})
    got = _ephost(model).run(None, {"x": x})[0]
    assert spy.calls["ep_gemm_packed"] == 1
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], **TOL)


def test_fused_matmul_gelu_chain_over_a_large_weight_matches_onnxruntime(spy):
    """The optimizer fuses MatMul + Add(bias) + Gelu (+ a residual Add) into FusedMatMul and a chain; the
    packed GEMM runs the whole epilogue, at two threads (the session's bound)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Gelu", ["hb"], ["g"]), helper.make_node("Add", ["g", "r"], ["y"])]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 50, 520), dtype=np.float32)
    inits = {"w": rng.standard_normal((520, 300), dtype=np.float32), "b": rng.standard_normal(300, dtype=np.float32),
             "r": rng.standard_normal((3, 50, 300), dtype=np.float32)}
    model = _model(nodes, {"x": x}, ["y"], inits, opset=20)
    so = SessionOptions()
    so.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 2
    sess = InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0]
    assert spy.calls["ep_gemm_packed"] == 1
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], **TOL)


def test_an_activation_times_a_large_activation_keeps_blas(spy):
    """Only declared weights are packed: a product of two inputs stays with NumPy."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((80, 520), dtype=np.float32), rng.standard_normal((520, 300), dtype=np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x, "w": w}, ["y"], {})
    got = _ephost(model).run(None, {"x": x, "w": w})[0]
    assert spy.calls["ep_gemm_packed"] == 0
    np.testing.assert_allclose(got, _ort(model, {"x": x, "w": w})[0], **TOL)


def test_packed_weight_is_dropped_with_its_weight():
    b = np.ones((8, 8), np.float32)
    packed_gemm.declare_weight(b)
    packed_gemm.packed(LIB, b)
    key = id(b)
    assert packed_gemm.serves(b) and key in packed_gemm._PACKED
    del b
    assert key not in packed_gemm._PACKED and key not in packed_gemm._WEIGHTS


def test_thread_share_is_the_run_bound_inside_runs_and_1_outside():
    from host.runtime.threads import Pools

    pools = Pools(libraries=[])
    assert pools.share() == 1
    pools.enter(3)
    assert pools.share() == 3
    pools.leave(3)
    assert pools.share() == 1


def test_thread_count_is_the_bound_with_enough_work_each(monkeypatch):
    monkeypatch.setattr(packed_gemm.threads.POOLS, "share", lambda: 16)
    macs = packed_gemm.THREADED_MACS
    assert [packed_gemm.thread_count(n) for n in (1, macs - 1, macs, 3 * macs, 100 * macs)] == [1, 1, 1, 3, 16]


def _product(seed: int, m=150, k=300, n=520):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)
    return a, _packed(b), bias, a.astype(np.float64) @ b + bias


def _run_packed(a, bp, bias, n, threads):
    m, k = a.shape
    y = np.full((m, n), np.nan, np.float32)
    LIB.ep_gemm_packed(native.ptr(a), native.ptr(bp), native.ptr(bias), native.ptr(y), m, k, n, 0, native.NULL,
                       0.0, 0.0, threads)
    return y


@pytest.mark.parametrize("n", [520, 64, 33])
def test_the_same_bits_at_every_thread_count(n):
    """Each output is computed whole by one thread of the pool, in the same order, whoever claims its unit
    (n=64: two panels, one unit; n=33: two panels, the second partial)."""
    a, bp, bias, want = _product(n, n=n)
    one = _run_packed(a, bp, bias, n, 1)
    np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-3)
    for threads in (2, 3, 8, 64, 100):
        np.testing.assert_array_equal(_run_packed(a, bp, bias, n, threads), one)


def test_the_pool_starts_its_workers_once():
    _run_alone_until_the_pool_is_back()  # an earlier straggler (a loaded machine) leaves products to run alone
    a, bp, bias, _ = _product(1)
    _run_packed(a, bp, bias, 520, 3)
    started = LIB.ep_pool_workers()
    assert started >= 2
    for _ in range(20):
        _run_packed(a, bp, bias, 520, 3)
    assert LIB.ep_pool_workers() == started


def test_products_from_many_threads_at_once_are_each_right():
    """Runs of several sessions at once: one product has the pool, the others compute alone; none waits
    on another's units or writes into another's output."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [_product(seed, m=40 + seed, n=256 + 32 * seed) for seed in range(6)]
    ones = [_run_packed(a, bp, bias, bias.size, 1) for a, bp, bias, _ in cases]

    def work(i):
        a, bp, bias, _ = cases[i % len(cases)]
        return i, _run_packed(a, bp, bias, bias.size, 4)

    with ThreadPoolExecutor(8) as ex:
        for i, y in ex.map(work, range(96)):
            np.testing.assert_array_equal(y, ones[i % len(cases)])


def test_a_forked_child_computes_with_a_fresh_pool():
    """A child forked after the pool started has none of its workers: the child's product starts new ones
    (a child that waited on its parent's workers would hang; the subprocess has a deadline)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, sys
        import numpy as np
        from tests.host.test_cpu_packed_gemm import LIB, _product, _run_packed
        a, bp, bias, want = _product(7)
        before = _run_packed(a, bp, bias, 520, 3)
        pid = os.fork()
        if pid == 0:
            ok = LIB.ep_pool_workers() == 0 and np.array_equal(_run_packed(a, bp, bias, 520, 3), before)
            os._exit(0 if ok and LIB.ep_pool_workers() >= 2 else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_library_whose_pool_started_stays_mapped_after_its_handle_is_closed(tmp_path):
    """The workers sleep inside the library's code: a copy of it opened, used with threads and closed by
    its opener stays mapped (a worker woken in unmapped code would crash the process), while a copy that
    never started a pool is unmapped as usual."""
    import shutil
    import subprocess
    import sys
    import textwrap

    used, idle = tmp_path / "used.so", tmp_path / "idle.so"
    for copy in (used, idle):
        shutil.copyfile(native.LOADED_FROM, copy)
    code = textwrap.dedent(f"""
        import sys
        from host.cpu_ep import native
        from tests.host.test_cpu_packed_gemm import _product, _packed
        import numpy as np
        def mapped(path):
            return path in open("/proc/self/maps").read()
        for path, threads in (({str(used)!r}, 3), ({str(idle)!r}, 1)):
            lib = native.ffi.dlopen(path)
            a, bp, bias, want = _product(2)
            y = np.empty((a.shape[0], bias.size), np.float32)
            lib.ep_gemm_packed(native.ptr(a), native.ptr(bp), native.ptr(bias), native.ptr(y), a.shape[0],
                               a.shape[1], bias.size, 0, native.NULL, 0.0, 0.0, threads)
            assert np.allclose(y, want, rtol=1e-4, atol=1e-3)
            assert (lib.ep_pool_workers() >= 2) == (threads == 3)
            native.ffi.dlclose(lib)
            print(path, mapped(path))
    """)
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(used), "True", str(idle), "False"]


def _run_alone_until_the_pool_is_back():
    a, bp, bias, _ = _product(1)
    for _ in range(5000):
        if LIB.ep_pool_skip() == 0:
            return
        _run_packed(a, bp, bias, 520, 3)
    raise AssertionError(f"{LIB.ep_pool_skip()} products still to run alone after 5000")


def test_a_straggler_sends_the_next_products_to_the_calling_thread_alone():
    """kernels_pool.c's back-off: after a wait for a descheduled worker (longer than 100 us and than the
    caller's own share), the next 16 products run on the caller alone, with the same bits; the count
    doubles while stragglers recur and starts again at 16 after a product without one."""
    _run_alone_until_the_pool_is_back()
    LIB.ep_pool_note(10_000, 1_000)  # a product without a straggler
    LIB.ep_pool_note(50_000, 2_000_000)  # 2 ms waiting for a worker, after 50 us of its own claims
    assert LIB.ep_pool_skip() == 16
    a, bp, bias, _ = _product(3)
    one = _run_packed(a, bp, bias, 520, 1)
    for left in range(15, -1, -1):
        np.testing.assert_array_equal(_run_packed(a, bp, bias, 520, 3), one)
        assert LIB.ep_pool_skip() == left
    LIB.ep_pool_note(50_000, 2_000_000)  # another, before any product without one
    assert LIB.ep_pool_skip() == 32
    LIB.ep_pool_note(10_000, 1_000)
    LIB.ep_pool_note(50_000, 2_000_000)
    assert LIB.ep_pool_skip() == 16
    _run_alone_until_the_pool_is_back()


@pytest.mark.parametrize("claimed_ns, waited_ns", [(10_000, 90_000), (10_000_000, 5_000_000)])
def test_short_or_proportionate_waits_are_not_stragglers(claimed_ns, waited_ns):
    """Under 100 us, or shorter than the caller's own share (a large product's last units): no back-off."""
    _run_alone_until_the_pool_is_back()
    LIB.ep_pool_note(claimed_ns, waited_ns)
    assert LIB.ep_pool_skip() == 0
