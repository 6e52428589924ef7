"""CUDA graph capture and replay for the CUDA EP (seeds 002 and 003).

Graphs are kept per thread and per annotation id (`gpu_graph_id`), so a thread never replays
a graph captured on another thread's stream. Capture starts at the first kernel of the run
after the warm-up runs (the EP learns its stream there), in relaxed capture mode, and ends
in OnRunEnd, which then launches the graph once: a capture run computes nothing by itself.
Every allocation of an id's warm-up and capture runs comes from a memory pool private to that
(thread, id): the warm-up runs fill it, so capture allocates nothing new, blocks freed during
capture are reused inside the graph only, and after capture nobody else allocates from it, so
replays own their memory. A capture that fails is ended, the sticky error is cleared, the
kernels recorded so far run eagerly, and that id runs eagerly from then on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import abi
from abi.sdk import PluginError
from plugin_cuda.device.capture import CAPTURE_MODE_RELAXED, clear_sticky_error

_log = logging.getLogger("ephost.plugin_cuda")
# Relaxed capture: an allocation the warmed pool cannot serve then succeeds (the graph's private
# pool keeps it, and on_run_end reports it) instead of invalidating the capture, which thread-local
# mode does. Other threads are unaffected in either mode.
_CAPTURE_MODE = CAPTURE_MODE_RELAXED


@dataclass
class Captured:
    graph: object
    state: object
    keep: list


@dataclass
class Capturing:
    gid: int
    state: object
    pool_before: int
    keep: list = field(default_factory=list)
    calls: list = field(default_factory=list)


class ThreadGraphs:
    def __init__(self) -> None:
        self.pools: dict[int, object] = {}
        self.active_pool = None
        self.graphs: dict[int, Captured] = {}
        self.runs: dict[int, int] = {}
        self.failed: set[int] = set()
        self.pending: int | None = None
        self.capturing: Capturing | None = None
        self.state = None  # the stream state this thread's kernels last ran on
        self.listed = False  # in GraphManager._threads (close() releases it)


def _release_thread(t: ThreadGraphs) -> None:
    """Synchronise a thread's graphs' streams, then drop its graphs and free its private pools."""
    for cap in t.graphs.values():
        try:
            cap.state.stream.synchronize()  # a graph may still be running on its stream
        except Exception:  # noqa: BLE001 - releasing goes on
            pass
        cap.keep.clear()
    t.graphs.clear()
    t.runs.clear()
    t.failed.clear()
    for pool in t.pools.values():
        pool.free_all_blocks()
    t.pools.clear()
    t.active_pool = None


class GraphManager:
    def __init__(self, ep):
        self.ep = ep
        self._tls = threading.local()
        self._threads: list[ThreadGraphs] = []
        self._lock = threading.Lock()

    def _t(self) -> ThreadGraphs:
        t = getattr(self._tls, "v", None)
        if t is None or not t.listed:
            if t is None:
                t = self._tls.v = ThreadGraphs()
            with self._lock:
                self._threads.append(t)
            t.listed = True
        return t

    # -- warm-up and capture --------------------------------------------------------------
    def malloc(self):
        """The allocator for the calling thread: its graph's private pool during warm-up/capture."""
        t = self._tls.__dict__.get("v")
        if t is not None and t.active_pool is not None:
            return t.active_pool.malloc
        return self.ep.memory.allocator

    def pool_bytes(self) -> int:
        t = self._tls.__dict__.get("v")
        pool = t.active_pool if t is not None else None
        return int(pool.total_bytes()) if pool is not None else self.ep.memory.total_bytes()

    def on_run_start(self, run_options: dict[str, str]) -> None:
        if not self.ep.opts.enable_cuda_graph:
            return
        gid = int(run_options.get("gpu_graph_id", "0"))
        t = self._t()
        t.active_pool = None
        if gid == -1 or gid in t.graphs or gid in t.failed:
            return
        if self.ep.memory.external is None:  # the external allocator owns all memory: no private pool
            pool = t.pools.get(gid)
            if pool is None:
                with self.ep.device:
                    pool = t.pools[gid] = self.ep.cupy.cuda.MemoryPool()
            t.active_pool = pool
        t.runs[gid] = t.runs.get(gid, 0) + 1
        # At least one warm-up run: it fills the graph's private pool, so capture allocates nothing
        # (thread-local capture forbids cudaMalloc). The host runs it inside the same first call.
        if t.runs[gid] > max(1, self.ep.opts.min_num_runs_before_cuda_graph_capture):
            t.pending = gid

    def before_kernel(self, state) -> None:
        t = self._tls.__dict__.get("v")
        if t is None:
            return
        t.state = state
        if t.pending is None:
            return
        gid, t.pending = t.pending, None
        state.cublas  # noqa: B018 - create the handle and its workspace before capture
        before = self.pool_bytes()
        state.stream.begin_capture(mode=_CAPTURE_MODE)
        t.capturing = Capturing(gid, state, before)
        if self.ep.opts.debug_force_capture_failure:
            # Checked here, where a capture begins, not on every kernel: the caller's capture-failure
            # path (abort, then run eagerly) sees it as the first kernel's failure.
            raise RuntimeError("capture failure forced by debug_force_capture_failure=1")

    def capture_keep(self) -> list | None:
        """The list of objects this thread's capture in progress keeps for its graph, or None."""
        t = self._tls.__dict__.get("v")
        return t.capturing.keep if t is not None and t.capturing is not None else None

    def capturing(self) -> bool:
        t = self._tls.__dict__.get("v")
        return t is not None and t.capturing is not None

    def record(self, adapter, call, state) -> None:
        t = self._tls.__dict__.get("v")
        if t is not None and t.capturing is not None:
            t.capturing.calls.append((adapter, call, state))

    def abort_capture(self, exc: BaseException) -> None:
        t = self._t()
        c, t.capturing = t.capturing, None
        try:
            c.state.stream.end_capture()
        except Exception:  # noqa: BLE001 - an invalidated capture raises here too
            pass
        clear_sticky_error(self.ep.cupy)
        t.failed.add(c.gid)
        self.ep.stats["capture_failures"] = self.ep.stats.get("capture_failures", 0) + 1
        message = f"CUDA graph capture of graph {c.gid} failed ({exc}); that graph id runs eagerly from now on"
        _log.warning("%s", message)
        self.ep.api.log(self.ep.logger, abi.header().constants["EP_LOG_WARNING"], message)
        # The kernels recorded during capture did not run: run them now.
        for adapter, call, state in c.calls:
            adapter.launch_recorded(call, state)

    def on_run_end(self):
        """Ends this thread's capture, if one is open, and launches the graph once (the capture run's
        results); returns the stream state it launched on, which the caller synchronises when the run
        asks for it (one synchronisation per run, OnRunEnd's), else None."""
        t = self._tls.__dict__.get("v")
        if t is None:
            return None
        t.pending = None
        c = t.capturing
        if c is None:
            t.active_pool = None
            return None
        t.capturing = None
        graph = c.state.stream.end_capture()
        grew = self.pool_bytes() - c.pool_before
        t.active_pool = None
        if grew > 0:
            self.ep.stats["capture_allocations"] += 1
            _log.warning("CUDA graph %s: %d bytes of device memory were allocated during capture", c.gid, grew)
        t.graphs[c.gid] = Captured(graph, c.state, c.keep)
        graph.launch(c.state.stream)
        return c.state

    # -- replay and release ----------------------------------------------------------------
    def captured(self, gid: int) -> bool:
        t = self._tls.__dict__.get("v")
        return t is not None and gid in t.graphs

    def replay(self, gid: int, sync: bool) -> None:
        t = self._t()
        cap = t.graphs.get(gid)
        if cap is None:
            raise PluginError(f"CUDA graph {gid} was not captured on this thread; captured here: "
                              f"{sorted(t.graphs)}", abi.EP_INVALID_ARGUMENT)
        cap.state.after_default_stream()
        cap.graph.launch(cap.state.stream)
        if sync:
            cap.state.stream.synchronize()

    def release(self, gid: int) -> None:
        t = self._t()
        cap = t.graphs.pop(gid, None)
        t.runs.pop(gid, None)
        if cap is not None:
            cap.state.stream.synchronize()  # the graph may still be running on its stream
            cap.keep.clear()
        pool = t.pools.pop(gid, None)
        if pool is not None:
            pool.free_all_blocks()

    def forget_state(self, state) -> None:
        """Release the graphs and pools of the threads whose stream `state` is being destroyed
        (their thread ended): without it every thread that ever captured keeps its graphs and
        their memory for the session's life."""
        with self._lock:
            gone = [t for t in self._threads if t.state is state
                    or any(cap.state is state for cap in t.graphs.values())]
            self._threads = [t for t in self._threads if t not in gone]
        for t in gone:
            _release_thread(t)
            t.state, t.listed = None, False

    def close(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for t in threads:
            _release_thread(t)
