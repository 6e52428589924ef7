"""Session profiling as onnxruntime users know it: a Chrome-trace JSON (Perfetto, chrome://tracing).

`SessionOptions.enable_profiling = True` makes the session record complete ("X") events with
`ts`/`dur` in microseconds since the profiler started, `pid`/`tid`, a category and arguments:

    cat "Session"  session_initialization, model_loading, optimization, partitioning, model_run
    cat "Node"     one event per node per run (CPU EP kernel, or a plugin kernel's Compute crossing)
    cat "Api"      ABI crossings that are not node kernels: OnRunStart/OnRunEnd, CopyTensors
    cat "Optimizer" one instant ("i") event per optimizer pass that changed the model, with its change
    cat "GPU"      for nodes of an EP on a GPU: kernel time from CUDA events on the node's stream
                   (CuPy), one track per stream, read when the profile is written

`InferenceSession.end_profiling()` writes the events as a JSON list (onnxruntime's format) to
`<profile_file_prefix>_<date>_<time>_<ms>.json`, as onnxruntime names it, and returns its path. With profiling off nothing here is on the run path: the session checks one
boolean per run, and run steps are only observed (StepObserver) when a profiler is on.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import abi
from host.errors import InvalidArgument
from host.plugins.hostapi import CONTEXTS, ffi

_WRITTEN: set[Path] = set()  # profile files this process wrote (never overwritten)
_ns = time.perf_counter_ns


class Profiler:
    """Collects trace events for one session until `end()` writes them."""

    enabled = True

    def __init__(self, prefix: str, session_name: str = ""):
        self.prefix = prefix or "ephost_profile_"
        self.session_name = session_name
        self.start_ns = _ns()
        self.start_time_ns = time.time_ns()  # wall clock of ts=0, for get_profiling_start_time_ns()
        self.pid = os.getpid()
        self.events: list[dict] = []
        self.on_end: list = []  # called before the trace is written (GPU timers read their events)
        self.notes: dict[str, str] = {}

    def record(self, name: str, cat: str, t0: int, t1: int, args: dict | None = None) -> None:
        """One complete event from perf_counter_ns stamps `t0`..`t1`."""
        event = {"cat": cat, "name": name, "ph": "X", "pid": self.pid, "tid": threading.get_native_id(),
                 "ts": (t0 - self.start_ns) / 1000.0, "dur": (t1 - t0) / 1000.0}
        if args:
            event["args"] = args
        self.events.append(event)  # list.append is atomic: concurrent runs need no lock

    def instant(self, name: str, cat: str, t: int, args: dict | None = None) -> None:
        """A point event ("ph": "i") at perf_counter_ns stamp `t`."""
        event = {"cat": cat, "name": name, "ph": "i", "s": "t", "pid": self.pid, "tid": threading.get_native_id(),
                 "ts": (t - self.start_ns) / 1000.0, "dur": 0.0}  # a dur as every event has, for scripts that sum them
        if args:
            event["args"] = args
        self.events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "Session", **args):
        t0 = _ns()
        try:
            yield
        finally:
            self.record(name, cat, t0, _ns(), args or None)

    def timed(self, fn, name: str, cat: str, args: dict | None = None):
        """`fn` wrapped so that each call records one event."""
        record = self.record

        def call(*a, **kw):
            t0 = _ns()
            try:
                return fn(*a, **kw)
            finally:
                record(name, cat, t0, _ns(), args)
        return call

    def end(self) -> str:
        """Write the trace and return its path."""
        for flush in self.on_end:
            flush()
        path = self._path()
        events = [self._metadata(), *sorted(self.events, key=lambda e: e["ts"])]
        try:
            if path.parent != Path("."):
                path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(events))
        except OSError as exc:
            raise InvalidArgument(f"cannot write the profile to '{path}' (profile_file_prefix "
                                  f"{self.prefix!r}): {exc.strerror or exc}") from exc
        _WRITTEN.add(path)
        return str(path)

    def _path(self) -> Path:
        """onnxruntime's name, `<prefix>_<YYYY-MM-DD>_<HH-MM-SS>_<milliseconds>.json` (the session's start,
        local time); a second profile of this process with the same name gets `_2`, `_3`... rather than
        overwriting the first."""
        seconds, ns = divmod(self.start_time_ns, 1_000_000_000)
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(seconds))
        base = f"{self.prefix}_{stamp}_{ns // 1_000_000:03d}"
        path, n = Path(f"{base}.json"), 1
        while path in _WRITTEN:
            n += 1
            path = Path(f"{base}_{n}.json")
        return path

    def _metadata(self) -> dict:
        # What onnxruntime's list has no place for (the producer, the wall clock of ts=0, notes such as
        # why GPU kernel times are missing) rides in one metadata event, which trace viewers skip.
        return {"cat": "__metadata", "name": "ephost", "ph": "M", "pid": self.pid, "tid": 0, "ts": 0.0, "dur": 0.0,
                "args": {"producer": "ephost", "session": self.session_name, "start_time_ns": self.start_time_ns,
                         **self.notes}}


class _NullProfiler:
    """Stands in when profiling is off: spans cost one call and record nothing."""

    enabled = False
    start_time_ns = 0

    def span(self, name: str, cat: str = "Session", **args):
        return contextlib.nullcontext()


NULL = _NullProfiler()


class StepObserver:
    """Times a session's run steps: built once with the steps (host/runtime/steps), never consulted
    on the run path of a session that does not profile.

    `node_call` wraps a node's call (a CPU kernel's `_run`, a plugin kernel's Compute slot, a compiled
    partition's Compute) so that each call records one "Node" event, plus a "GPU" event from CUDA
    events on the node's stream for nodes of an EP on a GPU (GpuTimer); `api_call` wraps a crossing
    that is not a node (CopyTensors, OnRunStart, OnRunEnd) as an "Api" event.
    """

    def __init__(self, profiler: Profiler, gpu: GpuTimer | None):
        self.profiler = profiler
        self.gpu = gpu

    @classmethod
    def create(cls, profiler: Profiler, plan, cuda=None) -> StepObserver:
        """The observer of `plan`'s steps; CUDA events through `cuda` (CuPy's `cupy.cuda`, imported
        when None and a GPU EP is in the plan)."""
        gpu = None
        if any(n.ep is not None and n.ep.location[0] == abi.DEVICE_GPU for n in plan.nodes):
            gpu = GpuTimer.create(profiler, cuda)
        return cls(profiler, gpu)

    def node_call(self, fn, node, kind: str):
        """`fn` timed as node `node`; `kind`: "cpu", "kernel" (Compute(kernel, context)) or "frame"
        (Compute(info, state, frame))."""
        args = {"op_name": node.op_type, "provider": node.provider, "node_index": node.index}
        members = getattr(node, "members", ())
        if members:
            args["fused_nodes"] = list(members)
        ep = node.ep
        if self.gpu is not None and ep is not None and ep.location[0] == abi.DEVICE_GPU:
            stream_of = _kernel_stream if kind == "kernel" else _frame_stream
            fn = self.gpu.wrap(fn, node.name, args, ep.location[1], stream_of)
        return self.profiler.timed(fn, node.name, "Node", args)

    def api_call(self, fn, name: str):
        return self.profiler.timed(fn, name, "Api")


def _kernel_stream(kernel_ptr, context) -> int:
    """The GPU stream of a per-node Compute(kernel, context) call: its kernel context's stream."""
    ctx = CONTEXTS.get(context)
    stream = getattr(ctx, "stream", None)
    if stream is None or stream.handle == ffi.NULL:
        return 0
    return int(ffi.cast("uintptr_t", stream.handle))


