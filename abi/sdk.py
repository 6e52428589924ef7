"""Plugin-side SDK: the base classes a Python EP derives from, exposed as the C tables of ep_abi.h.

A plugin overrides snake_case methods (`supported_devices`, `create_ep`, `claim`, `compile`, ...);
the base classes turn the raw slot arguments into Python values. A slot attribute set to None
stays NULL in the C table. The machinery underneath (negotiation, tables, trampolines, the
host API as the plugin sees it) is abi/plugin_runtime.py; the graph and device descriptions are
abi/graph_spec.py. Both are re-exported here: plugins import `from abi import sdk` only.
"""

from __future__ import annotations

import abi
from abi.graph_spec import (
    DeviceSpec,
    FrameTensor,
    FusedGraph,
    GraphSpec,
    MemorySpec,
    NodeSpec,
    ValueSpec,
    _s,
    read_graph,
    read_key_values,
    tensor_to_numpy,
)
from abi.plugin_runtime import (
    PLUGIN_TABLES,
    HostApi,
    HostCallError,
    NodeError,
    PluginError,
    Record,
    Runtime,
    count_slot_calls,
    extern_python_decls,
    runtime,
    runtimes,
    serve,
    trampoline_name,
)


class Impl:
    """Common base: knows its runtime and the C table it is exposed through."""

    table = ""

    def __init__(self, runtime: Runtime, parent: Impl | None = None):
        self.runtime = runtime
        self.ffi = runtime.ffi
        # The version and host API negotiated by the registration this object belongs to.
        self.abi_version = parent.abi_version if parent is not None else runtime.version
        self.api = parent.api if parent is not None else runtime.api

    @property
    def c(self):
        return self._c_table

    def close(self) -> None:
        """Release resources; called once when the host releases the object."""


class FactoryBase(Impl):
    table = "EpFactory"
    ep_name = "PluginEP"
    vendor = "unknown"
    plugin_version = "0.0.0"
    stream_aware = False

    def __init__(self, runtime: Runtime, logger=None):
        super().__init__(runtime)
        self.logger = logger
        self._meminfos: dict[tuple, object] = {}

    def meminfo(self, spec: MemorySpec):
        key = (spec.name, spec.device_type, spec.device_id, spec.mem_type)
        mi = self._meminfos.get(key)
        if mi is None:
            mi = self.ffi.new("EpMemoryInfo*")
            mi.name = self.runtime.cstr(self, spec.name)
            mi.device_type, mi.device_id, mi.mem_type = spec.device_type, spec.device_id, spec.mem_type
            self._meminfos[key] = mi
        return mi

    # slots
    def GetName(self):
        return self.runtime.cstr(self, self.ep_name)

    def GetVendor(self):
        return self.runtime.cstr(self, self.vendor)

    def GetVersion(self):
        return self.runtime.cstr(self, self.plugin_version)

    def GetSupportedDevices(self, devices, max_devices, num_devices):
        devs = self.supported_devices()
        n = min(len(devs), int(max_devices))
        for i, d in enumerate(devs[:n]):
            devices[i].device_type, devices[i].device_id = d.device_type, d.device_id
            devices[i].vendor_id = d.vendor_id
            devices[i].name = self.runtime.cstr(self, d.name)
            devices[i].memory_info = self.meminfo(MemorySpec(d.memory_name, d.device_type, d.device_id))
        num_devices[0] = n

    def CreateEp(self, devices, num_devices, options, num_options, session_options, logger, out):
        devs = [DeviceSpec(devices[i].device_type, devices[i].device_id, devices[i].vendor_id,
                           _s(self.ffi, devices[i].name)) for i in range(num_devices)]
        opts = read_key_values(self.ffi, options, num_options)
        ep = self.create_ep(devs, opts, session_options, logger)
        out[0] = self.runtime.expose("Ep", ep)

    def ReleaseEp(self, ep):
        obj = self.runtime.forget(ep, "Ep")
        if obj is not None:
            obj.close()

    def CreateAllocator(self, info, out):
        alloc = self.create_allocator(self._spec(info))
        out[0] = self.ffi.NULL if alloc is None else self.runtime.expose("EpAllocator", alloc)

    def ReleaseAllocator(self, allocator):
        obj = self.runtime.forget(allocator, "EpAllocator")
        if obj is not None:
            obj.close()

    def CreateDataTransfer(self, out):
        dt = self.create_data_transfer()
        out[0] = self.ffi.NULL if dt is None else self.runtime.expose("EpDataTransfer", dt)

    def IsStreamAware(self):
        return int(self.stream_aware)

    def CreateSyncStreamForDevice(self, info, out):
        s = self.create_sync_stream(self._spec(info))
        out[0] = self.ffi.NULL if s is None else self.runtime.expose("EpSyncStream", s)

    def ValidateCompiledModelCompatibilityInfo(self, devices, num_devices, compatibility_info, compatibility):
        devs = [DeviceSpec(devices[i].device_type, devices[i].device_id, devices[i].vendor_id,
                           _s(self.ffi, devices[i].name)) for i in range(num_devices)]
        answer = int(self.validate_compatibility(devs, _s(self.ffi, compatibility_info)))
        if answer not in COMPATIBILITY_ANSWERS:
            raise PluginError(f"validate_compatibility() returned {answer}; expected one of "
                              f"{sorted(COMPATIBILITY_ANSWERS)}", abi.EP_FAIL)
        compatibility[0] = answer

    def _spec(self, info) -> MemorySpec:
        return MemorySpec(_s(self.ffi, info.name), info.device_type, info.device_id, info.mem_type)

    # to override
    def supported_devices(self) -> list[DeviceSpec]:
        return []

    def create_ep(self, devices, options, session_options, logger):
        raise PluginError("this factory creates no EP", abi.EP_NOT_IMPLEMENTED)

    def create_allocator(self, spec: MemorySpec):
        return None

    def create_data_transfer(self):
        return None

    def create_sync_stream(self, spec: MemorySpec):
        return None

    def validate_compatibility(self, devices: list[DeviceSpec], info: str) -> int:
        """(v7) Judge a compatibility string saved in a compiled model against `devices`: one of
        COMPILED_MODEL_*. The default: this factory saves no contexts, so it has no opinion."""
        return COMPILED_MODEL_NOT_APPLICABLE


