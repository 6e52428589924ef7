"""A plugin EP instance inside a session: its slots, allocator, data transfer and streams."""

from __future__ import annotations

import logging
import threading
import weakref

import abi
from host.errors import EpError, InvalidArgument, PluginLoadError
from host.plugins import hostapi
from host.plugins.hostapi import ffi
from host.plugins.loader import Factory, PluginRegistration, Slots, negotiate, negotiate_or_release, text

_log = logging.getLogger("ephost")
CPU_LOCATION = (abi.DEVICE_CPU, 0)


def _kv_array(entries: dict[str, str]):
    keep = []
    arr = ffi.new("EpKeyValue[]", max(len(entries), 1))
    for i, (k, v) in enumerate(entries.items()):
        kc, vc = ffi.new("char[]", str(k).encode()), ffi.new("char[]", str(v).encode())
        keep += [kc, vc]
        arr[i].key, arr[i].value = kc, vc
    return arr, keep


class SyncStream:
    """A plugin's EpSyncStream with its resolved slots; released by close()."""

    def __init__(self, slots: Slots, owner: str):
        self.slots = slots
        self.ptr = slots.ptr
        self.owner = owner
        self.handle = slots.GetHandle(self.ptr)
        self._closed = False

    def notify_and_wait(self, consumer: SyncStream | None) -> None:
        """Make `consumer` (or the host when None) wait for the work queued so far on this stream."""
        out = ffi.new("EpNotification**")
        hostapi.check(self.slots.CreateNotification(self.ptr, out), f"{self.owner}: CreateNotification")
        n = negotiate_or_release("EpNotification", out[0], self.slots.negotiated, self.owner)
        try:
            hostapi.check(n.Activate(n.ptr), f"{self.owner}: Notification.Activate")
            if consumer is None:
                hostapi.check(n.WaitOnHost(n.ptr), f"{self.owner}: Notification.WaitOnHost")
            else:
                hostapi.check(n.WaitOnDevice(n.ptr, consumer.ptr), f"{self.owner}: Notification.WaitOnDevice")
        finally:
            n.Release(n.ptr)

    def on_run_end(self) -> None:
        if self.slots.OnSessionRunEnd is not None:
            hostapi.check(self.slots.OnSessionRunEnd(self.ptr), f"{self.owner}: OnSessionRunEnd")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.slots.Release(self.ptr)


