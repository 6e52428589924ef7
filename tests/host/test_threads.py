"""intra_op_num_threads: every BLAS pool the CPU EP uses runs at the session's bound during a run, the
caller's counts come back after it (also after a failing run), 0 means the physical cores, and
concurrent runs share the bound. Counts are read with threadpoolctl's own threadpool_info(), not
through host.runtime.threads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
from onnx import TensorProto, helper
from threadpoolctl import OpenBLASController, ThreadpoolController, threadpool_info, threadpool_limits

from host.errors import InvalidArgument, KernelError
from host.runtime import threads
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession

pytestmark = pytest.mark.skipif(not any(i["user_api"] == "blas" for i in threadpool_info()),
                                reason="threadpoolctl finds no BLAS library in this process: nothing to bound")


def blas_counts() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def matmul_session(bound: int) -> InferenceSession:
    a, b, c = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [64, 64]) for n in "ABC")
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"], name="mm")], "mm", [a, b], [c])
    so = SessionOptions()
    so.intra_op_num_threads = bound
    return InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), so)


def spy_on_kernel(sess, sync=None, fail=False):
    """Record the BLAS counts each time the session's one kernel runs (its call in the CPU segment
    step, where a profiler's observer would wrap it); `sync()` runs before and after the reading,
    `fail` makes the kernel raise."""
    segment = sess.executor.steps[0][0]
    node, original, *rest = segment.steps[0]
    seen = []

    def spy(*args):
        if sync is not None:
            sync()
        seen.append(blas_counts())
        if sync is not None:
            sync()
        if fail:
            raise RuntimeError("planted failure")
        return original(*args)

    segment.steps[0] = (node, spy, *rest)
    return seen


@contextmanager
def callers_count(n: int):
    """The caller's BLAS count is `n` in the block, without the caller keeping threadpoolctl's control of
    OpenBLAS (a threadpool_limits block keeps it, and then other threads cannot change the count)."""
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.num_threads for lib in libs]
    for lib in libs:
        lib.set_num_threads(n)
    OpenBLASController.clear_controlling_thread()
    try:
        yield
    finally:
        for lib, count in zip(libs, before):
            lib.set_num_threads(count)
        OpenBLASController.clear_controlling_thread()


FEEDS = {"A": np.ones((64, 64), np.float32), "B": np.ones((64, 64), np.float32)}


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_the_count_inside_a_run_is_the_bound_and_the_callers_comes_back(bound):
    sess = matmul_session(bound)
    seen = spy_on_kernel(sess)
    with threadpool_limits(limits=5, user_api="blas"):  # the caller's own setting, unlike any bound
        np.testing.assert_allclose(sess.run(None, FEEDS)[0], FEEDS["A"] @ FEEDS["B"])
        assert seen and all(c == bound for c in seen[0])
        assert set(blas_counts()) == {5}


def test_the_callers_count_comes_back_after_a_failing_run():
    sess = matmul_session(1)
    seen = spy_on_kernel(sess, fail=True)
    with threadpool_limits(limits=3, user_api="blas"):
        with pytest.raises(KernelError, match=r"^node .mm. \(MatMul\) on CPUExecutionProvider failed: planted failure$"):
            sess.run(None, FEEDS)
        assert seen == [[1] * len(seen[0])]
        assert set(blas_counts()) == {3}


def test_default_is_the_physical_cores():
    sess = matmul_session(0)
    seen = spy_on_kernel(sess)
    with threadpool_limits(limits=7, user_api="blas"):
        sess.run(None, FEEDS)
    assert set(seen[0]) == {threads.physical_cores()}


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="lscpu (util-linux) is the reference and is missing")
def test_physical_cores_counts_cores_of_the_affinity_mask_as_lscpu_does():
    done = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True)
    allowed = os.sched_getaffinity(0)
    rows = [line.split(",") for line in done.stdout.splitlines() if line and not line.startswith("#")]
    assert threads.physical_cores() == len({(s, c) for cpu, c, s in rows if int(cpu) in allowed})


def test_a_narrower_affinity_mask_gives_fewer_cores():
    # In a child: the affinity change and the cached count must not touch this process.
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from host.runtime import threads; print(threads.physical_cores())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "1"


def test_concurrent_runs_share_the_smallest_bound_and_restore_the_callers_count():
    barrier = threading.Barrier(2, timeout=30)
    sessions = [matmul_session(4), matmul_session(2)]
    together = [True]

    def sync():  # both runs are inside together while they read the counts
        if together[0]:
            barrier.wait()

    seen = [spy_on_kernel(s, sync=sync) for s in sessions]
    with callers_count(3):
        workers = [threading.Thread(target=s.run, args=(None, FEEDS)) for s in sessions]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        # min(4, 2) // 2 runs: one thread each, two in all, within the smaller bound
        assert [set(s[0]) for s in seen] == [{1}, {1}]
        assert set(blas_counts()) == {3}
    together[0] = False
    sessions[0].run(None, FEEDS)  # alone again: its own bound
    assert set(seen[0][1]) == {4}


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_invalid_bounds_are_typed_errors(value):
    so = SessionOptions()
    with pytest.raises(InvalidArgument, match=r"^SessionOptions.intra_op_num_threads must be an integer >= 0; "
                                              rf"got {value!r}$".replace("(", r"\(").replace(".", r"\.")):
        so.intra_op_num_threads = value


def test_inter_op_num_threads_is_accepted_and_listed_as_without_effect():
    from host.runtime.options import SESSION_OPTIONS

    so = SessionOptions()
    so.inter_op_num_threads = 3
    assert so.inter_op_num_threads == 3 and not SESSION_OPTIONS["inter_op_num_threads"].honoured


def test_a_pools_object_sets_counts_only_when_they_change():
    class FakeLib:  # threadpoolctl's LibController surface: num_threads, get_num_threads, set_num_threads
        def __init__(self, n):
            self.num_threads, self.sets = n, []

        def get_num_threads(self):
            return self.num_threads

        def set_num_threads(self, n):
            self.sets.append(n)
            self.num_threads = n

    same, other = FakeLib(2), FakeLib(8)
    pools = threads.Pools([same, other])
    for _ in range(3):
        with pools.bounded(2):
            assert (same.num_threads, other.num_threads) == (2, 2)
    assert same.sets == [] and other.sets == [2, 8, 2, 8, 2, 8]
    assert other.num_threads == 8