class EpBase(Impl):
    table = "Ep"
    name = "PluginEP"

    def __init__(self, runtime: Runtime, factory: FactoryBase):
        super().__init__(runtime, factory)
        self.factory = factory
        self._graph: tuple[int, GraphSpec] | None = None

    def graph(self, g) -> GraphSpec:
        # The host shows one view per session for GetCapability and all CreateKernel calls.
        key = (int(self.ffi.cast("uintptr_t", g)), g.num_nodes, g.num_values)
        if self._graph is None or self._graph[0] != key:
            # EpValueInfo.flags mean something from v7 on (reserved, zero, before).
            self._graph = (key, read_graph(self.ffi, g, flags=self.runtime.version >= 7))
        return self._graph[1]

    def GetName(self):
        return self.runtime.cstr(self, self.name)

    def GetCapability(self, graph, claimed):
        spec = self.graph(graph)
        if self.abi_version >= 6 and self.api.has("Graph_AddNodesToFuse"):
            for group in self.claim_fused(spec):
                nodes = self.ffi.new("int32_t[]", list(group))
                self.api.check(self.api.call("Graph_AddNodesToFuse", graph, nodes, len(group)))
        elif type(self).claim_fused is not EpBase.claim_fused:
            # An older host cannot compile partitions: the per-node kernels of claim() run instead.
            self.runtime.record.fallbacks["kernels_instead_of_compile"] += 1
        for i in self.claim(spec):
            claimed[i] = 1

    def Compile(self, graphs, fused_nodes, count, compute_infos_out):
        ffi = self.ffi
        fused = [FusedGraph(_s(ffi, fused_nodes[i].name), read_graph(ffi, graphs[i])) for i in range(count)]
        functions = list(self.compile(fused))
        if len(functions) != count:
            raise PluginError(f"compile() returned {len(functions)} compute functions for {count} fused nodes",
                              abi.EP_INVALID_GRAPH)
        tables = [self.runtime.expose("EpNodeComputeInfo", ComputeInfo(self.runtime, self, fn, fg))
                  for fn, fg in zip(functions, fused)]
        for i, c in enumerate(tables):
            compute_infos_out[i] = c

    def CompileFromContext(self, graph, fused_node, data, size, compute_info_out):
        fused = FusedGraph(_s(self.ffi, fused_node.name), read_graph(self.ffi, graph))
        # A view, not a copy (a BERT-size context is 440 MB): the host keeps the bytes until this
        # compute info is released (abi/ep_abi.h).
        blob = memoryview(self.ffi.buffer(data, size)).toreadonly() if data != self.ffi.NULL and size else b""
        function = self.compile_from_context(fused, blob)
        compute_info_out[0] = self.runtime.expose("EpNodeComputeInfo", ComputeInfo(self.runtime, self, function, fused))

    def GetCompiledModelCompatibilityInfo(self, graph):
        info = self.compatibility_info()
        return None if info is None else self.runtime.cstr(self, info)

    def CreateKernel(self, graph, node, out):
        g = self.graph(graph)
        out[0] = self.runtime.expose("EpKernel", self.create_kernel(g, g.nodes[node]))

    def OnRunStart(self, run_options):
        return None

    def OnRunEnd(self, run_options, sync_stream):
        return None

    def CreateAllocator(self, info, out):
        return self.factory.CreateAllocator(info, out)

    def CreateSyncStreamForDevice(self, info, out):
        return self.factory.CreateSyncStreamForDevice(info, out)

    def run_options(self, run_options) -> dict[str, str]:
        if run_options == self.ffi.NULL:
            return {}
        return read_key_values(self.ffi, run_options.entries, run_options.num_entries)

    def claim(self, graph: GraphSpec) -> list[int]:
        return []

    def claim_fused(self, graph: GraphSpec) -> list[list[int]]:
        """Groups of node indices to fuse into one compiled partition each (called on a v6 host only).
        Nodes of a group that claim() also returns keep a per-node fallback if compiling fails."""
        return []

    def compile(self, fused: list[FusedGraph]) -> list:
        """One compute function per fused graph: an object with compute(state, frame) and
        optionally create_state() and release_state(state)."""
        raise PluginError(f"{type(self).__name__} compiles no partition", abi.EP_NOT_IMPLEMENTED)

    def compile_from_context(self, fused: FusedGraph, blob: bytes):
        """(v7) Rebuild the compute function of a saved fused node from the bytes its context()
        returned; `fused.graph` holds no nodes, only the node's inputs and outputs. `blob` is a
        read-only memoryview of the host's bytes (perhaps a mapped file), valid until the function
        is released: views of it need no copy. Raise on a blob it cannot read: the host then
        compiles the subgraph kept in the model."""
        raise PluginError(f"{type(self).__name__} rebuilds no partition from a context", abi.EP_NOT_IMPLEMENTED)

    def compatibility_info(self) -> str | None:
        """(v7) What this EP's contexts depend on, saved in a context model; None: no contexts."""
        return None

    def create_kernel(self, graph: GraphSpec, node: NodeSpec):
        raise PluginError(f"no kernel for {node.op_type}", abi.EP_NOT_IMPLEMENTED)


