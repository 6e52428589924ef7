"""Plugin-side SDK: expose a Python EP implementation as the C tables of ep_abi.h.

A plugin library is built by cffi in embedding mode (see build.py). Its init code calls
`serve(ffi, lib, compiled_version, create_factories)`. From then on:
  - `CreateEpFactories` negotiates the version with the host (GetApi(min(compiled, host))),
  - every C table handed to the host is made by `Runtime.expose`, which installs only the slots
    the negotiated version allows and leaves the rest NULL,
  - every call from the host lands in one trampoline per slot that finds the Python object
    behind the `self` pointer and turns exceptions into EpStatus objects of the host.
The host's functions are reached through `HostApi`, which checks `has(name)` before each
optional call and records which host functions were used (test plugins assert on it).
"""

from __future__ import annotations

import collections
import logging
import re
import sys
import threading
import traceback

import abi
from abi.header import header

# Tables a plugin implements (the host implements EpApi and EpApiBase).
PLUGIN_TABLES = ("EpFactory", "Ep", "EpKernel", "EpAllocator", "EpDataTransfer", "EpSyncStream",
                 "EpNotification", "EpNodeComputeInfo")

_FUNC_PTR = re.compile(r"\(\s*\*\s*(\w+)\s*\)")
_log = logging.getLogger("ephost.sdk")


def trampoline_name(table: str, slot: str) -> str:
    return f"_ep_{table}_{slot}"


def extern_python_decls(version: int) -> str:
    """`extern "Python"` declarations of every plugin slot that exists at `version`."""
    lines = []
    for table in PLUGIN_TABLES:
        for m in header().struct(table).cut(version):
            if m.is_slot:
                lines.append('extern "Python" ' + _FUNC_PTR.sub(trampoline_name(table, m.name), m.decl))
    return "\n".join(lines) + "\n"


def _return_kind(decl: str) -> str:
    ret = decl.split("(", 1)[0].strip()
    if ret == "EpStatus*":
        return "status"
    if ret == "void":
        return "void"
    if ret.endswith("*"):
        return "pointer"
    return "int"


class Record:
    """What a plugin did: host functions used, fallbacks taken, slots called, objects alive."""

    def __init__(self) -> None:
        self.host_calls: collections.Counter[str] = collections.Counter()
        self.slot_calls: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.live: collections.Counter[str] = collections.Counter()

    def clear(self) -> None:
        for c in (self.host_calls, self.slot_calls, self.fallbacks):
            c.clear()


