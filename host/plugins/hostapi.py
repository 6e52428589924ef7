"""The host's side of the ABI: the EpApi/EpApiBase tables plugins call, and the status funnel.

The host uses cffi in ABI mode (no compiler): its callbacks are `ffi.callback` objects kept
alive by the HostApi. One HostApi serves one API version N: GetApi(v) answers for 1 <= v <= N,
each version's table cut at its own struct_size.
"""

from __future__ import annotations

import logging

import abi
from host.errors import EpError
from host.plugins.handles import HandleTable

_log = logging.getLogger("ephost.plugin")

EP_ABI = abi.ABI_VERSION
MAX_RANK = 64  # the highest tensor rank a plugin may report (checked before any dim is read)
ffi = abi.ffi_for(EP_ABI)


class StatusStore:
    """EpStatus objects created by CreateStatus and freed by ReleaseStatus: (code, C message)."""

    def __init__(self) -> None:
        self.handles: HandleTable[tuple[int, object]] = HandleTable(ffi, "EpStatus*")

    def create(self, code: int, message: bytes):
        return self.handles.add((code, ffi.new("char[]", message)))

    def get(self, ptr) -> tuple[int, str] | None:
        item = self.handles.get(ptr)
        if item is None:
            return None
        return item[0], ffi.string(item[1]).decode("utf-8", "replace")

    def message(self, ptr):
        """The C message of a live status, or None."""
        item = self.handles.get(ptr)
        return None if item is None else item[1]

    def release(self, ptr) -> None:
        self.handles.remove(ptr)

    def __len__(self) -> int:
        return len(self.handles)


STATUSES = StatusStore()
# Handed out only when even creating a status fails; it is never released (release is a no-op for it).
_FAILED_STATUS = ffi.cast("EpStatus*", ffi.new("char[1]"))


def check(status, what: str, error=EpError) -> None:
    """The one funnel for statuses returned by plugins: raise `error` with the plugin's text."""
    if status == ffi.NULL:
        return
    item = STATUSES.get(status)
    if item is None:
        raise error(f"{what}: the plugin returned a status the host did not create "
                    f"(a bad pointer {int(ffi.cast('uintptr_t', status)):#x})")
    STATUSES.release(status)
    code, message = item
    err = error(f"{what} failed ({abi.STATUS_NAMES.get(code, code)}): {message}")
    err.code = code
    raise err


# Kernel contexts lent to a plugin kernel's Compute (host/runtime/steps), by their EpKernelContext*.
CONTEXTS: HandleTable[object] = HandleTable(ffi, "EpKernelContext*")


class LoggerRegistry:
    """The EpLogger handles of plugin registrations: each names the Python logger it writes to."""

    def __init__(self) -> None:
        self.handles: HandleTable[str] = HandleTable(ffi, "EpLogger*")

    def make(self, name: str):
        return self.handles.add(name)

    def name(self, ptr) -> str:
        return self.handles.get(ptr) or "unknown"

    def drop(self, ptr) -> None:
        self.handles.remove(ptr)

    def __len__(self) -> int:
        return len(self.handles)


LOGGERS = LoggerRegistry()
_SEVERITY = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR}

# The session config entries an EP was created with, by their EpSessionOptions*.
SESSION_OPTIONS: HandleTable[dict[str, str]] = HandleTable(ffi, "EpSessionOptions*")


def _status(code: int, message: str):
    return STATUSES.create(code, message.encode("utf-8", "replace"))


# ---- callbacks (module level so that every HostApi shares them) ---------------------------
# Every callback is guarded: an exception inside one must never reach cffi's default return
# value, which for a status is NULL, i.e. "OK". Status callbacks answer EP_RUNTIME_EXCEPTION
# with the exception's text; the others log and return their documented neutral value.

def _status_onerror(exc_type, exc, tb):
    _log.error("host callback failed: %s: %s", getattr(exc_type, "__name__", exc_type), exc)
    try:
        return STATUSES.create(abi.EP_RUNTIME_EXCEPTION,
                               f"host callback failed: {getattr(exc_type, '__name__', exc_type)}: {exc}"
                               .encode("utf-8", "replace"))
    except BaseException:  # noqa: BLE001 - no memory for a status: the static one still says "failed"
        return _FAILED_STATUS


def _log_onerror(exc_type, exc, tb):
    _log.error("host callback failed: %s: %s", getattr(exc_type, "__name__", exc_type), exc)
    return None



@ffi.callback("EpStatus*(*)(int32_t, const char*)", onerror=_status_onerror)
def _create_status(code, message):
    text = ffi.string(message) if message != ffi.NULL else b""
    return STATUSES.create(code, text)


@ffi.callback("int32_t(*)(const EpStatus*)", error=abi.EP_INVALID_ARGUMENT, onerror=_log_onerror)
def _get_error_code(status):
    item = STATUSES.get(status)
    return abi.EP_INVALID_ARGUMENT if item is None else item[0]


_UNKNOWN = ffi.new("char[]", b"unknown status (not created by this host)")


def _message_onerror(exc_type, exc, tb):
    _log_onerror(exc_type, exc, tb)
    return _UNKNOWN


