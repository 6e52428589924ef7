"""The execution plan: nodes in topological order, each on the CPU EP or a plugin EP.

Per-run work is kept to what must happen per run: plugin kernel contexts, their EpKernelIO
structs and shape arrays are built once per thread and only refilled. Values crossing EP
boundaries are copied through the EP's data-transfer table, and a consumer on another stream
waits for its producer through the producer stream's notification.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

import abi
from abi.dtypes import to_numpy, to_onnx
from host.cpu_ep.runner import run_plan
from host.errors import EpError, EphostError, InvalidArgument, KernelError, ModelError
from host.plugins import hostapi
from host.plugins.ep import CPU_LOCATION, PluginEp, SyncStream
from host.plugins.hostapi import CONTEXTS, ffi
from host.runtime.compiled import FrameContext
from host.runtime.tensor import Allocation, DeviceTensor, check_output_dims, host_array

_NULL = ffi.NULL


@dataclass
class PlanNode:
    index: int
    name: str
    op_type: str
    inputs: tuple[int, ...]      # value ids, -1 for absent optional inputs
    outputs: tuple[int, ...]
    ep: PluginEp | None           # None: the CPU EP
    kernel: object                # CPU OpKernel, the plugin kernel's Slots, or a CompiledPartition
    frees: tuple[int, ...] = ()   # values whose last consumer is this node
    members: tuple[str, ...] = ()  # a compiled partition (ABI v6): the names of the nodes it fused


@dataclass
class Plan:
    nodes: list[PlanNode]
    value_ids: dict[str, int]
    value_names: list[str]
    elem_types: list[int]
    input_ids: dict[str, int]
    output_ids: dict[str, int]
    constants: dict[int, np.ndarray]
    eps: list[PluginEp] = field(default_factory=list)
    # Values whose declared type is not a tensor (lists, None, dicts: host/runtime/types.py).
    object_ids: frozenset[int] = frozenset()
    # The prepared subgraphs of control-flow nodes (host/runtime/subgraph.py), closed with the plan.
    subgraphs: list = field(default_factory=list)


def compute_frees(nodes: list[PlanNode], keep: set[int]) -> None:
    last: dict[int, int] = {}
    for pos, n in enumerate(nodes):
        for v in (*n.inputs, *n.outputs):
            if v >= 0:
                last[v] = pos
    by_pos: dict[int, list[int]] = {}
    for v, pos in last.items():
        if v not in keep:
            by_pos.setdefault(pos, []).append(v)
    for pos, n in enumerate(nodes):
        n.frees = tuple(by_pos.get(pos, ()))


class KernelContext:
    """What one plugin node sees during Compute on one thread; `handle` is the C pointer."""

    def __init__(self, run: RunState, node: PlanNode, stream: SyncStream | None):
        self.run = run
        self.node = node
        self.ep = node.ep
        self.inputs = ffi.new("EpTensor[]", max(len(node.inputs), 1))
        self.outputs = ffi.new("EpTensor[]", max(len(node.outputs), 1))
        self.io = ffi.new("EpKernelIO*")
        self.io.struct_size = ffi.sizeof("EpKernelIO")
        self.io.version = abi.ABI_VERSION
        self.io.num_inputs, self.io.num_outputs = len(node.inputs), len(node.outputs)
        self.io.inputs = self.inputs
        self.stream = stream
        self.sync_stream = stream.ptr if stream is not None else None
        self.io.gpu_compute_stream = stream.handle if stream is not None else _NULL
        self.active = False  # True only during Compute: a kept context is refused afterwards
        self.handle, self.key, self._holder = CONTEXTS.add(self)
        self.compute = node.kernel.Compute
        self.kernel_ptr = node.kernel.ptr

    def get_output(self, index: int, dims: tuple):
        if not 0 <= index < len(self.node.outputs):
            raise InvalidArgument(f"output index {index} out of range 0..{len(self.node.outputs) - 1}")
        vid = self.node.outputs[index]
        check_output_dims(dims, self.run.executor.dtype_of(vid), f"output {index} of node '{self.node.name}'")
        value = self.run.make_output(vid, dims, self.ep, self.stream)
        self.run.fill(self.outputs[index], value)
        return self.outputs + index

    def close(self) -> None:
        CONTEXTS.remove(self.key)


class RunState:
    """Per-thread execution state of a session: contexts, streams, the values of a run."""

    def __init__(self, executor: Executor, streams: dict[int, SyncStream | None]):
        self.executor = executor
        self.plan = executor.plan
        self.streams = streams
        self.values: list = [None] * len(self.plan.value_names)
        self.bound_outputs: dict[int, object] = {}
        self.capturing = False  # set per run: the run belongs to a graph capture (v6 call frames say so)
        self.producer: dict[int, SyncStream] = {}
        self.keep: list = []  # copies made for this run: alive until the next run starts
        self.shape_cache: dict[tuple, object] = {}
        self.contexts: dict[int, KernelContext] = {}
        for n in self.plan.nodes:
            if n.ep is not None:
                make = FrameContext if n.members else KernelContext
                self.contexts[n.index] = make(self, n, streams.get(id(n.ep)))

    def close(self) -> None:
        for c in self.contexts.values():
            c.close()
        self.contexts.clear()
        # Values of the last run go now, while their allocators exist: a traceback that still
        # references this state (a failed run) must not carry them past the plugin's release.
        self.values = [None] * len(self.values)
        self.keep.clear()
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
            t.elem_type = self.executor.elem_type_of(value.dtype)
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
            if tuple(bound.shape) == dims and bound.dtype == dtype and _location(bound) == ep.location:
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


# Host values that are not tensors: a sequence as a list, a map as a dict (ZipMap, DictVectorizer).


def _location(value) -> tuple[int, int]:
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
    """Runs a Plan; one RunState per thread (or one shared, when runs are serialised)."""

    def __init__(self, plan: Plan, concurrent: bool, ep_allocates_host: bool = False, transfer_eps=None):
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
        # What a run starts from, built once: initializers in place, every other value None.
        self._blank = [None] * len(plan.value_names)
        for vid, arr in plan.constants.items():
            self._blank[vid] = arr
        self._keep_outputs = set(plan.output_ids.values())
        # Every node on the CPU EP: runs take the CPU EP's own loop (host/cpu_ep/runner.py).
        self._cpu_only = not plan.eps and all(n.ep is None for n in plan.nodes)

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
        self._tls = threading.local()

    # -- one run ---------------------------------------------------------------------------------
    def execute(self, st: RunState, feeds: dict[int, object], subgraph: bool = False) -> None:
        vals = st.values
        vals[:] = self._blank  # every value None but the initializers (one copy, not a loop per value)
        for vid, v in feeds.items():
            vals[vid] = v
        st.producer.clear()
        st.keep.clear()
        keep_outputs = self._keep_outputs
        if subgraph:
            # A device value fed into a subgraph was written on its producer's stream: consumers on
            # other streams wait for it, as for values produced inside (DeviceTensor.stream).
            for vid, v in feeds.items():
                stream = getattr(v, "stream", None) if isinstance(v, DeviceTensor) else None
                if stream is not None:
                    st.producer[vid] = stream
        if self._cpu_only:
            for v in feeds.values():
                if isinstance(v, DeviceTensor):  # a device feed, and no EP here that can read it
                    raise EpError(f"no data transfer can copy from {_location(v)} to {CPU_LOCATION}")
            run_plan(self.plan.nodes, vals, keep_outputs, self.plan.value_names, owner=self)
            return
        for node in self.plan.nodes:
            if node.ep is None:
                self._run_cpu(st, node)
            elif node.members:
                st.contexts[node.index].execute(self, st.capturing)
            else:
                self._run_plugin(st, node)
            for v in node.frees:
                if v not in keep_outputs:
                    vals[v] = None

    def run_subgraph(self, feeds: dict[int, object], output_ids: list[int]) -> list:
        """One run of a subgraph plan on this thread's state; its outputs where they were made.
        Host arrays a plugin stream wrote are waited for here (their stream is not carried along)."""
        st = self.state()
        self.execute(st, feeds, subgraph=True)
        vals = st.values
        outs = [vals[i] for i in output_ids]
        if st.producer:
            for vid, v in zip(output_ids, outs):
                stream = st.producer.get(vid)
                if stream is not None and isinstance(v, np.ndarray):
                    stream.notify_and_wait(None)
        return outs

    def _input_for(self, st: RunState, vid: int, location, stream: SyncStream | None, ep: PluginEp | None):
        value = st.values[vid]
        if value is None:
            if vid in self.plan.object_ids:
                return None  # an empty optional
            raise EpError(f"value '{self.plan.value_names[vid]}' was not produced")
        producer = st.producer.get(vid)
        if producer is not None and producer is not stream:
            producer.notify_and_wait(stream if location != CPU_LOCATION else None)
            st.producer.pop(vid, None)
        if _location(value) == location:
            if ep is not None and isinstance(value, np.ndarray) and not value.flags.c_contiguous:
                # Plugins see pointer + shape, no strides: views of the CPU EP must be made dense.
                value = st.values[vid] = np.asarray(value, order="C")
            return value
        if vid in self.plan.constants:
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
        moved = self.transfer(value, location, ep, stream)
        if location == CPU_LOCATION:
            st.values[vid] = moved
        else:
            st.keep.append(moved)  # the kernel reads it after this returns
        return moved

    def _run_cpu(self, st: RunState, node: PlanNode) -> None:
        if node.kernel.takes_device_values:
            self._run_control_flow(st, node)
            return
        args = [None if v < 0 else self._input_for(st, v, CPU_LOCATION, None, None) for v in node.inputs]
        outs = node.kernel.run(*args)
        for vid, arr in zip(node.outputs, outs):
            if vid >= 0:
                st.values[vid] = arr

    def _run_control_flow(self, st: RunState, node: PlanNode) -> None:
        """A node the host runs over subgraph plans. Bodies run on host-memory EPs only for now
        (subgraph.subgraph_eps), so device values are copied to the host here, through the EP that
        holds them; device outputs carry their producer stream for consumers here."""
        vals = st.values
        args = []
        for v in node.inputs:
            value = None if v < 0 else vals[v]
            if value is None and v >= 0 and v not in self.plan.object_ids:
                raise EpError(f"value '{self.plan.value_names[v]}' was not produced")
            if v >= 0 and isinstance(value, DeviceTensor):
                value = self._input_for(st, v, CPU_LOCATION, None, None)
            elif v >= 0 and isinstance(value, np.ndarray) and v in st.producer:
                st.producer.pop(v).notify_and_wait(None)  # host memory a plugin stream wrote: the host reads it
            args.append(value)
        outs = node.kernel.run(*args)
        for vid, value in zip(node.outputs, outs):
            if vid >= 0:
                vals[vid] = value
                stream = getattr(value, "stream", None) if isinstance(value, DeviceTensor) else None
                if stream is not None:
                    st.producer[vid] = stream

    def _run_plugin(self, st: RunState, node: PlanNode) -> None:
        ctx = st.contexts[node.index]
        ep = node.ep
        ins = ctx.inputs
        for j, vid in enumerate(node.inputs):
            if vid < 0:
                ins[j].data, ins[j].ndim = _NULL, -1
                continue
            st.fill(ins[j], self._input_for(st, vid, ep.location, ctx.stream, ep))
        ctx.active = True
        try:
            status = ctx.compute(ctx.kernel_ptr, ctx.handle)
        finally:
            ctx.active = False
            for j in range(len(node.outputs)):
                ctx.outputs[j].data = _NULL  # an EpTensor* kept past the call points nowhere
        if status != _NULL:
            try:
                hostapi.check(status, f"node '{node.name}' ({node.op_type}) on {ep.name}", KernelError)
            except KernelError as exc:
                exc.node, exc.ep = node.name, ep.name
                raise
        for j, vid in enumerate(node.outputs):
            if vid >= 0 and st.values[vid] is None:
                raise KernelError(f"node '{node.name}' ({node.op_type}) on {ep.owner} returned OK without producing "
                                  f"output {j} ('{self.plan.value_names[vid]}'); a kernel must call "
                                  "KernelContext_GetOutput for every output", node.name, ep.name)
        if ctx.stream is not None:
            for vid in node.outputs:
                if vid >= 0:
                    st.producer[vid] = ctx.stream

    # -- copies across EPs -----------------------------------------------------------------------
    def transfer(self, value, location, ep: PluginEp | None, stream: SyncStream | None):
        """Copy `value` to `location` with the data-transfer table of the EP on the device side."""
        # The device side: the target for a copy to a device (host->device included), else the source.
        device_side = location if location != CPU_LOCATION else _location(value)
        device_ep = ep if ep is not None and location != CPU_LOCATION else self._ep_at(device_side)
        if device_ep is None or device_ep.transfer is None:
            how = "" if device_ep is None else (f"; {device_ep.owner} gave none (EpFactory.CreateDataTransfer is "
                                                "NULL or returned no table)")
            raise EpError(f"no data transfer can copy from {_location(value)} to {location}{how}")
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

    def _ep_at(self, location) -> PluginEp | None:
        for ep in self._transfer_eps:
            if ep.location == location:
                return ep
        return None

    def to_host(self, value):
        if not isinstance(value, DeviceTensor):  # arrays, and lists / dicts / None of non-tensor values
            return value
        # On the producer's stream, so the copy follows the EP's copy-stream options and is ordered
        # after the kernel that wrote the value.
        return self.transfer(value, CPU_LOCATION, None, getattr(value, "stream", None))


def wrap_kernel_error(exc: Exception, node: PlanNode) -> EphostError:
    if isinstance(exc, EphostError):
        return exc
    ep = node.ep.name if node.ep is not None else "CPUExecutionProvider"
    return KernelError(f"node '{node.name}' ({node.op_type}) on {ep} failed: {exc}", node.name, ep)
