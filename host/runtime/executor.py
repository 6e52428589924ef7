"""The executor: runs a Plan as a list of prepared steps (host/runtime/steps), one RunState per thread.

Steps are built once per plan (a segment of CPU nodes, a plugin kernel, a compiled partition, a
control-flow node); per thread, each step gets its context (kernel contexts, call frames, their C
arrays and the thread's streams) once, and a run only refills them. Values crossing EP boundaries
are copied through the EP's data-transfer table (`input_for`, `transfer`), and a consumer on another
stream waits for its producer through the producer stream's notification.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref

import numpy as np

import abi
from abi.dtypes import to_numpy, to_onnx
from host.errors import EpError, EphostError, ModelError
from host.plugins import hostapi
from host.plugins.ep import CPU_LOCATION, PluginEp, SyncStream
from host.plugins.hostapi import ffi
from host.runtime.plan import Kind, Plan
from host.runtime.program_copies import ProgramCopies
from host.runtime.shape_program import DEFAULT_CAPACITY
from host.runtime.steps import build_steps
from host.runtime.tensor import Allocation, DeviceTensor, host_array

_NULL = ffi.NULL


class RunState:
    """Per-thread execution state of a session: step contexts, streams, the values of a run."""

    def __init__(self, executor: Executor, streams: dict[int, SyncStream | None]):
        self.executor = executor
        self.plan = executor.plan
        self.streams = streams
        self.values: list = [None] * len(self.plan.value_names)
        self.bound_outputs: dict[int, object] = {}
        self.capturing = False  # set per run: the run belongs to a graph capture (v6 call frames say so)
        self.producer: dict[int, SyncStream] = {}
        self.keep: list = []  # copies made for this run: alive until the next run starts
        # Graph outputs on a device that a CPU node read (st.values then holds the host copy): the
        # device originals, which a subgraph hands on so that loop-carried values stay on the device.
        self.device_outputs: dict[int, object] = {}
        self.shape_cache: dict[tuple, object] = {}
        self.contexts: list = []
        # (step, this thread's context for it, values to free after it), in run order.
        self.prepared: list[tuple] = []
        for step, frees in executor.steps:
            ep = getattr(step, "ep", None)  # plugin and compiled steps run on an EP's stream
            ctx = step.context(self, streams.get(id(ep)) if ep is not None else None)
            if ctx is not None:
                self.contexts.append(ctx)
            self.prepared.append((step, ctx, frees))

    def close(self) -> None:
        for c in self.contexts:
            c.close()
        self.contexts.clear()
        self.prepared = []
        # Values of the last run go now, while their allocators exist: a traceback that still
        # references this state (a failed run) must not carry them past the plugin's release.
        self.values = [None] * len(self.values)
        self.keep.clear()
        self.device_outputs.clear()
        self.bound_outputs = {}

    # -- values ------------------------------------------------------------------------------
    def shape_array(self, shape: tuple):
        arr = self.shape_cache.get(shape)
        if arr is None:
            arr = self.shape_cache[shape] = ffi.new("int64_t[]", shape or (0,))
        return arr

    def fill(self, t, value) -> None:
        """Describe `value` (NumPy array or DeviceTensor) in the EpTensor `t`."""
        if isinstance(value, np.ndarray):
            t.data = ffi.from_buffer(value) if value.size else _NULL
            t.device_type, t.device_id = abi.DEVICE_CPU, 0
        else:
            t.data = ffi.cast("void*", value.ptr)
            t.device_type, t.device_id = value.device_type, value.device_id
        t.elem_type = self.executor.elem_type_of(value.dtype)
        shape = value.shape
        t.shape = self.shape_array(shape)
        t.ndim = len(shape)
        t.nbytes = value.nbytes

    def make_output(self, vid: int, dims: tuple, ep: PluginEp, stream):
        bound = self.bound_outputs.get(vid)
        dtype = self.executor.dtype_of(vid)
        if bound is not None:
            if tuple(bound.shape) == dims and bound.dtype == dtype and location_of(bound) == ep.location:
                self.values[vid] = bound
                return bound
        if ep.location == CPU_LOCATION:
            # Host memory comes from NumPy (no crossing into the plugin), except for an EP that
            # captures graphs: the graph must own the memory it replays into, so it allocates.
            value = (np.empty(dims, dtype) if ep.allocator is None or not self.executor.ep_allocates_host
                     else host_array(ep.allocator, dims, dtype, stream.ptr if stream else None))
        else:
            nbytes = max(math.prod(dims) * dtype.itemsize, 1)
            alloc = Allocation(ep.allocator, nbytes, stream.ptr if stream else None, ep.owner)
            value = DeviceTensor(alloc.ptr, dims, dtype, ep.location[0], ep.location[1], alloc, stream)
        self.values[vid] = value
        return value


def _dtype(elem_type: int, name: str) -> np.dtype:
    try:
        return to_numpy(elem_type)
    except TypeError as exc:
        raise ModelError(f"value '{name}': {exc}") from None


def location_of(value) -> tuple[int, int]:
    """(device type, device id) of a run value; host values that are not tensors live on the CPU."""
    if isinstance(value, DeviceTensor):
        return (value.device_type, value.device_id)
    return CPU_LOCATION  # NumPy arrays, and sequences / maps, which hold host arrays


class _ThreadToken:
    __slots__ = ("__weakref__",)


def _release_state(executor_ref, state_ref) -> None:
    # Weak references only: a finalizer must not keep a closed session's executor alive.
    executor, st = executor_ref(), state_ref()
    if executor is not None and st is not None:
        executor._release(st)


class Executor:
    """Runs a Plan; one RunState per thread (or one shared, when runs are serialised).

    `observer`: a profiler's (host/runtime/profiling.StepObserver), which times every step and
    crossing; None (the default) leaves the run path without any check for it."""

    def __init__(self, plan: Plan, concurrent: bool, ep_allocates_host: bool = False, observer=None,
                 transfer_eps=None, subgraph: bool = False, program_capacity: int = DEFAULT_CAPACITY):
        self.plan = plan
        # EPs whose data transfer copies may use: every EP of the session, not only those holding nodes
        # (an output of the CPU EP bound to a device buffer goes through that device's EP).
        self._transfer_eps = list(plan.eps if transfer_eps is None else transfer_eps)
        self.concurrent = concurrent
        self.ep_allocates_host = ep_allocates_host
        self._tls = threading.local()
        self._states: list[RunState] = []
        self._lock = threading.Lock()
        self._dtypes = [_dtype(t, name) if t else None for t, name in zip(plan.elem_types, plan.value_names)]
        self._etype_cache: dict[np.dtype, int] = {}
        self._shared: RunState | None = None
        # Initializers copied to a device once and reused by every run (weights stay resident).
        self._device_constants: dict[tuple[int, tuple[int, int]], object] = {}
        # The shape program's values copied to a device once per signature (program_copies.py).
        self.program_copies = ProgramCopies(program_capacity)
        self.steps, prelude = build_steps(plan, observer)
        # What a run starts from, built once: initializers (and Identity outputs over them) in
        # place, every other value None.
        self._blank = [None] * len(plan.value_names)
        # A subgraph's outputs that a CPU node read on the host are handed on as their device originals
        # (RunState.device_outputs); the main graph's outputs are fetched to the host anyway.
        self._handed_on_ids = frozenset(plan.output_ids.values()) if subgraph else frozenset()
        for vid, arr in (*plan.constants.items(), *prelude):
            self._blank[vid] = arr
        if observer is not None:
            self.transfer = observer.api_call(self.transfer, "CopyTensors")
            self.on_run_start = observer.api_call(self.on_run_start, "OnRunStart")
            self.on_run_end = observer.api_call(self.on_run_end, "OnRunEnd")

    def dtype_of(self, vid: int) -> np.dtype:
        dt = self._dtypes[vid]
        if dt is None:
            raise EpError(f"value '{self.plan.value_names[vid]}' has no inferred element type")
        return dt

    def elem_type_of(self, dtype) -> int:
        et = self._etype_cache.get(dtype)
        if et is None:
            et = self._etype_cache[dtype] = to_onnx(dtype)
        return et

    def state(self) -> RunState:
        st = getattr(self._tls, "state", None)
        if st is not None:
            return st
        with self._lock:
            if not self.concurrent and self._shared is not None:
                self._tls.state = self._shared
                return self._shared
            streams = {id(ep): ep.create_stream() for ep in self.plan.eps}
            st = RunState(self, streams)
            self._states.append(st)
            if not self.concurrent:
                self._shared = st
        self._tls.state = st
        if self.concurrent:
            # A thread's state (kernel contexts, plugin streams) goes when the thread does: thread-local
            # storage drops the token at thread exit. Otherwise short-lived threads (run_async makes
            # one per call) would grow the session without bound.
            token = self._tls.token = _ThreadToken()
            weakref.finalize(token, _release_state, weakref.ref(self), weakref.ref(st))
        return st

    def _release(self, st: RunState) -> None:
        with self._lock:
            if st not in self._states:
                return  # the session closed first
            self._states.remove(st)
        st.close()
        eps = {id(ep): ep for ep in self.plan.eps}
        for key, stream in st.streams.items():
            if stream is not None:
                eps[key].release_stream(stream)

    def close(self) -> None:
        with self._lock:  # a thread's exit may be releasing its state at the same time
            states, self._states = self._states, []
        for st in states:
            st.close()
        for sub in self.plan.subgraphs:
            sub.close()
        self._shared = None
        self._device_constants.clear()
        self.program_copies.clear()
        self._tls = threading.local()

    # -- one run ---------------------------------------------------------------------------------
    def on_run_start(self, c_ro) -> None:
        """OnRunStart of every EP with nodes in the plan (or its subgraphs)."""
        for ep in self.plan.eps:
            if ep.slots.OnRunStart is not None:
                hostapi.check(ep.slots.OnRunStart(ep.ptr, c_ro), f"{ep.owner}: OnRunStart")

    def on_run_end(self, c_ro, sync: bool, failed: bool = False) -> None:
        """OnRunEnd of every EP of the plan; after a failed run their statuses are dropped (the run's
        own error is the one raised)."""
        for ep in self.plan.eps:
            if ep.slots.OnRunEnd is not None:
                status = ep.slots.OnRunEnd(ep.ptr, c_ro, int(sync))
                if failed:
                    if status != _NULL:
                        hostapi.STATUSES.release(status)
                    continue
                hostapi.check(status, f"{ep.owner}: OnRunEnd")

    def execute(self, st: RunState, feeds: dict[int, object], subgraph: bool = False) -> None:
        vals = st.values
        vals[:] = self._blank  # every value None but the initializers (one copy, not a loop per value)
        for vid, v in feeds.items():
            vals[vid] = v
        st.producer.clear()
        st.keep.clear()
        st.device_outputs.clear()
        if subgraph:
            # A device value fed into a subgraph was written on its producer's stream: consumers on
            # other streams wait for it, as for values produced inside (DeviceTensor.stream).
            for vid, v in feeds.items():
                stream = getattr(v, "stream", None) if isinstance(v, DeviceTensor) else None
                if stream is not None:
                    st.producer[vid] = stream
        for step, ctx, frees in st.prepared:
            step(st, ctx)
            for v in frees:
                vals[v] = None

    def run_subgraph(self, feeds: dict[int, object], output_ids: list[int]) -> list:
        """One run of a subgraph plan on this thread's state; its outputs where they were made.
        Host arrays a plugin stream wrote are waited for here (their stream is not carried along)."""
        st = self.state()
        self.execute(st, feeds, subgraph=True)
        vals = st.values
        kept = st.device_outputs
        outs = [kept.get(i, vals[i]) for i in output_ids] if kept else [vals[i] for i in output_ids]
        if st.producer:
            for vid, v in zip(output_ids, outs):
                stream = st.producer.get(vid)
                if stream is not None and isinstance(v, np.ndarray):
                    stream.notify_and_wait(None)
        return outs

    def input_for(self, st: RunState, vid: int, location, stream: SyncStream | None, ep: PluginEp | None):
        """Value `vid` where a consumer at `location` (on `stream`, of `ep`; None: the host) reads it:
        waited for on its producer's stream, copied across devices when it lives elsewhere."""
        value = st.values[vid]
        if value is None:
            if vid in self.plan.object_ids:
                return None  # an empty optional
            raise EpError(f"value '{self.plan.value_names[vid]}' was not produced")
        producer = st.producer.get(vid)
        if producer is not None and producer is not stream:
            producer.notify_and_wait(stream if location != CPU_LOCATION else None)
            st.producer.pop(vid, None)
        if location_of(value) == location:
            if ep is not None and isinstance(value, np.ndarray) and not value.flags.c_contiguous:
                # Plugins see pointer + shape, no strides: views of the CPU EP must be made dense.
                value = st.values[vid] = np.asarray(value, order="C")
            return value
        if vid in self.plan.constants:
            return self._device_constant(vid, value, location, ep, stream)
        if vid in self.plan.host_computed and location != CPU_LOCATION:
            return self._program_copy(vid, value, location, ep, stream)
        moved = self.transfer(value, location, ep, stream)
        if location == CPU_LOCATION:
            if vid in self._handed_on_ids:
                st.device_outputs[vid] = value
            st.values[vid] = moved
        else:
            st.keep.append(moved)  # the kernel reads it after this returns
            sink = self._tls.__dict__.get("copies")
            if sink is not None:  # a capture run: the graph's replays read this copy again
                sink.append(moved)
        return moved

    @contextlib.contextmanager
    def keeping_copies(self, sink: list):
        """While inside, the calling thread's host-to-device copies are also appended to `sink`."""
        self._tls.copies = sink
        try:
            yield
        finally:
            self._tls.copies = None

    def _program_copy(self, vid: int, value, location, ep: PluginEp | None, stream: SyncStream | None):
        sink = self._tls.__dict__.get("copies")
        moved = self.program_copies.get(vid, location, value)
        if moved is None:
            moved = self.transfer(value, location, ep, stream)
            if stream is not None and sink is None:  # (no host wait on a stream being captured)
                stream.notify_and_wait(None)  # other threads read this copy on their own streams
            moved = self.program_copies.put(vid, location, value, moved)
        if sink is not None:  # a capture run: the graph keeps the copy its replays read
            sink.append(moved)
        return moved

    def upload_constants(self) -> int:
        """Copy now the initializers that per-node kernels of plugin EPs read on their device (run 1 copied
        them: BERT's and GPT-2's embedding tables, 17-23 ms of run 1 on an H200; issue 29). The copies run
        on no run's stream, so each EP that took some is synchronised once (Ep.Sync: the CUDA plugin also
        finishes there its replay of a context's warm-ups); an EP without Sync keeps them in run 1.
        Returns how many were copied."""
        host_computed = getattr(self.plan, "host_computed", frozenset())
        wanted: dict[tuple, tuple] = {}
        for node in self.plan.nodes:
            ep = node.ep
            if node.kind is not Kind.PLUGIN or ep is None or ep.slots.Sync is None:
                continue
            for vid in node.inputs:
                if vid in self.plan.constants and vid not in host_computed:
                    value = self._blank[vid]
                    if location_of(value) != ep.location:
                        wanted[(vid, ep.location)] = (vid, value, ep)
        synced: dict[int, PluginEp] = {}
        for vid, value, ep in wanted.values():
            try:
                self._device_constant(vid, value, ep.location, ep, None)
            except EphostError:  # out of the EP's memory limit, say: run 1 tries again and reports it
                continue
            synced[id(ep)] = ep
        for ep in synced.values():
            hostapi.check(ep.slots.Sync(ep.ptr), f"{ep.owner}: Sync")
        return sum(1 for key in wanted if key in self._device_constants)

    def _device_constant(self, vid: int, value, location, ep: PluginEp | None, stream: SyncStream | None):
        key = (vid, location)
        moved = self._device_constants.get(key)
        if moved is None:
            moved = self.transfer(value, location, ep, stream)
            if stream is not None:
                # Other threads reuse this copy at once, on their own streams: let it land first.
                stream.notify_and_wait(None)
            # Two threads may race here: the first copy stored is the one everybody keeps
            # (returning a copy that nothing holds would free it before the kernel runs).
            moved = self._device_constants.setdefault(key, moved)
        return moved

    # -- copies across EPs -----------------------------------------------------------------------
    def transfer(self, value, location, ep: PluginEp | None, stream: SyncStream | None):
        """Copy `value` to `location` with the data-transfer table of the EP on the device side
        (`ep` when given and on a device, else the EP at the device end of the copy)."""
        device_ep = ep if ep is not None and location != CPU_LOCATION else self._device_ep(location_of(value), location)
        if device_ep is None or device_ep.transfer is None:
            how = "" if device_ep is None else (f"; {device_ep.owner} gave none (EpFactory.CreateDataTransfer is "
                                                "NULL or returned no table)")
            raise EpError(f"no data transfer can copy from {location_of(value)} to {location}{how}")
        src = ffi.new("EpTensor*")
        dst = ffi.new("EpTensor*")
        st = self.state()
        if isinstance(value, np.ndarray):
            value = np.asarray(value, order="C")
        st.fill(src, value)
        if location == CPU_LOCATION:
            out = np.empty(value.shape, value.dtype)
        else:
            nbytes = max(value.nbytes, 1)
            alloc = Allocation(device_ep.allocator, nbytes, stream.ptr if stream else None, device_ep.owner)
            out = DeviceTensor(alloc.ptr, value.shape, value.dtype, location[0], location[1], alloc, stream)
        st.fill(dst, out)
        streams = ffi.new("EpSyncStream*[1]", [stream.ptr if stream is not None else _NULL])
        t = device_ep.transfer
        hostapi.check(t.CopyTensors(t.ptr, src, dst, streams, 1), f"{device_ep.owner}: CopyTensors")
        return out

    def _device_ep(self, source, target) -> PluginEp | None:
        """The EP whose data transfer copies between `source` and `target`: the one at the device
        end (the source's when both are devices)."""
        return self.ep_at(source if source != CPU_LOCATION else target)

    def ep_at(self, location) -> PluginEp | None:
        for ep in self._transfer_eps:
            if ep.location == location:
                return ep
        return None

    def copy_into(self, target: DeviceTensor, value, name: str) -> None:
        """Copy a run's output `value` into the caller's device buffer `target` (same shape and dtype).
        A buffer filled from elsewhere (an output of the CPU EP, as onnxruntime copies it) takes one copy
        straight into it through the EP of the *target* device; any EP of the session may serve it,
        even one the plan gives no node. A value on another device goes through the host."""
        where = (target.device_type, target.device_id)
        ep = self.ep_at(where)
        if ep is None or ep.transfer is None:
            raise EpError(f"output '{name}' is bound to device memory at {where}; no execution provider of this "
                          f"session copies into it (session EPs at: {sorted({e.location for e in self._transfer_eps})})")
        if isinstance(value, DeviceTensor) and location_of(value) != where:
            value = self.to_host(value)
        elif isinstance(value, np.ndarray):
            value = np.asarray(value, order="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
        src, dst = ffi.new("EpTensor*"), ffi.new("EpTensor*")
        st = self.state()
        st.fill(src, value)
        st.fill(dst, target)
        stream = getattr(value, "stream", None) if isinstance(value, DeviceTensor) else None
        streams = ffi.new("EpSyncStream*[1]", [stream.ptr if stream is not None else _NULL])
        t = ep.transfer
        hostapi.check(t.CopyTensors(t.ptr, src, dst, streams, 1), f"{ep.owner}: CopyTensors")

    def to_host(self, value):
        if not isinstance(value, DeviceTensor):  # arrays, and lists / dicts / None of non-tensor values
            return value
        # On the producer's stream, so the copy follows the EP's copy-stream options and is ordered
        # after the kernel that wrote the value.
        return self.transfer(value, CPU_LOCATION, None, getattr(value, "stream", None))


__all__ = ["Executor", "RunState", "location_of"]