class PluginEp:
    """One EP created by a plugin factory for one session."""

    def __init__(self, reg: PluginRegistration, factory: Factory, options: dict[str, str],
                 session_config: dict[str, str]):
        self.registration = reg
        self.factory = factory
        self.owner = f"EP '{factory.name}' of plugin '{reg.name}' ({reg.path})"
        if not factory.devices:
            raise EpError(f"{self.owner} has no device")
        self._keep: list = []
        self._closed = False
        self.transfer = self.allocator = None
        self._streams: list[SyncStream] = []
        self._stream_lock = threading.Lock()
        self.slots = self._create_ep(options, session_config)
        self.ptr = self.slots.ptr
        try:
            self._init_after_create(factory)
        except BaseException:
            self.close()  # what was acquired goes, in reverse order, the EP last
            raise

    def _init_after_create(self, factory: Factory) -> None:
        name = self.slots.GetName(self.ptr)
        self.name = text(name, f"{self.owner}: Ep.GetName", EpError) if name != ffi.NULL else factory.name
        self.device = factory.devices[0]
        self.meminfo = factory.device_structs[0].memory_info
        self.location = (self.device.device_type, self.device.device_id)
        self.allocator = self._create_allocator()
        self.transfer = self._create_transfer()
        fs = factory.slots
        self.stream_aware = (self._flag(fs.IsStreamAware(fs.ptr), "EpFactory.IsStreamAware")
                             if fs.IsStreamAware is not None else False)
        self.concurrent_runs = self._concurrent_supported()

    def _flag(self, value: int, slot: str) -> bool:
        """An int32 yes/no from a plugin: 0 or 1, anything else is a broken plugin, not a "yes"."""
        if value not in (0, 1):
            raise EpError(f"{self.owner}: {slot} returned {int(value)}; expected 0 or 1")
        return bool(value)

    # -- creation ------------------------------------------------------------------------
    def _create_ep(self, options: dict[str, str], session_config: dict[str, str]) -> Slots:
        f = self.factory
        kv, keep = _kv_array(options)
        sess_ptr = hostapi.SESSION_OPTIONS.add(dict(session_config))
        self._keep += [kv, keep]
        self._session_options = sess_ptr
        out = ffi.new("Ep**")
        status = f.slots.CreateEp(f.ptr, f.device_structs, 1, kv, len(options), sess_ptr,
                                  self.registration.logger, out)
        try:
            hostapi.check(status, f"{self.owner}: CreateEp", EpError)
        except EpError as exc:
            hostapi.SESSION_OPTIONS.remove(sess_ptr)  # no EP, so nobody reads them again
            if exc.code == abi.EP_INVALID_ARGUMENT:
                raise InvalidArgument(str(exc)) from None
            raise
        try:
            return negotiate("Ep", out[0], self.registration.env.api_version, self.owner)
        except PluginLoadError:
            if out[0] != ffi.NULL:
                f.slots.ReleaseEp(f.ptr, out[0])
            hostapi.SESSION_OPTIONS.remove(sess_ptr)
            raise

    def _create_allocator(self) -> Slots | None:
        out = ffi.new("EpAllocator**")
        if self.slots.CreateAllocator is not None:
            hostapi.check(self.slots.CreateAllocator(self.ptr, self.meminfo, out), f"{self.owner}: CreateAllocator")
        elif self.factory.slots.CreateAllocator is not None:
            fs = self.factory.slots
            hostapi.check(fs.CreateAllocator(fs.ptr, self.meminfo, out), f"{self.owner}: factory CreateAllocator")
        if out[0] == ffi.NULL:
            if self.location != CPU_LOCATION:
                raise EpError(f"{self.owner}: device memory needs an allocator, and the plugin gave none")
            return None
        fs = self.factory.slots
        try:
            slots = negotiate("EpAllocator", out[0], self.slots.negotiated, self.owner)
        except PluginLoadError:
            if fs.ReleaseAllocator is not None:
                fs.ReleaseAllocator(fs.ptr, out[0])
            raise
        if fs.ReleaseAllocator is not None:
            # Live allocations keep the Slots object alive; the allocator goes when the last does,
            # or when the plugin is unregistered, whichever comes first (never after its factory).
            # `released` tells allocations that outlive it (a caller's output at exit) not to Free into it.
            slots.released = released = [False]
            fin = weakref.finalize(slots, _release_allocator, fs.ReleaseAllocator, fs.ptr, slots.ptr, released)
            # Not at exit on its own: weakref's exit hook would run before the Environment's (it is
            # registered later), releasing allocators under live sessions. The Environment's exit
            # close releases them in order (sessions, EPs, then allocators with their factory).
            fin.atexit = False
            alive = [f for f in self.factory.allocator_finalizers if f.alive]  # drop the ones that ran
            self.factory.allocator_finalizers[:] = [*alive, fin]
        return slots

    def _create_transfer(self) -> Slots | None:
        fs = self.factory.slots
        if fs.CreateDataTransfer is None:
            return None
        out = ffi.new("EpDataTransfer**")
        hostapi.check(fs.CreateDataTransfer(fs.ptr, out), f"{self.owner}: CreateDataTransfer")
        if out[0] == ffi.NULL:
            return None
        return negotiate_or_release("EpDataTransfer", out[0], self.slots.negotiated, self.owner)

    def _concurrent_supported(self) -> bool:
        # Where the plugin cannot say (v1, or a NULL slot), concurrent runs are assumed unsafe.
        fn = self.slots.IsConcurrentRunSupported
        if fn is None:
            return False
        out = ffi.new("int32_t*", 0)
        hostapi.check(fn(self.ptr, out), f"{self.owner}: Ep.IsConcurrentRunSupported")
        return self._flag(out[0], "Ep.IsConcurrentRunSupported")

    def create_stream(self) -> SyncStream | None:
        if not self.stream_aware:
            return None
        out = ffi.new("EpSyncStream**")
        if self.slots.CreateSyncStreamForDevice is not None:
            hostapi.check(self.slots.CreateSyncStreamForDevice(self.ptr, self.meminfo, out),
                          f"{self.owner}: CreateSyncStreamForDevice")
        elif self.factory.slots.CreateSyncStreamForDevice is not None:
            fs = self.factory.slots
            hostapi.check(fs.CreateSyncStreamForDevice(fs.ptr, self.meminfo, out),
                          f"{self.owner}: factory CreateSyncStreamForDevice")
        if out[0] == ffi.NULL:
            return None
        stream = SyncStream(negotiate_or_release("EpSyncStream", out[0], self.slots.negotiated, self.owner),
                            self.owner)
        with self._stream_lock:
            self._streams.append(stream)
        return stream

    def release_stream(self, stream: SyncStream) -> None:
        """Release one stream before the EP closes (the state of a thread that ended)."""
        with self._stream_lock:
            if stream not in self._streams:
                return  # the EP closed first and released it
            self._streams.remove(stream)
        stream.close()

    # -- graph capture (v3..v5) -----------------------------------------------------------
    def graph_capture_enabled(self) -> bool:
        s = self.slots
        if s.IsGraphCaptureEnabled is None or s.IsGraphCaptured is None or s.ReplayGraph is None:
            return False
        return self._flag(s.IsGraphCaptureEnabled(self.ptr), "Ep.IsGraphCaptureEnabled")

    def graph_policy(self) -> int:
        fn = self.slots.GetGraphCaptureNodeAssignmentPolicy
        if fn is None:
            return abi.GRAPH_ALL_NODES_ON_EP
        policy = int(fn(self.ptr))
        if policy not in (abi.GRAPH_ALL_NODES_ON_EP, abi.GRAPH_ALLOW_CPU_FOR_SHAPES):
            raise EpError(f"{self.owner}: Ep.GetGraphCaptureNodeAssignmentPolicy returned {policy}; expected "
                          f"{abi.GRAPH_ALL_NODES_ON_EP} (ALL_NODES_ON_EP) or {abi.GRAPH_ALLOW_CPU_FOR_SHAPES} "
                          "(ALLOW_CPU_FOR_SHAPES)")
        return policy

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release streams, the data transfer and the EP, in reverse order of creation; closing twice
        (or after a failed __init__) is fine."""
        if self._closed:
            return
        self._closed = True
        with self._stream_lock:
            streams, self._streams = self._streams, []
        for s in reversed(streams):
            s.close()
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.Release(transfer.ptr)
        # The allocator goes when its Slots does (a finalizer): dropped before ReleaseEp, with no allocation
        # left to hold it, it went before the EP that created it (seen under concurrent runs in CI).
        allocator, self.allocator = self.allocator, None
        self.factory.slots.ReleaseEp(self.factory.ptr, self.ptr)
        del allocator
        hostapi.SESSION_OPTIONS.remove(self._session_options)


def check_options_without_device(reg: PluginRegistration, factory: Factory, options: dict[str, str],
                                 session_config: dict[str, str]) -> None:
    """Let an EP with no device see its provider options once, so that a mistake is an error instead
    of being silently ignored: CreateEp is called with no device (num_devices 0). EP_INVALID_ARGUMENT
    means bad options; any other answer (an error for "no device", or even an EP, released at once)
    means the session falls back to the CPU EP as before."""
    f = factory
    owner = f"EP '{factory.name}' of plugin '{reg.name}' ({reg.path})"
    kv, _keep = _kv_array(options)
    sess_ptr = hostapi.SESSION_OPTIONS.add(dict(session_config))
    out = ffi.new("Ep**")
    try:
        status = f.slots.CreateEp(f.ptr, ffi.NULL, 0, kv, len(options), sess_ptr, reg.logger, out)
        if out[0] != ffi.NULL:
            f.slots.ReleaseEp(f.ptr, out[0])
        try:
            hostapi.check(status, f"{owner}: CreateEp", EpError)
        except EpError as exc:
            if exc.code == abi.EP_INVALID_ARGUMENT:
                raise InvalidArgument(str(exc)) from None
    finally:
        hostapi.SESSION_OPTIONS.remove(sess_ptr)


def _release_allocator(release, factory_ptr, allocator_ptr, released: list) -> None:
    released[0] = True
    try:
        release(factory_ptr, allocator_ptr)
    except Exception:  # noqa: BLE001 - runs from a finalizer
        pass