class HostApi:
    """The host's EpApi as the plugin sees it, with version checks on every optional slot."""

    def __init__(self, runtime: Runtime, api_ptr, version: int):
        self._rt = runtime
        self._ffi = runtime.ffi
        self.ptr = api_ptr
        self.version = version
        self._present = {
            name for name in abi.slots_at("EpApi", version)
            if self._covers(name) and getattr(api_ptr, name) != self._ffi.NULL
        }
        self.struct_size = api_ptr.struct_size
        # Bound slot objects are looked up once; the kernel path calls them per node.
        self.get_io = api_ptr.KernelContext_GetIO
        self.get_output = api_ptr.KernelContext_GetOutput

    def _covers(self, name: str) -> bool:
        offset = self._ffi.offsetof("EpApi", name)
        return (abi.since("EpApi", name) <= self.ptr.version
                and self.ptr.struct_size >= offset + self._ffi.sizeof("void*"))

    def has(self, name: str) -> bool:
        """True when the host serves `name` (version, struct_size and a non-NULL pointer)."""
        return name in self._present

    def call(self, name: str, *args):
        if name not in self._present:
            raise AttributeError(f"host EpApi v{self.version} has no usable slot {name!r}")
        self._rt.record.host_calls[name] += 1
        return getattr(self.ptr, name)(*args)

    def status(self, code: int, message: str):
        return self.ptr.CreateStatus(code, message.encode("utf-8", "replace"))

    def log(self, logger, severity: int, message: str) -> None:
        self.call("Logger_Log", logger if logger is not None else self._ffi.NULL, severity,
                  message.encode("utf-8", "replace"))

    def config_entry(self, session_options, key: str) -> str | None:
        size = self._ffi.new("size_t*", 0)
        st = self.call("SessionOptions_GetConfigEntry", session_options, key.encode(), self._ffi.NULL, size)
        if st != self._ffi.NULL:
            self.ptr.ReleaseStatus(st)
            return None
        buf = self._ffi.new("char[]", size[0])
        self.check(self.call("SessionOptions_GetConfigEntry", session_options, key.encode(), buf, size))
        return self._ffi.string(buf).decode()

    def check(self, status) -> None:
        if status == self._ffi.NULL:
            return
        code = self.ptr.GetErrorCode(status)
        msg = self._ffi.string(self.ptr.GetErrorMessage(status)).decode("utf-8", "replace")
        self.ptr.ReleaseStatus(status)
        raise HostCallError(msg, code)

    def sync_stream(self, context):
        """The framework stream of a kernel (seed 000), or None on a host older than v4."""
        if "KernelContext_GetSyncStream" not in self._present:
            self._rt.record.fallbacks["untagged_scratch"] += 1
            return None
        out = self._ffi.new("EpSyncStream**")
        self._rt.record.host_calls["KernelContext_GetSyncStream"] += 1
        self.check(self.ptr.KernelContext_GetSyncStream(context, out))
        return out[0]


class HostCallError(RuntimeError):
    """A host function returned an error status to the plugin."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class PluginError(Exception):
    """Raise from an implementation to return a status with a chosen code."""

    def __init__(self, message: str, code: int = abi.EP_FAIL):
        super().__init__(message)
        self.code = code


class NodeError(PluginError):
    """Raise from a compiled partition's compute() to name the original node that failed:
    `node` is its index in the FusedGraph's nodes or its name; the host reports it."""

    def __init__(self, message: str, node: int | str, code: int = abi.EP_FAIL):
        super().__init__(message, code)
        self.node = node