@ffi.callback("const char*(*)(const EpStatus*)", onerror=_message_onerror)
def _get_error_message(status):
    text = STATUSES.message(status)
    return _UNKNOWN if text is None else text


@ffi.callback("void(*)(EpStatus*)", onerror=_log_onerror)
def _release_status(status):
    STATUSES.release(status)


@ffi.callback("void(*)(const EpLogger*, int32_t, const char*)", onerror=_log_onerror)
def _logger_log(logger, severity, message):
    name = LOGGERS.name(logger) if logger != ffi.NULL else "unknown"
    text = ffi.string(message).decode("utf-8", "replace") if message != ffi.NULL else ""
    logging.getLogger(f"ephost.plugin.{name}").log(_SEVERITY.get(severity, logging.INFO), "%s", text)


@ffi.callback("EpStatus*(*)(const EpSessionOptions*, const char*, char*, size_t*)", onerror=_status_onerror)
def _get_config_entry(options, key, value, size):
    entries = SESSION_OPTIONS.get(options)
    if entries is None or key == ffi.NULL or size == ffi.NULL:
        return _status(abi.EP_INVALID_ARGUMENT, "SessionOptions_GetConfigEntry: bad session options, key or size")
    try:
        name = ffi.string(key).decode("utf-8")
    except UnicodeDecodeError:
        return _status(abi.EP_INVALID_ARGUMENT, f"SessionOptions_GetConfigEntry: the key is not valid UTF-8 "
                                                f"({ffi.string(key)[:64]!r}); keys are UTF-8 text")
    if name not in entries:
        return _status(abi.EP_NOT_FOUND, f"no session config entry {name!r}")
    data = entries[name].encode() + b"\0"
    if value == ffi.NULL:
        size[0] = len(data)
        return ffi.NULL
    if size[0] < len(data):
        have, need = int(size[0]), len(data)
        size[0] = need
        return _status(abi.EP_INVALID_ARGUMENT, f"buffer of {have} bytes too small; need {need}")
    ffi.memmove(value, data, len(data))
    size[0] = len(data)
    return ffi.NULL


def _live_context(context):
    """The host object behind a kernel context, or None when the pointer is unknown or its Compute
    call has returned (a context, like every handle lent for one call, is valid only during it)."""
    obj = CONTEXTS.get(context)
    return obj if obj is not None and getattr(obj, "active", True) else None  # stand-ins in tests have no flag


def _context_call(name: str, context, fn):
    obj = _live_context(context)
    if obj is None:
        return _status(abi.EP_INVALID_ARGUMENT, f"{name}: unknown kernel context (a bad pointer or a "
                                                "context used outside Compute)")
    try:
        return fn(obj)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status for the plugin
        code = getattr(exc, "abi_code", abi.EP_FAIL)
        return _status(code, f"{name}: {exc}")


@ffi.callback("EpStatus*(*)(EpKernelContext*, const EpKernelIO**)", onerror=_status_onerror)
def _kc_get_io(context, io):
    obj = _live_context(context)
    if obj is None or io == ffi.NULL:
        return _status(abi.EP_INVALID_ARGUMENT, "KernelContext_GetIO: unknown kernel context or NULL out")
    io[0] = obj.io
    return ffi.NULL


@ffi.callback("EpStatus*(*)(EpKernelContext*, int32_t, const int64_t*, int32_t, EpTensor**)", onerror=_status_onerror)
def _kc_get_output(context, index, shape, ndim, out):
    obj = _live_context(context)
    if obj is None or out == ffi.NULL or (ndim > 0 and shape == ffi.NULL):
        return _status(abi.EP_INVALID_ARGUMENT, "KernelContext_GetOutput: unknown kernel context (a bad pointer "
                                                "or a context used outside Compute), NULL out or bad shape")
    if not 0 <= ndim <= MAX_RANK:  # checked before a single dim is read
        return _status(abi.EP_INVALID_ARGUMENT, f"KernelContext_GetOutput: rank {int(ndim)} is not allowed; "
                                                f"expected 0..{MAX_RANK}")
    try:
        out[0] = obj.get_output(index, tuple(shape[0:ndim]) if ndim else ())
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status for the plugin
        return _status(getattr(exc, "abi_code", abi.EP_FAIL), f"KernelContext_GetOutput: {exc}")
    return ffi.NULL


@ffi.callback("EpStatus*(*)(EpKernelContext*, void**)", onerror=_status_onerror)
def _kc_get_stream(context, stream):
    def run(obj):
        if stream == ffi.NULL:
            return _status(abi.EP_INVALID_ARGUMENT, "KernelContext_GetGPUComputeStream: NULL out pointer")
        stream[0] = obj.io.gpu_compute_stream
        return ffi.NULL
    return _context_call("KernelContext_GetGPUComputeStream", context, run)


