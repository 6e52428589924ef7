"""Load EP plugin libraries by path, negotiate the ABI version, resolve slots with one gate.

Libraries are opened once per process and never closed: a cffi embedded plugin keeps Python
objects (its module, its callbacks) that would dangle after dlclose. Unregistering releases
every factory and forgets the registration; registering the same path again re-creates them.
"""

from __future__ import annotations

import logging
import os
import re
import sys
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
# What a missing symbol raises: an out-of-line FFI's own error (abi/outofline.py); AttributeError in-line.
_MISSING_SYMBOL = getattr(_ENTRY_FFI, "error", AttributeError)


# ---- the one gate ------------------------------------------------------------------------

def unlock_cffi_embedding() -> None:
    """Let a cffi-embedded plugin start in this process on Python 3.8 to 3.11.

    cffi's embedding start-up (cffi/_embedding.h, `_cffi_carefully_make_gil`) uses
    `PyCapsule_Type.tp_version_tag` as a process-wide spin lock that is free while it is 0; but
    CPython gives the capsule type a version tag the first time an attribute is looked up on it
    through the type cache (anyio's pytest plugin does, for one), and then the plugin's first call
    spins forever. `PyType_Modified` puts the tag back to 0 (it only invalidates that type's
    method cache). Python 3.12 and later use another field, which nothing writes."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    import ctypes
    import datetime

    ctypes.pythonapi.PyType_Modified(ctypes.py_object(type(datetime.datetime_CAPI)))

# (table, negotiated version, struct_size) -> (slots that fit, mandatory slots, every slot name):
# worked out once, since a table is negotiated often (one EpNotification per cross-stream wait).
_LAYOUTS: dict[tuple[str, int, int], tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _layout(table: str, negotiated: int, struct_size: int):
    key = (table, negotiated, struct_size)
    hit = _LAYOUTS.get(key)
    if hit is None:
        fits = tuple(name for name in abi.slots_at(table, negotiated)
                     if struct_size >= ffi.offsetof(table, name) + ffi.sizeof("void*"))
        since = abi.since_table()[table]
        required = tuple(name for name, (v, req) in since.items() if req and v <= negotiated)
        hit = _LAYOUTS[key] = (fits, required, tuple(since))
    return hit


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
        fits, required, names = _layout(table, negotiated, self.struct_size)
        for name in fits:
            fn = getattr(ptr, name)
            if fn != ffi.NULL:
                self.present[name] = fn
        for name in required:
            if name not in self.present:
                raise AbiVersionError(f"{owner}: mandatory slot {table}.{name} is NULL")
        for name in names:
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
            _check_entry_symbols(elf, path)
            _check_embedded_root(elf, path)
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


ENTRY_SYMBOLS = ("CreateEpFactories", "ReleaseEpFactory")
_FUNCTION_TYPES = ("STT_FUNC", "STT_GNU_IFUNC")


def _check_entry_symbols(elf, path: Path) -> None:
    """An entry symbol that exists but is not code (a data object) would be called and crash the
    process: its ELF symbol type is checked before dlopen. Missing symbols are left to dlopen's
    lookup, which also sees symbols of linked libraries."""
    dynsym = elf.get_section_by_name(".dynsym")
    if dynsym is None:
        return
    for name in ENTRY_SYMBOLS:
        for sym in dynsym.get_symbol_by_name(name) or ():
            kind = sym["st_info"]["type"]
            if sym["st_shndx"] != "SHN_UNDEF" and kind not in _FUNCTION_TYPES:
                raise PluginLoadError(f"plugin '{path}': entry symbol {name} is not a function (ELF symbol type "
                                      f"{kind}); a plugin must export {' and '.join(ENTRY_SYMBOLS)} as functions")


_EMBEDDED_ROOT = re.compile(rb"if '([^'\\]+)' not in sys\.path:\n    sys\.path\.insert\(0, ")


def _check_embedded_root(elf, path: Path) -> None:
    """A cffi-embedded Python plugin imports its code from the checkout it was built in; when that
    checkout is moved or deleted, its init code fails inside the plugin with a bare traceback.
    Say so before loading it."""
    section = elf.get_section_by_name(".rodata")
    if section is None or section["sh_size"] > 64 << 20:
        return
    match = _EMBEDDED_ROOT.search(section.data())
    if match is None:
        return
    root = match.group(1).decode("utf-8", "replace")
    if not os.path.isdir(root):
        raise PluginLoadError(f"plugin '{path}' was built for the checkout {root}, which no longer exists (moved "
                              f"or deleted); rebuild the plugin from the current checkout (python build.py)")


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
            except (AttributeError, NotImplementedError, _MISSING_SYMBOL) as exc:
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


MAX_NAME_BYTES = 4096


def text(p, what: str, error=PluginLoadError, allow_null: bool = True) -> str:
    """A C string from a plugin (a name): NULL is "" where allowed; it must be UTF-8."""
    if p == ffi.NULL:
        if allow_null:
            return ""
        raise error(f"{what} returned NULL; expected a UTF-8 name")
    raw = ffi.string(p, MAX_NAME_BYTES + 1)  # one byte more than allowed tells a long name from a limit-long one
    if len(raw) > MAX_NAME_BYTES:
        raise error(f"{what} is longer than {MAX_NAME_BYTES} bytes ({raw[:40]!r}...); names are limited to "
                    f"{MAX_NAME_BYTES} bytes of UTF-8 (a longer one would be cut, and then not match the EP's name)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} is not valid UTF-8 ({raw[:40]!r}); names must be UTF-8 text") from None


def release_rejected(table: str, ptr, release_slot: str = "Release") -> bool:
    """Release a plugin table the host rejected (a NULL mandatory slot, ...) through its own Release
    slot, where its version and struct_size still say where that slot is. A table of an unknown
    version or too short to hold the slot cannot be released safely: it is left to its plugin."""
    if ptr == ffi.NULL:
        return False
    version, size = int(ptr.version), int(ptr.struct_size)
    if not abi.ABI_MIN_VERSION <= version < abi.ABI_NEXT_GENERATION:
        return False
    if size < ffi.offsetof(table, release_slot) + ffi.sizeof("void*"):
        return False
    fn = getattr(ptr, release_slot)
    if fn == ffi.NULL:
        return False
    fn(ptr)
    return True


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
        unlock_cffi_embedding()  # the first call into a cffi-embedded plugin starts its Python side
        status = self.library.CreateEpFactories(
            ffi.new("char[]", self.name.encode()), self.env.api.base, self.logger, out, MAX_FACTORIES, count)
        hostapi.check(status, f"{self._owner()}: CreateEpFactories", PluginLoadError)
        n = int(count[0])
        if n == 0:
            raise PluginLoadError(f"{self._owner()}: CreateEpFactories returned no factory")
        if n > MAX_FACTORIES:
            self._release_raw(out, MAX_FACTORIES)  # what it did write, in the room it was given
            raise PluginLoadError(f"{self._owner()}: reported {n} factories; at most {MAX_FACTORIES} allowed")
        try:
            for i in range(n):
                slots = negotiate("EpFactory", out[i], self.env.api_version, self._owner())
                self.factories.append(self._describe(slots))
        except Exception:
            self._release_raw(out, n)
            self.factories.clear()
            raise

    def _release_raw(self, out, n: int) -> None:
        """Release factories the host will not use, in reverse order; their errors are only logged."""
        for i in reversed(range(n)):
            if out[i] != ffi.NULL:
                try:
                    hostapi.check(self.library.ReleaseEpFactory(out[i]), f"{self._owner()}: ReleaseEpFactory")
                except EpError as exc:
                    _log.warning("%s", exc)

    def _describe(self, slots: Slots) -> Factory:
        f = Factory(self.name, self.path, slots, self.env.api_version)
        owner = self._owner()
        f.name = text(slots.GetName(slots.ptr), f"{owner}: EpFactory.GetName", PluginLoadError, allow_null=False)
        f.vendor = text(slots.GetVendor(slots.ptr), f"{owner}: EpFactory.GetVendor", PluginLoadError)
        f.plugin_version = (text(slots.GetVersion(slots.ptr), f"{owner}: EpFactory.GetVersion", PluginLoadError)
                            if slots.GetVersion else "")
        devs = ffi.new("EpDevice[]", MAX_DEVICES)
        count = ffi.new("size_t*", 0)
        hostapi.check(slots.GetSupportedDevices(slots.ptr, devs, MAX_DEVICES, count),
                      f"{owner}: GetSupportedDevices", PluginLoadError)
        n = int(count[0])
        if n > MAX_DEVICES:
            raise PluginLoadError(f"{owner}: EpFactory.GetSupportedDevices reported {n} devices; the host gave "
                                  f"room for {MAX_DEVICES}, so at most {MAX_DEVICES} are allowed")
        f.device_structs = devs
        for i in range(n):
            d = devs[i]
            where = f"{owner}: EpFactory.GetSupportedDevices device {i}"
            mem = text(d.memory_info.name, f"{where} memory_info.name", PluginLoadError) \
                if d.memory_info != ffi.NULL else ""
            name = text(d.name, f"{where} name", PluginLoadError)
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
                # Allocators still held by outputs go now, while their factory exists. detach(), not
                # fin(): at interpreter exit weakref refuses to call finalizers that are not atexit.
                got = fin.detach()
                if got is not None:
                    got[1](*got[2])
            f.allocator_finalizers.clear()
            try:
                hostapi.check(self.library.ReleaseEpFactory(f.ptr), f"{self._owner()}: ReleaseEpFactory", EpError)
            except EpError as exc:
                errors.append(str(exc))
        self.factories.clear()
        hostapi.LOGGERS.drop(self.logger)
        if errors:
            _log.warning("%s", "; ".join(errors))


def negotiate_or_release(table: str, ptr, host_version: int, owner: str) -> Slots:
    """negotiate(), releasing the table through its own Release slot when the host rejects it
    (created by the plugin, then refused by the host: not leaked)."""
    try:
        return negotiate(table, ptr, host_version, owner)
    except PluginLoadError:
        release_rejected(table, ptr)
        raise