class Runtime:
    """One per plugin library: owns the tables it exposed and the negotiated host API."""

    def __init__(self, ffi, lib, compiled_version: int, create_factories, name: str):
        self.ffi = ffi
        self.lib = lib
        self.compiled_version = compiled_version
        self.version = compiled_version  # lowered at negotiation
        self.name = name
        self.api: HostApi | None = None
        self.record = Record()
        self._create_factories = create_factories
        # Keyed by the table pointer itself: cffi pointers hash and compare by address, whatever
        # their C type, so a trampoline looks its object up without a cast per call.
        self._objects: dict[object, object] = {}
        self._tables: dict[int, object] = {}
        self._lock = threading.Lock()
        self._strings: dict[tuple[int, str], object] = {}
        self._factories: list = []
        self._lock_create = threading.Lock()
        self._install()

    # ---- tables -------------------------------------------------------------------
    def expose(self, table: str, obj, declared_version: int | None = None, struct_size: int | None = None):
        """Make the C table for `obj`; slots beyond the negotiated version stay NULL."""
        size = self.ffi.sizeof(table)
        if struct_size is not None and struct_size > size:
            # Fault injection: an oversized table with junk after the known slots.
            buf = self.ffi.new("unsigned char[]", b"\xab" * struct_size)
            c = self.ffi.cast(f"{table}*", buf)
            for slot in abi.slots_at(table, self.compiled_version):
                if self.ffi.offsetof(table, slot) < size:
                    setattr(c, slot, self.ffi.NULL)
            self._keep = getattr(self, "_keep", []) + [buf]
        else:
            c = self.ffi.new(f"{table}*")
        c.struct_size = size if struct_size is None else struct_size
        c.version = self.compiled_version if declared_version is None else declared_version
        null_slots = getattr(obj, "null_slots", ())
        for slot in abi.slots_at(table, getattr(obj, "abi_version", self.version)):
            if slot in null_slots or getattr(obj, slot, None) is None:
                continue
            setattr(c, slot, getattr(self.lib, trampoline_name(table, slot)))
        key = self.ffi.cast("void*", c)
        with self._lock:
            self._objects[key] = obj
            self._tables[key] = c
        obj._c_table = c
        self.record.live[table] += 1
        return c

    def forget(self, ptr, table: str | None = None):
        """Drop the table behind `ptr`; returns the Python object (or None if unknown)."""
        with self._lock:
            obj = self._objects.pop(ptr, None)
            self._tables.pop(ptr, None)
        if obj is not None and table:
            self.record.live[table] -= 1
        return obj

    def obj(self, ptr):
        return self._objects.get(ptr)

    def cstr(self, owner, text: str):
        """A char* that lives as long as the runtime (names are asked for repeatedly)."""
        key = (id(owner), text)
        s = self._strings.get(key)
        if s is None:
            s = self._strings[key] = self.ffi.new("char[]", text.encode())
        return s

    # ---- trampolines ---------------------------------------------------------------
    def _install(self) -> None:
        for table in PLUGIN_TABLES:
            for m in header().struct(table).cut(self.compiled_version):
                if m.is_slot:
                    self._def_slot(table, m.name, _return_kind(m.decl))
        self._def_entry_points()

    def _def_slot(self, table: str, slot: str, kind: str) -> None:
        ffi, objects, record = self.ffi, self._objects, self.record
        qual = f"{table}.{slot}"
        runtime = self

        def on_error(exc, obj=None):
            return runtime._error_result(kind, qual, exc, getattr(obj, "api", None))

        def trampoline(this, *args):
            record.slot_calls[qual] += 1
            obj = objects.get(this)
            if obj is None:
                raise PluginError(f"{qual} called with an unknown {table} pointer", abi.EP_INVALID_ARGUMENT)
            try:
                result = getattr(obj, slot)(*args)
            except Exception as exc:  # noqa: BLE001 - every failure must become a status
                return on_error(exc, obj)
            if kind == "status":
                return ffi.NULL if result is None else result
            if kind == "pointer":
                return ffi.NULL if result is None else result
            if kind == "int":
                return int(result or 0)
            return None

        def guarded(this, *args):
            try:
                return trampoline(this, *args)
            except Exception as exc:  # noqa: BLE001
                return on_error(exc)

        self.ffi.def_extern(name=trampoline_name(table, slot))(guarded)

    def _error_result(self, kind: str, qual: str, exc: BaseException, api=None):
        api = api or self.api
        code = getattr(exc, "code", abi.EP_FAIL)
        message = f"{self.name}: {qual} failed: {exc}"
        if not isinstance(exc, (PluginError, HostCallError)):
            _log.debug("%s\n%s", message, traceback.format_exc())
        if kind == "status" and api is not None:
            return api.status(code, message)
        _log.error("%s", message)
        if kind in ("status", "pointer"):
            return self.ffi.NULL
        return 0 if kind == "int" else None

    def _def_entry_points(self) -> None:
        ffi = self.ffi
        runtime = self

        @ffi.def_extern(name="CreateEpFactories")
        def create_ep_factories(registration_name, api_base, logger, factories, max_factories, num_factories):
            try:
                return runtime._create(registration_name, api_base, logger, factories, max_factories,
                                       num_factories)
            except Exception as exc:  # noqa: BLE001
                num_factories[0] = 0
                return runtime._error_result("status", "CreateEpFactories", exc)

        @ffi.def_extern(name="ReleaseEpFactory")
        def release_ep_factory(factory):
            try:
                obj = runtime.forget(factory, "EpFactory")
                if obj is not None and hasattr(obj, "close"):
                    obj.close()
                return ffi.NULL
            except Exception as exc:  # noqa: BLE001
                return runtime._error_result("status", "ReleaseEpFactory", exc)

    def _create(self, *args):
        # One negotiation at a time: objects made during it inherit its version and API.
        with self._lock_create:
            return self._create_locked(*args)

    def _create_locked(self, registration_name, api_base, logger, factories, max_factories, num_factories):
        ffi = self.ffi
        num_factories[0] = 0
        if api_base == ffi.NULL:
            raise PluginError("CreateEpFactories got a NULL EpApiBase", abi.EP_INVALID_ARGUMENT)
        host_version = int(api_base.version)
        self.version = max(1, min(self.compiled_version, host_version))
        api_ptr = api_base.GetApi(self.version)
        if api_ptr == ffi.NULL:
            raise PluginError(f"host returned no EpApi for version {self.version}")
        self.api = HostApi(self, api_ptr, self.version)
        if self.version < self.compiled_version:
            self.record.fallbacks[f"host_api_v{self.version}"] += 1
        reg = ffi.string(registration_name).decode() if registration_name != ffi.NULL else ""
        made = self._create_factories(self, reg, logger)
        if len(made) > max_factories:
            raise PluginError(f"plugin makes {len(made)} factories; host allows {max_factories}")
        for i, fac in enumerate(made):
            c = fac if isinstance(fac, ffi.CData) else self.expose("EpFactory", fac)
            factories[i] = c
            self._factories.append(c)
        num_factories[0] = len(made)
        return ffi.NULL