@ffi.callback("EpStatus*(*)(EpKernelContext*, EpSyncStream**)", onerror=_status_onerror)
def _kc_get_sync_stream(context, stream):
    def run(obj):
        if stream == ffi.NULL:
            return _status(abi.EP_INVALID_ARGUMENT, "KernelContext_GetSyncStream: NULL out pointer")
        stream[0] = obj.sync_stream if obj.sync_stream is not None else ffi.NULL
        return ffi.NULL
    return _context_call("KernelContext_GetSyncStream", context, run)


class FuseRegistry:
    """Groups of nodes EPs ask to fuse (v6), collected per graph view while GetCapability runs."""

    def __init__(self) -> None:
        self.handles: HandleTable[list[tuple[int, ...]]] = HandleTable(ffi, "EpGraphView*")

    def begin(self, view_ptr) -> list[tuple[int, ...]]:
        groups: list[tuple[int, ...]] = []
        self.handles.bind(view_ptr, groups)
        return groups

    def end(self, view_ptr) -> None:
        self.handles.remove(view_ptr)

    def get(self, view_ptr):
        return self.handles.get(view_ptr)

    def open_views(self) -> int:
        """How many graph views are between begin and end (0 outside GetCapability)."""
        return len(self.handles)


FUSE_GROUPS = FuseRegistry()


@ffi.callback("EpStatus*(*)(const EpGraphView*, const int32_t*, size_t)", onerror=_status_onerror)
def _graph_add_nodes_to_fuse(graph, nodes, count):
    groups = FUSE_GROUPS.get(graph)
    if groups is None:
        return _status(abi.EP_INVALID_ARGUMENT, "Graph_AddNodesToFuse: the graph is not in GetCapability "
                                                "(call it only from GetCapability, with the graph it received)")
    if count == 0 or nodes == ffi.NULL:
        return _status(abi.EP_INVALID_ARGUMENT, f"Graph_AddNodesToFuse: expected 1 or more node indices; "
                                                f"got count {int(count)}{' and NULL' if nodes == ffi.NULL else ''}")
    if count > graph.num_nodes:  # checked before reading: a lying count must not walk off the array
        return _status(abi.EP_INVALID_ARGUMENT, f"Graph_AddNodesToFuse: count {int(count)} exceeds the graph's "
                                                f"{graph.num_nodes} node(s)")
    group = tuple(int(nodes[i]) for i in range(count))
    bad = [i for i in group if not 0 <= i < graph.num_nodes]
    if bad:
        return _status(abi.EP_INVALID_ARGUMENT, f"Graph_AddNodesToFuse: node indices {bad} out of range; "
                                                f"allowed 0..{graph.num_nodes - 1}")
    if len(set(group)) != len(group):
        return _status(abi.EP_INVALID_ARGUMENT, f"Graph_AddNodesToFuse: node indices {list(group)} repeat a node")
    groups.append(group)
    return ffi.NULL


_VERSION_STRING = ffi.new("char[]", b"ephost 0.1.0")


@ffi.callback("const char*(*)(void)", onerror=_log_onerror)
def _get_version_string():
    return _VERSION_STRING


_SLOTS = {
    "CreateStatus": _create_status, "GetErrorCode": _get_error_code,
    "GetErrorMessage": _get_error_message, "ReleaseStatus": _release_status,
    "Logger_Log": _logger_log, "SessionOptions_GetConfigEntry": _get_config_entry,
    "KernelContext_GetIO": _kc_get_io, "KernelContext_GetOutput": _kc_get_output,
    "KernelContext_GetGPUComputeStream": _kc_get_stream,
    "KernelContext_GetSyncStream": _kc_get_sync_stream,
    "Graph_AddNodesToFuse": _graph_add_nodes_to_fuse,
}


_API_TABLES: dict[int, object] = {}


def _api_table(version: int):
    """The EpApi table of `version`, one per process: plugins keep the pointer for as long as they
    live, which can be longer than the Environment that handed it out."""
    table = _API_TABLES.get(version)
    if table is None:
        table = ffi.new("EpApi*")
        table.struct_size = abi.ffi_for(version).sizeof("EpApi")
        table.version = version
        for name in abi.slots_at("EpApi", version):
            setattr(table, name, _SLOTS[name])
        _API_TABLES[version] = table
    return table


class HostApi:
    """EpApiBase + one EpApi table per served version (1..api_version)."""

    def __init__(self, api_version: int = EP_ABI):
        abi.check_known_version(api_version)
        self.version = api_version
        # Each version's table is made on first GetApi(v): its size comes from parsing that version's
        # declarations, which a plugin built for this host's version never needs.
        self._tables: dict[int, object] = {}
        self._get_api = ffi.callback("const EpApi*(*)(uint32_t)", self._lookup, onerror=_log_onerror)
        self.base = ffi.new("EpApiBase*")
        self.base.struct_size = ffi.sizeof("EpApiBase")
        self.base.version = api_version
        self.base.GetApi = self._get_api
        self.base.GetVersionString = _get_version_string
        self.requested: list[int] = []

    def _lookup(self, version):
        version = int(version)
        self.requested.append(version)
        table = self._tables.get(version)
        if table is None and abi.ABI_MIN_VERSION <= version <= self.version:
            table = self._tables[version] = _api_table(version)
        return ffi.NULL if table is None else table
