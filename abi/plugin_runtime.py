"""The plugin runtime: the C side of a Python plugin library (negotiation, tables, trampolines).

A plugin library is built by cffi in embedding mode (see build.py). Its init code calls
`serve(ffi, lib, compiled_version, create_factories)`. From then on:
  - `CreateEpFactories` negotiates the version with the host (GetApi(min(compiled, host))),
  - every C table handed to the host is made by `Runtime.expose`, which installs only the slots
    the negotiated version allows and leaves the rest NULL,
  - every call from the host lands in one trampoline per slot that finds the Python object
    behind the `self` pointer and turns exceptions into EpStatus objects of the host.
The host's functions are reached through `HostApi`, which checks `has(name)` before each
optional call and records which host functions were used (test plugins assert on it).

Slot calls are counted only for plugins that ask at registration (`count_slot_calls`, set on
the function `serve` receives): a test plugin's trampolines count, a product plugin's do not.
The implementation base classes plugins derive from live in abi/sdk.py.
"""

from __future__ import annotations

import collections
import logging
import re
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
        # Kernel inputs by EpTensor.device_type (a plugin that records them: the example EP).
        self.input_devices: collections.Counter[int] = collections.Counter()

    def clear(self) -> None:
        for c in (self.host_calls, self.slot_calls, self.fallbacks, self.input_devices):
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

    def __init__(self, ffi, lib, compiled_version: int, create_factories, name: str, count_calls: bool = False):
        self.ffi = ffi
        self.lib = lib
        self.compiled_version = compiled_version
        self.version = compiled_version  # lowered at negotiation
        self.name = name
        self.api: HostApi | None = None
        self.record = Record()
        self.count_calls = count_calls  # fixed before the trampolines are made: no check per call
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

        def counted(this, *args):
            record.slot_calls[qual] += 1
            return guarded(this, *args)

        self.ffi.def_extern(name=trampoline_name(table, slot))(counted if self.count_calls else guarded)

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
    returns a list of factory implementations (objects with EpFactory slot methods). Slot calls are
    counted in the runtime's Record only when that function carries `count_slot_calls = True`
    (see `count_slot_calls`)."""
    abi.check_known_version(compiled_version)
    count = bool(getattr(create_factories, "count_slot_calls", False))
    rt = Runtime(ffi, lib, compiled_version, create_factories, name, count)
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


def count_slot_calls(create_factories):
    """Mark a plugin's entry function so its runtime counts every slot call in `record.slot_calls`
    (test plugins assert on the counts; product plugins pay nothing for them)."""
    create_factories.count_slot_calls = True
    return create_factories