_RUNTIMES: dict[str, Runtime] = {}


def serve(ffi, lib, compiled_version: int, create_factories, name: str) -> Runtime:
    """Called by a plugin's embedding init code; `create_factories(runtime, reg_name, logger)`
    returns a list of factory implementations (objects with EpFactory slot methods)."""
    abi.check_known_version(compiled_version)
    rt = Runtime(ffi, lib, compiled_version, create_factories, name)
    _RUNTIMES[name] = rt
    return rt


def runtime(name: str) -> Runtime:
    """The runtime of a loaded plugin by its module name (tests read its Record)."""
    try:
        return _RUNTIMES[name]
    except KeyError:
        raise KeyError(f"no plugin runtime {name!r}; loaded: {sorted(_RUNTIMES)}") from None


def runtimes() -> dict[str, Runtime]:
    return dict(_RUNTIMES)


def log_excepthook() -> None:
    """Print uncaught errors of callbacks (cffi prints them to stderr otherwise)."""
    sys.excepthook = sys.__excepthook__


# ---- implementation helpers ------------------------------------------------------------
# Base classes turn the raw slot arguments into Python values; a plugin overrides the
# snake_case methods. A slot attribute set to None stays NULL in the C table.

from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

from abi.dtypes import to_numpy  # noqa: E402


@dataclass(frozen=True)
class DeviceSpec:
    device_type: int
    device_id: int
    vendor_id: int = 0
    name: str = ""
    memory_name: str = "Cpu"


@dataclass(frozen=True)
class MemorySpec:
    name: str
    device_type: int
    device_id: int
    mem_type: int = 0


@dataclass
class ValueSpec:
    name: str
    elem_type: int
    shape: tuple | None  # None: rank unknown; -1 marks an unknown dimension (None in FusedGraph inputs/outputs)
    kind: int
    constant: np.ndarray | None = None

    @property
    def dtype(self) -> int:
        """The element type as an ONNX TensorProto enum int (the same as elem_type)."""
        return self.elem_type


@dataclass
class NodeSpec:
    index: int
    name: str
    op_type: str
    domain: str
    opset: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: dict = field(default_factory=dict)


@dataclass
class GraphSpec:
    """A Python copy of an EpGraphView. `inputs`/`outputs` describe the graph's inputs and outputs
    with None for unknown dimensions; `input_ids`/`output_ids` are their indices into `values`."""

    nodes: list[NodeSpec]
    values: list[ValueSpec]
    inputs: list[ValueSpec] = field(default_factory=list)
    outputs: list[ValueSpec] = field(default_factory=list)
    input_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    name: str = ""


