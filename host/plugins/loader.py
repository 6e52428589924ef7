"""Load EP plugin libraries by path, negotiate the ABI version, resolve slots with one gate.

Libraries are opened once per process and never closed: a cffi embedded plugin keeps Python
objects (its module, its callbacks) that would dangle after dlclose. Unregistering releases
every factory and forgets the registration; registering the same path again re-creates them.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import threading
from dataclasses import dataclass, field
from pathlib import Path

import abi
from host.errors import AbiVersionError, EpError, PluginLoadError
from host.plugins import hostapi
from host.plugins.hostapi import ffi

_log = logging.getLogger("ephost")
MAX_FACTORIES = 8
MAX_DEVICES = 64

_ENTRY_FFI = abi.ffi_for(abi.ABI_VERSION)


# ---- the one gate ------------------------------------------------------------------------
class Slots:
    """The callable slots of one plugin table, resolved once: each attribute is the C function,
    or None where the version, the struct_size or a NULL pointer says it must not be called."""

    def __init__(self, table: str, ptr, negotiated: int, owner: str):
        self.table = table
        self.ptr = ptr
        self.declared = int(ptr.version)
        self.struct_size = int(ptr.struct_size)
        self.negotiated = negotiated
        self.present: dict[str, object] = {}
        for name in abi.slots_at(table, negotiated):
            end = ffi.offsetof(table, name) + ffi.sizeof("void*")
            if self.struct_size < end:
                continue
            fn = getattr(ptr, name)
            if fn != ffi.NULL:
                self.present[name] = fn
        for name, (since, required) in abi.since_table()[table].items():
            if required and since <= negotiated and name not in self.present:
                raise AbiVersionError(f"{owner}: mandatory slot {table}.{name} is NULL")
            setattr(self, name, self.present.get(name))

    def has(self, name: str) -> bool:
        return name in self.present


def negotiate(table: str, ptr, host_version: int, owner: str) -> Slots:
    """Check a plugin table's declared version and struct_size, then resolve its slots."""
    if ptr == ffi.NULL:
        raise PluginLoadError(f"{owner}: returned a NULL {table} table")
    declared = int(ptr.version)
    if declared >= abi.ABI_NEXT_GENERATION:
        raise AbiVersionError(
            f"{owner}: {table} declares ABI version {declared}, a future incompatible generation "
            f"(>= {abi.ABI_NEXT_GENERATION}); this host supports {abi.ABI_MIN_VERSION}..{host_version}")
    if declared < abi.ABI_MIN_VERSION:
        raise AbiVersionError(
            f"{owner}: {table} declares ABI version {declared}; this host supports "
            f"{abi.ABI_MIN_VERSION}..{host_version}")
    negotiated = min(declared, host_version)
    need = abi.ffi_for(negotiated).sizeof(table)
    if int(ptr.struct_size) < need:
        raise AbiVersionError(
            f"{owner}: {table}.struct_size is {int(ptr.struct_size)} bytes; version {negotiated} "
            f"needs at least {need}")
    return Slots(table, ptr, negotiated, owner)


# ---- libraries ---------------------------------------------------------------------------
_LIBRARIES: dict[str, object] = {}
_LIB_LOCK = threading.Lock()


def _python_soname() -> str | None:
    return sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")