def _frame_stream(info_ptr, state, frame) -> int:
    """The GPU stream of a compiled partition's Compute(info, state, frame), 0 while capturing."""
    if frame == ffi.NULL or frame.stream == ffi.NULL or frame.capturing:
        return 0
    return int(ffi.cast("uintptr_t", frame.stream))


class GpuTimer:
    """Kernel time of GPU EP nodes from CUDA events recorded on the node's stream around Compute.

    Events are read when the profile is written (never during runs, which stay asynchronous):
    each node becomes a "GPU" event on a track per stream, placed on the host clock through a
    reference event recorded on that stream at its first use. Nothing is recorded on a stream
    that is capturing a CUDA graph. `cuda` is CuPy's `cupy.cuda` (or a stand-in with
    ExternalStream, Event, Device, get_elapsed_time and runtime.streamIsCapturing).
    """

    def __init__(self, profiler: Profiler, cuda):
        self.profiler = profiler
        self.cuda = cuda
        self.pending: list[tuple] = []            # (name, args, handle, start event, end event)
        self.refs: dict[int, tuple] = {}          # stream handle -> (reference event, perf_counter_ns)
        self.streams: dict[int, object] = {}
        profiler.on_end.append(self.flush)

    @classmethod
    def create(cls, profiler: Profiler, cuda=None):
        if cuda is None:
            try:
                import cupy.cuda as cuda  # the host already uses CuPy for DLPack hand-over
            except ImportError as exc:
                profiler.notes["gpu_kernel_time"] = f"not recorded: CuPy cannot be imported ({exc})"
                return None
        return cls(profiler, cuda)

    def wrap(self, fn, name: str, args: dict, device_id: int, stream_of):
        def call(*a):
            handle = stream_of(*a)
            if not handle:
                return fn(*a)
            with self.cuda.Device(device_id):
                stream = self._stream(handle)
                if self.cuda.runtime.streamIsCapturing(handle):
                    return fn(*a)
                self._reference(handle, stream)
                start = self.cuda.Event()
                start.record(stream)
                try:
                    return fn(*a)
                finally:
                    end = self.cuda.Event()
                    end.record(stream)
                    self.pending.append((name, args, handle, start, end))
        return call

    def _stream(self, handle: int):
        stream = self.streams.get(handle)
        if stream is None:
            stream = self.streams[handle] = self.cuda.ExternalStream(handle)
        return stream

    def _reference(self, handle: int, stream) -> None:
        if handle not in self.refs:
            ref = self.cuda.Event()
            ref.record(stream)
            self.refs[handle] = (ref, _ns())

    def flush(self) -> None:
        """Turn the recorded events into trace events (waits for them)."""
        p = self.profiler
        pending, self.pending = self.pending, []
        for name, args, handle, start, end in pending:
            end.synchronize()
            ref, ref_ns = self.refs[handle]
            t0 = ref_ns + int(self.cuda.get_elapsed_time(ref, start) * 1e6)
            t1 = t0 + int(self.cuda.get_elapsed_time(start, end) * 1e6)
            event = {"cat": "GPU", "name": name, "ph": "X", "pid": p.pid, "tid": _stream_track(handle),
                     "ts": (t0 - p.start_ns) / 1000.0, "dur": (t1 - t0) / 1000.0, "args": {**args, "gpu": True}}
            p.events.append(event)
        for handle in self.refs:
            p.events.append({"cat": "__metadata", "name": "thread_name", "ph": "M", "pid": p.pid,
                             "tid": _stream_track(handle),
                             "ts": 0.0, "args": {"name": f"GPU stream {handle:#x}"}})