@dataclass
class FusedGraph:
    """One claimed group as Compile sees it: `name` is the fused node's name (errors name it),
    `graph` holds just the group's nodes, the constants they read, and the group's inputs/outputs
    in the order of the call frame's inputs/outputs."""

    name: str
    graph: GraphSpec


@dataclass(frozen=True)
class FrameTensor:
    """One input or output of a call frame: a device pointer (0: an output not preallocated),
    an ONNX element type and a shape (for an output not preallocated, the inferred one, with
    None for unknown dimensions, or None when even the rank is unknown)."""

    ptr: int
    dtype: int
    shape: tuple | None


def _s(ffi, p) -> str:
    return "" if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")


def tensor_to_numpy(ffi, t) -> np.ndarray:
    """Copy a CPU EpTensor into a NumPy array."""
    dtype = to_numpy(t.elem_type)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.nbytes == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(ffi.buffer(t.data, t.nbytes), dtype=dtype).reshape(shape).copy()


def _attr_value(ffi, a):
    kind = a.type
    if kind == 1:
        return float(a.f)
    if kind == 2:
        return int(a.i)
    if kind == 3:
        return _s(ffi, a.s)
    if kind == 4:
        return tensor_to_numpy(ffi, a.tensor[0]) if a.tensor != ffi.NULL else None
    if kind == 6:
        return [float(a.floats[i]) for i in range(a.count)]
    if kind == 7:
        return [int(a.ints[i]) for i in range(a.count)]
    if kind == 8:
        return [_s(ffi, a.strings[i]) for i in range(a.count)]
    return None


def _io_spec(v: ValueSpec) -> ValueSpec:
    shape = None if v.shape is None else tuple(None if d < 0 else d for d in v.shape)
    return ValueSpec(v.name, v.elem_type, shape, v.kind, v.constant)


def read_graph(ffi, g) -> GraphSpec:
    """Python copy of an EpGraphView (done at session creation, never per run)."""
    values = []
    for i in range(g.num_values):
        v = g.values[i]
        shape = None if v.ndim < 0 else tuple(int(v.shape[d]) for d in range(v.ndim))
        const = tensor_to_numpy(ffi, v.constant[0]) if v.constant != ffi.NULL else None
        values.append(ValueSpec(_s(ffi, v.name), v.elem_type, shape, v.kind, const))
    nodes = []
    for i in range(g.num_nodes):
        n = g.nodes[i]
        attrs = {_s(ffi, n.attributes[k].name): _attr_value(ffi, n.attributes[k]) for k in range(n.num_attributes)}
        nodes.append(NodeSpec(
            i, _s(ffi, n.name), _s(ffi, n.op_type), _s(ffi, n.domain), n.opset,
            tuple(n.inputs[k] for k in range(n.num_inputs)),
            tuple(n.outputs[k] for k in range(n.num_outputs)), attrs))
    ins = tuple(int(g.inputs[k]) for k in range(g.num_inputs))
    outs = tuple(int(g.outputs[k]) for k in range(g.num_outputs))
    return GraphSpec(nodes, values, [_io_spec(values[i]) for i in ins], [_io_spec(values[i]) for i in outs],
                     ins, outs, _s(ffi, g.name))


def read_key_values(ffi, entries, count: int) -> dict[str, str]:
    return {_s(ffi, entries[i].key): _s(ffi, entries[i].value) for i in range(count)}


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
            self._graph = (key, read_graph(self.ffi, g))
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


class ComputeInfo(Impl):
    """The EpNodeComputeInfo of one fused node: routes the C slots to a plugin's compute function."""

    table = "EpNodeComputeInfo"

    def __init__(self, runtime: Runtime, ep: EpBase, function, fused: FusedGraph):
        super().__init__(runtime, ep)
        self.function = function
        self.fused = fused
        self._states: dict[object, object] = {}
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