class CallFrame:
    """The EpCallFrame of one Compute call as Python sees it (valid during that call only).

    Inputs and outputs are read lazily: `input_ptrs()`/`output_ptrs()` are the cheap path."""

    __slots__ = ("_c", "_ffi", "_api", "_inputs", "_outputs")

    def __init__(self, ffi, api: HostApi | None, c_frame):
        self._c = c_frame
        self._ffi = ffi
        self._api = api
        self._inputs: list[FrameTensor] | None = None
        self._outputs: list[FrameTensor] | None = None

    @property
    def stream(self) -> int:
        """The GPU stream handle (cudaStream_t) as an int; 0 where the EP has no stream."""
        return int(self._ffi.cast("uintptr_t", self._c.stream))

    @property
    def sync_stream(self):
        """The EpSyncStream* of the run (NULL where the EP is not stream aware)."""
        return self._c.sync_stream

    @property
    def capturing(self) -> bool:
        return bool(self._c.capturing)

    def _tensor(self, t) -> FrameTensor:
        ptr = int(self._ffi.cast("uintptr_t", t.data))
        if t.rank < 0:
            shape = None
        else:
            shape = tuple(None if t.dims[d] < 0 else int(t.dims[d]) for d in range(t.rank))
        return FrameTensor(ptr, int(t.elem_type), shape)

    @property
    def inputs(self) -> list[FrameTensor]:
        if self._inputs is None:
            c = self._c
            self._inputs = [self._tensor(c.inputs[i]) for i in range(c.num_inputs)]
        return self._inputs

    @property
    def outputs(self) -> list[FrameTensor]:
        if self._outputs is None:
            c = self._c
            self._outputs = [self._tensor(c.outputs[i]) for i in range(c.num_outputs)]
        return self._outputs

    def input_ptrs(self) -> list[int]:
        c, cast = self._c, self._ffi.cast
        return [int(cast("uintptr_t", c.inputs[i].data)) for i in range(c.num_inputs)]

    def input_ints(self, index: int) -> tuple[int, ...]:
        """An int64 input the host handed over in host memory (a shape-program value that the
        partition reads only on the host: abi/host_inputs.host_only_values), as Python ints."""
        t = self._c.inputs[index]
        if t.elem_type != 7 or t.rank < 0 or t.rank > 1:
            raise PluginError(f"input {index}: expected a host int64 vector; got element type {t.elem_type}, "
                              f"rank {t.rank}")
        count = int(t.dims[0]) if t.rank == 1 else 1
        return tuple(self._ffi.unpack(self._ffi.cast("int64_t*", t.data), count))

    def output_ptrs(self) -> list[int]:
        c, cast = self._c, self._ffi.cast
        return [int(cast("uintptr_t", c.outputs[i].data)) for i in range(c.num_outputs)]

    def allocate_output(self, index: int, shape) -> int:
        """Memory for output `index` with `shape`, through the host's callback; returns the pointer."""
        c, ffi = self._c, self._ffi
        if not 0 <= index < c.num_outputs:
            raise PluginError(f"allocate_output: index {index} out of range 0..{c.num_outputs - 1}",
                              abi.EP_INVALID_ARGUMENT)
        dims = tuple(int(d) for d in shape)
        out = ffi.new("void**")
        self._check(c.AllocateOutput(c.allocate_context, index, ffi.new("int64_t[]", dims or (0,)), len(dims), out))
        self._outputs = None
        return int(ffi.cast("uintptr_t", out[0]))

    def scratch(self, nbytes: int) -> int:
        """`nbytes` of scratch memory tagged with the frame's stream; freed by free_scratch or after Compute."""
        c, ffi = self._c, self._ffi
        out = ffi.new("void**")
        self._check(c.AllocScratch(c.scratch_context, int(nbytes), out))
        return int(ffi.cast("uintptr_t", out[0]))

    def free_scratch(self, ptr: int) -> None:
        c = self._c
        c.FreeScratch(c.scratch_context, self._ffi.cast("void*", ptr))

    def _check(self, status) -> None:
        if self._api is None:
            if status != self._ffi.NULL:
                raise PluginError("a host callback of the call frame failed")
            return
        self._api.check(status)