def check_library_file(path: Path) -> None:
    """Before dlopen: a readable ELF shared object that links (if any) our libpython."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    if not path.exists():
        raise PluginLoadError(f"plugin '{path}': no such file")
    if not path.is_file():
        raise PluginLoadError(f"plugin '{path}': not a regular file")
    try:
        with path.open("rb") as fh:
            elf = ELFFile(fh)
            if elf["e_type"] != "ET_DYN":
                raise PluginLoadError(f"plugin '{path}': ELF type {elf['e_type']}, expected a shared library")
            needed = [tag.needed for sec in elf.iter_sections() if isinstance(sec, DynamicSection)
                      for tag in sec.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
    except PluginLoadError:
        raise
    except (ELFError, OSError, ValueError, KeyError, AssertionError) as exc:
        raise PluginLoadError(f"plugin '{path}': not a loadable shared library ({exc})") from exc
    ours = _python_soname()
    for lib in needed:
        if lib.startswith("libpython") and ours and lib != ours:
            raise PluginLoadError(
                f"plugin '{path}' links {lib}, but this interpreter is {ours}; rebuild the plugin with "
                f"this Python (python build.py)")


def open_library(path: Path):
    """dlopen once per real path; the returned object stays alive for the process."""
    key = os.path.realpath(path)
    with _LIB_LOCK:
        lib = _LIBRARIES.get(key)
        if lib is not None:
            return lib
        check_library_file(Path(key))
        try:
            lib = _ENTRY_FFI.dlopen(key)
        except OSError as exc:
            raise PluginLoadError(f"plugin '{path}': dlopen failed: {exc}") from exc
        for sym in ("CreateEpFactories", "ReleaseEpFactory"):
            try:
                getattr(lib, sym)
            except (AttributeError, NotImplementedError) as exc:
                raise PluginLoadError(f"plugin '{path}': missing entry symbol {sym}") from exc
        _LIBRARIES[key] = lib
        return lib


# ---- registrations -----------------------------------------------------------------------
@dataclass(frozen=True)
class EpDeviceInfo:
    ep_name: str
    vendor: str
    device_type: int
    device_id: int
    vendor_id: int
    name: str
    memory_name: str
    registration: str


@dataclass
class Factory:
    """One EpFactory of a registered plugin."""

    registration: str
    path: str
    slots: Slots
    host_version: int
    name: str = ""
    vendor: str = ""
    plugin_version: str = ""
    devices: list[EpDeviceInfo] = field(default_factory=list)
    device_structs: object = None
    allocator_finalizers: list = field(default_factory=list)

    @property
    def ptr(self):
        return self.slots.ptr

    @property
    def negotiated(self) -> int:
        return self.slots.negotiated

    def owner(self) -> str:
        return f"plugin '{self.registration}' ({self.path})"


def _string(fn, ptr) -> str:
    p = fn(ptr)
    return "" if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")


class PluginRegistration:
    """A plugin library registered under a name, with its factories."""

    def __init__(self, env, name: str, path: Path):
        self.env = env
        self.name = name
        self.path = str(path)
        self.library = open_library(path)
        self.logger = hostapi.LOGGERS.make(name)
        self.factories: list[Factory] = []
        self._users = 0
        self._closed = False
        self._create_factories()

    def _owner(self) -> str:
        return f"plugin '{self.name}' ({self.path})"

    def _create_factories(self) -> None:
        out = ffi.new("EpFactory*[]", MAX_FACTORIES)
        count = ffi.new("size_t*", 0)
        status = self.library.CreateEpFactories(
            ffi.new("char[]", self.name.encode()), self.env.api.base, self.logger, out, MAX_FACTORIES, count)
        hostapi.check(status, f"{self._owner()}: CreateEpFactories", PluginLoadError)
        n = int(count[0])
        if n == 0:
            raise PluginLoadError(f"{self._owner()}: CreateEpFactories returned no factory")
        if n > MAX_FACTORIES:
            raise PluginLoadError(f"{self._owner()}: reported {n} factories; at most {MAX_FACTORIES} allowed")
        try:
            for i in range(n):
                slots = negotiate("EpFactory", out[i], self.env.api_version, self._owner())
                self.factories.append(self._describe(slots))
        except Exception:
            for i in range(n):
                if out[i] != ffi.NULL:
                    self.library.ReleaseEpFactory(out[i])
            self.factories.clear()
            raise

    def _describe(self, slots: Slots) -> Factory:
        f = Factory(self.name, self.path, slots, self.env.api_version)
        f.name = _string(slots.GetName, slots.ptr)
        f.vendor = _string(slots.GetVendor, slots.ptr)
        f.plugin_version = _string(slots.GetVersion, slots.ptr) if slots.GetVersion else ""
        devs = ffi.new("EpDevice[]", MAX_DEVICES)
        count = ffi.new("size_t*", 0)
        hostapi.check(slots.GetSupportedDevices(slots.ptr, devs, MAX_DEVICES, count),
                      f"{self._owner()}: GetSupportedDevices", PluginLoadError)
        f.device_structs = devs
        for i in range(min(int(count[0]), MAX_DEVICES)):
            d = devs[i]
            mem = _string(lambda p: p.name, d.memory_info) if d.memory_info != ffi.NULL else ""
            name = ffi.string(d.name).decode() if d.name != ffi.NULL else ""
            f.devices.append(EpDeviceInfo(f.name, f.vendor, d.device_type, d.device_id, d.vendor_id, name,
                                          mem, self.name))
        return f

    def acquire(self) -> None:
        self._users += 1

    def release(self) -> None:
        self._users -= 1

    def close(self) -> None:
        if self._closed:
            return
        if self._users > 0:
            raise PluginLoadError(f"{self._owner()} is still used by {self._users} session(s); close them first")
        self._closed = True
        errors = []
        for f in self.factories:
            for fin in f.allocator_finalizers:
                fin()  # allocators still held by outputs go now, while their factory exists
            f.allocator_finalizers.clear()
            try:
                hostapi.check(self.library.ReleaseEpFactory(f.ptr), f"{self._owner()}: ReleaseEpFactory", EpError)
            except EpError as exc:
                errors.append(str(exc))
        self.factories.clear()
        hostapi.LOGGERS.drop(self.logger)
        if errors:
            _log.warning("%s", "; ".join(errors))