def _stream_track(handle: int) -> int:
    # Chrome-trace tids are ints; keep stream tracks apart from OS thread ids (which are < 2**31).
    return (1 << 40) + (handle & 0xFFFFFFFFFF)


def record_passes(profiler: Profiler, result) -> None:
    """One instant event per optimizer pass that changed something, at the end of "optimization".

    The optimizer reports what each pass changed, not how long it took, so the passes are instants
    carrying the change as args; the "optimization" span holds the time of all of them.
    """
    span = next((e for e in reversed(profiler.events) if e["name"] == "optimization"), None)
    if span is None:
        return
    at = profiler.start_ns + int((span["ts"] + span["dur"]) * 1000)
    for r in getattr(result, "report", None) or []:
        profiler.instant(f"pass:{r.name}", "Optimizer", at,
                         {"nodes_before": r.nodes_before, "nodes_after": r.nodes_after, "change": str(r)})


def load(path: str | os.PathLike) -> list[dict]:
    """The events of a profile written by `Profiler.end()`: a JSON list, as onnxruntime writes."""
    return json.loads(Path(path).read_text())


def metadata(events: list[dict]) -> dict:
    """The args of the "ephost" metadata event (producer, session, start_time_ns, notes)."""
    return next(e["args"] for e in events if e["ph"] == "M" and e["name"] == "ephost")


__all__ = ["GpuTimer", "NULL", "Profiler", "StepObserver", "load", "metadata"]