def compatibility_string(ep_name: str, **fields) -> str:
    """A compatibility string in the SDK's form: "EP;key=value;..." (compatibility_fields reads it)."""
    return ";".join([ep_name, *(f"{k}={v}" for k, v in fields.items())])


def compatibility_fields(info: str, ep_name: str) -> dict[str, str] | None:
    """The key=value fields of a compatibility_string of `ep_name`, or None for any other text."""
    name, _, rest = info.partition(";")
    pairs = [part.partition("=") for part in rest.split(";") if part]
    if name != ep_name or any(not sep for _, sep, _ in pairs):
        return None
    return {k: v for k, _, v in pairs}


# Answers of FactoryBase.validate_compatibility (ep_abi.h EP_COMPILED_MODEL_*).
COMPILED_MODEL_NOT_APPLICABLE = abi.COMPILED_MODEL_NOT_APPLICABLE
COMPILED_MODEL_SUPPORTED_OPTIMAL = abi.COMPILED_MODEL_SUPPORTED_OPTIMAL
COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION = abi.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION
COMPILED_MODEL_UNSUPPORTED = abi.COMPILED_MODEL_UNSUPPORTED
COMPATIBILITY_ANSWERS = tuple(abi.COMPATIBILITY_NAMES)


class ComputeInfo(Impl):
    """The EpNodeComputeInfo of one fused node: routes the C slots to a plugin's compute function."""

    table = "EpNodeComputeInfo"

    def __init__(self, runtime: Runtime, ep: EpBase, function, fused: FusedGraph):
        super().__init__(runtime, ep)
        self.function = function
        self.fused = fused
        self._states: dict[object, object] = {}
        self._context = None  # the bytes GetContext handed out, alive until Release
        self._serial = 0
        self._node_index = {n.name: n.index for n in fused.graph.nodes}

    def CreateState(self, state_out):
        make = getattr(self.function, "create_state", None)
        state = make() if make is not None else None
        self._serial += 1
        # The handle is a counter, not an address: the host only hands it back.
        key = self.ffi.cast("void*", self._serial)
        self._states[key] = state
        state_out[0] = key

    def Compute(self, state, frame):
        try:
            self.function.compute(self._states.get(state), CallFrame(self.ffi, self.api, frame))
        except NodeError as exc:
            index = exc.node if isinstance(exc.node, int) else self._node_index.get(exc.node, -1)
            frame.error_node = index
            raise

    def GetContext(self, data, size):
        # The function's context() bytes, kept alive until Release (the host copies them).
        make = getattr(self.function, "context", None)
        blob = make() if make is not None else None
        if not blob:
            data[0], size[0] = self.ffi.NULL, 0
            return
        self._context = self.ffi.new("char[]", bytes(blob))
        data[0], size[0] = self._context, len(blob)

    def ReleaseState(self, state):
        value = self._states.pop(state, None)
        release = getattr(self.function, "release_state", None)
        if release is not None and value is not None:
            release(value)

    def Release(self):
        self.runtime.forget(self._c_table, "EpNodeComputeInfo")
        for key in list(self._states):
            self.ReleaseState(key)
        self.close()


