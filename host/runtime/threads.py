"""The CPU EP's thread pools, bounded per run as onnxruntime's `intra_op_num_threads` bounds its pool.

The CPU EP's only multithreaded code is BLAS (NumPy's and SciPy's OpenBLAS, or whatever BLAS they
were built with): the other NumPy kernels and the compiled kernels (host/cpu_ep/native) are
single-threaded, with no OpenMP. So a session's bound is the thread count of every BLAS library
loaded in the process, set through threadpoolctl for the duration of each run and restored after it.

BLAS pools are process-wide, so one coordinator (`POOLS`) serves every session: the first run to
enter saves the caller's counts, the last to leave restores them, and while several runs are inside
at once each gets an equal share of the smallest bound among them (two concurrent runs bounded to 4
use 2 BLAS threads each), so concurrent sessions never ask for more threads than one session's bound.
threadpoolctl is called only when a count must change: a run whose bound matches the current counts
costs one read per library and a lock.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

_SYSFS_CPU = Path("/sys/devices/system/cpu")


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this OS: every CPU
        return set(range(os.cpu_count() or 1))


@functools.cache
def physical_cores() -> int:
    """The physical cores this process may run on (onnxruntime's default intra-op pool size).

    A core counts when at least one of its hardware threads is in the process's affinity mask (so SMT
    siblings count once, and `taskset`/cgroup cpusets shrink it). Read from Linux's sysfs topology;
    where that is missing, the number of CPUs the process may use."""
    cpus = _allowed_cpus()
    cores = set()
    for cpu in cpus:
        topo = _SYSFS_CPU / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def resolve(intra_op_num_threads: int) -> int:
    """The thread count a session runs with: its option, or physical_cores() for 0 (the default)."""
    return intra_op_num_threads or physical_cores()


class Pools:
    """Every BLAS library's thread count, shared by all runs of the process (see the module doc)."""

    def __init__(self, libraries=None):
        self._lock = threading.Lock()
        self._libs = libraries  # threadpoolctl LibControllers; found at the first run when None
        self._owned_scan = libraries is None  # given libraries (tests' stand-ins) are never rescanned
        self._bounds: list[int] = []  # the bounds of the runs inside now
        self._saved: list[int] = []  # the caller's counts, restored when the last run leaves
        self._applied: int | None = None  # the count set on every library, None: the caller's
        self._handles: tuple[list, list] | None = None  # (libraries, their (get, set) pairs: _handles)

    def libraries(self) -> list:
        """The BLAS libraries loaded now (threadpoolctl's controllers), found at the first run and again
        after each session creation (`bounded`): a library loaded later (SciPy's or torch's own BLAS)
        is then bounded too."""
        if self._libs is None:
            from threadpoolctl import ThreadpoolController

            self._libs = ThreadpoolController().select(user_api="blas").lib_controllers
        return self._libs

    @staticmethod
    def _release_control() -> None:
        # threadpoolctl >= 3.8 lets one Python thread at a time set OpenBLAS's process-wide pool (others
        # are silently ignored) and hands control back when a threadpool_limits block ends; do the same
        # after each change, so the next run may set it from any thread. Our lock orders the changes.
        clear = _clear_controlling_thread()
        if clear is not None:
            clear()

    def share(self) -> int:
        """The thread count of the runs inside now (the compiled kernels that split work use it): the
        bound applied to the BLAS libraries, or 1 outside runs and while the caller's counts apply."""
        return self._applied or 1

    def counts(self) -> list[int]:
        """Each BLAS library's current thread count."""
        return [lib.num_threads for lib in self.libraries()]

    def bounded(self, threads: int) -> Bound:
        """A reusable context manager: its block runs with the BLAS libraries at `threads` threads (less
        while other runs are in). A session makes one at creation; a run only enters it."""
        with self._lock:
            if not self._bounds and self._libs is not None and self._owned_scan:
                self._libs = None  # scanned again at the next run: libraries may have been loaded since
        return Bound(self, threads)

    def _calls(self, libs: list) -> list:
        """The (get, set) pair of each library (see _handles), made once per scan of the libraries."""
        handles = self._handles
        if handles is None or handles[0] is not libs:
            handles = self._handles = (libs, [_handles(lib) for lib in libs])
        return handles[1]

    def enter(self, threads: int) -> None:
        """A run bounded to `threads` starts (pair with leave(threads) in a finally)."""
        with self._lock:
            libs = self._libs if self._libs is not None else self.libraries()
            if not self._bounds:
                saved = self._saved = [get() for get, _ in self._calls(libs)]  # the caller's: read per run
                self._bounds.append(threads)
                if saved.count(threads) == len(saved):  # the common case: nothing to set, nothing to restore
                    self._applied = threads
                    return
            else:
                self._bounds.append(threads)
            self._apply(libs)

    def leave(self, threads: int) -> None:
        """The run bounded to `threads` ended: re-share the bound, or restore the caller's counts."""
        with self._lock:
            bounds = self._bounds
            bounds.remove(threads)
            if bounds:
                self._apply(self._libs)
                return
            applied, self._applied = self._applied, None
            if self._saved.count(applied) != len(self._saved):
                self._set(self._libs, [applied] * len(self._libs), self._saved)

    def _apply(self, libs) -> None:
        # An equal share of the smallest bound, so runs inside at once stay within it together.
        bounds = self._bounds
        share = bounds[0] if len(bounds) == 1 else max(1, min(bounds) // len(bounds))
        if share != self._applied:
            current = self._saved if self._applied is None else [self._applied] * len(libs)
            self._set(libs, current, [share] * len(libs))
            self._applied = share

    def _set(self, libs, current: list[int], wanted: list[int]) -> None:
        took_control = False
        for (_, set_count), have, want in zip(self._calls(libs), current, wanted):
            if have != want:
                took_control |= set_count(want)
        if took_control:
            self._release_control()


def _handles(lib) -> tuple:
    """(get count, set count) of one threadpoolctl controller; set returns whether it went through
    threadpoolctl (which may have made this thread OpenBLAS's controlling thread: _release_control).

    For OpenBLAS with its own threads, threadpoolctl's calls cost a few microseconds each (symbol
    lookups, its controlling-thread protocol), which a run at one row pays four to six times: while
    no thread controls OpenBLAS, OpenBLAS's C functions are called directly, which is what threadpoolctl
    would do (and then hand control back). Other libraries and layers go through threadpoolctl."""
    direct = _openblas_functions(lib)
    if direct is None:
        return lib.get_num_threads, lambda n: lib.set_num_threads(n) or True
    get, set_direct = direct
    shared = getattr(type(lib), "_SHARED_STATE", None)  # threadpoolctl >= 3.8: the controlling thread

    def set_count(n: int) -> bool:
        if shared is None or shared.controlling_thread is None:
            set_direct(n)
            return False
        lib.set_num_threads(n)  # a thread holds control: threadpoolctl decides (it may do nothing)
        return True

    return get, set_count


def _openblas_functions(lib):
    """OpenBLAS's openblas_get/set_num_threads of a threadpoolctl controller (with its symbol affixes),
    None for anything else (MKL, BLIS, OpenBLAS on OpenMP, test stand-ins)."""
    if getattr(lib, "internal_api", None) != "openblas" or getattr(lib, "threading_layer", None) == "openmp":
        return None
    try:
        get, set_ = lib._get_symbol("openblas_get_num_threads"), lib._get_symbol("openblas_set_num_threads")
    except AttributeError:  # a threadpoolctl without the symbol lookup
        return None
    return None if get is None or set_ is None else (get, set_)


@functools.cache
def _clear_controlling_thread():
    """threadpoolctl's OpenBLASController.clear_controlling_thread, None before 3.8 (looked up once:
    an import statement per change costs about a microsecond)."""
    from threadpoolctl import OpenBLASController

    return getattr(OpenBLASController, "clear_controlling_thread", None)


class Bound:
    """`with bound:` runs the block under Pools.enter/leave of one thread count; reusable, no state."""

    __slots__ = ("_enter", "_leave", "_threads")

    def __init__(self, pools: Pools, threads: int):
        self._enter, self._leave, self._threads = pools.enter, pools.leave, threads

    def __enter__(self) -> None:
        self._enter(self._threads)

    def __exit__(self, *exc) -> None:
        self._leave(self._threads)


def plan_calls_blas(plan) -> bool:
    """Whether a run of `plan` may call BLAS: any node not on the CPU EP (a plugin's host code), any
    control-flow body, or any CPU kernel that does not declare `uses_blas = False`. A plan that cannot
    (a tree ensemble, a scaler) runs without the per-run bound, whose threadpoolctl calls would cost
    more than the model (a set and a restore per library when the caller's count differs)."""
    if plan.subgraphs:
        return True
    return any(node.ep is not None or getattr(node.kernel, "uses_blas", True) for node in plan.nodes)


POOLS = Pools()


__all__ = ["POOLS", "Bound", "Pools", "physical_cores", "plan_calls_blas", "resolve"]