class KernelBase(Impl):
    table = "EpKernel"

    def Compute(self, context):
        raise NotImplementedError

    def Release(self):
        self.runtime.forget(self._c_table, "EpKernel")
        self.close()


class AllocatorBase(Impl):
    table = "EpAllocator"

    def __init__(self, runtime: Runtime, factory: FactoryBase, spec: MemorySpec):
        super().__init__(runtime, factory)
        self.spec = spec
        self._info = factory.meminfo(spec)

    def Info(self):
        return self._info

    def Alloc(self, size, out):
        out[0] = self.ffi.cast("void*", self.alloc(int(size), None))

    def AllocOnStream(self, size, stream, out):
        out[0] = self.ffi.cast("void*", self.alloc(int(size), stream))

    def Free(self, p):
        self.free(int(self.ffi.cast("uintptr_t", p)))

    def alloc(self, size: int, stream) -> int:
        raise NotImplementedError

    def free(self, ptr: int) -> None:
        raise NotImplementedError


class SyncStreamBase(Impl):
    table = "EpSyncStream"

    def GetHandle(self):
        return self.ffi.cast("void*", self.handle())

    def CreateNotification(self, out):
        out[0] = self.runtime.expose("EpNotification", self.create_notification())


    def Flush(self):
        return None

    def OnSessionRunEnd(self):
        return None

    def Release(self):
        self.runtime.forget(self._c_table, "EpSyncStream")
        self.close()

    def handle(self) -> int:
        return 0

    def create_notification(self):
        raise NotImplementedError


class NotificationBase(Impl):
    table = "EpNotification"

    def Activate(self):
        return None

    def WaitOnDevice(self, consumer):
        return None

    def WaitOnHost(self):
        return None

    def Release(self):
        self.runtime.forget(self._c_table, "EpNotification")
        self.close()


__all__ = [
    "COMPATIBILITY_ANSWERS", "COMPILED_MODEL_NOT_APPLICABLE", "COMPILED_MODEL_SUPPORTED_OPTIMAL",
    "COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION", "COMPILED_MODEL_UNSUPPORTED", "PLUGIN_TABLES", "AllocatorBase", "CallFrame", "ComputeInfo", "DeviceSpec", "EpBase", "FactoryBase",
    "FrameTensor", "FusedGraph", "GraphSpec", "HostApi", "HostCallError", "Impl", "KernelBase", "MemorySpec",
    "NodeError", "NodeSpec", "NotificationBase", "PluginError", "Record", "Runtime", "SyncStreamBase", "ValueSpec",
    "compatibility_fields", "compatibility_string", "count_slot_calls", "extern_python_decls", "read_graph", "read_key_values", "runtime", "runtimes", "serve",
    "tensor_to_numpy", "trampoline_name",
]
