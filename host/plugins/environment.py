"""The Environment: plugins registered by path, the host API version served, EP devices."""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import abi
from host.errors import InvalidArgument, PluginLoadError

if TYPE_CHECKING:
    from host.plugins.loader import EpDeviceInfo, PluginRegistration

_log = logging.getLogger("ephost")
_ENVIRONMENTS: weakref.WeakSet = weakref.WeakSet()  # closed at interpreter exit, sessions first
_SERIALS = itertools.count()


class Environment:
    """Registers EP plugin libraries and serves them host API version `api_version`."""

    def __init__(self, api_version: int = abi.ABI_VERSION):
        if api_version not in abi.SUPPORTED_VERSIONS:
            raise InvalidArgument(f"api_version {api_version} is not served; allowed: "
                                  f"{abi.ABI_MIN_VERSION}..{abi.ABI_VERSION}")
        self.api_version = api_version
        self._api = None  # the host API tables, made when a plugin is first registered (cffi parsing costs)
        self._plugins: dict[str, PluginRegistration] = {}
        # Reentrant: garbage collection can close a session (forget_session) on a thread that holds it.
        self._lock = threading.RLock()
        self._closed = False
        # Sessions created on this environment, in creation order; weak, so that a session nobody
        # holds can still be garbage collected (its finalizer closes it and forgets it here).
        self._sessions: dict[int, weakref.ref] = {}
        _ENVIRONMENTS.add(self)

    @property
    def api(self):
        """The HostApi served to this environment's plugins."""
        if self._api is None:
            from host.plugins.hostapi import HostApi

            self._api = HostApi(self.api_version)
        return self._api

    # -- sessions ------------------------------------------------------------------------------
    def track_session(self, session) -> None:
        """Called by a new InferenceSession: close() closes it before releasing any plugin."""
        if self._closed:
            raise InvalidArgument("this Environment is closed; create a new one")
        key = next(_SERIALS)
        session._env_key = key
        with self._lock:
            self._sessions[key] = weakref.ref(session)

    def forget_session(self, session) -> None:
        with self._lock:
            self._sessions.pop(getattr(session, "_env_key", None), None)

    def sessions(self) -> list:
        """The sessions of this environment that are still open, oldest first."""
        with self._lock:
            refs = list(self._sessions.values())
        return [s for s in (r() for r in refs) if s is not None and not s._closed]

    def register_plugin(self, name: str, path: str | Path) -> PluginRegistration:
        """Load the library at `path` and create its factories under `name`."""
        if not name or not isinstance(name, str):
            raise InvalidArgument(f"plugin registration name must be a non-empty string, got {name!r}")
        if self._closed:
            raise InvalidArgument("this Environment is closed; create a new one")
        with self._lock:
            if name in self._plugins:
                raise InvalidArgument(f"a plugin is already registered as {name!r} "
                                      f"({self._plugins[name].path}); unregister it first")
            from host.plugins.loader import PluginRegistration  # loading plugins needs the cffi tables

            reg = PluginRegistration(self, name, Path(path))
            self._plugins[name] = reg
            return reg

    def unregister_plugin(self, name: str) -> None:
        with self._lock:
            reg = self._plugins.get(name)
            if reg is None:
                raise InvalidArgument(f"no plugin registered as {name!r}; registered: {sorted(self._plugins)}")
            reg.close()
            del self._plugins[name]

    def plugin(self, name: str) -> PluginRegistration:
        try:
            return self._plugins[name]
        except KeyError:
            raise InvalidArgument(f"no plugin registered as {name!r}; registered: {sorted(self._plugins)}") from None

    @property
    def plugins(self) -> dict[str, PluginRegistration]:
        return dict(self._plugins)

    def ep_devices(self) -> list[EpDeviceInfo]:
        return [d for reg in self._plugins.values() for f in reg.factories for d in f.devices]

    def find_factory(self, ep_name: str):
        """The factory whose EP is called `ep_name` (the provider name a session asks for)."""
        for reg in self._plugins.values():
            for f in reg.factories:
                if f.name == ep_name:
                    return reg, f
        return None, None

    def ensure_builtin(self, provider: str) -> bool:
        """Register the built-in plugin for `provider` unless an EP of that name is registered already.

        True when an EP called `provider` is available afterwards; False when `provider` is not built in.
        """
        from host.plugins.builtin import builtin_registration_name, find_builtin_plugin

        if self.find_factory(provider)[1] is not None:
            return True
        name = builtin_registration_name(provider)
        if name is None:
            return False
        path = find_builtin_plugin(provider)
        with self._lock:
            registered = name in self._plugins
        if not registered:
            self.register_plugin(name, path)
        return self.find_factory(provider)[1] is not None

    def close(self) -> None:
        """Close every open session (newest first), then release every plugin (newest first).

        Idempotent. When something still holds a plugin after the sessions were closed, nothing is
        released and the environment stays open (close() can be retried): never half torn down."""
        if self._closed:
            return
        errors = []
        for session in reversed(self.sessions()):
            try:
                session.close()
            except Exception as exc:  # noqa: BLE001 - every session is closed; the first failure is reported
                errors.append(f"closing a session failed: {exc}")
        busy = {name: reg._users for name, reg in self._plugins.items() if reg._users > 0}
        if busy:
            raise PluginLoadError(
                "Environment.close(): plugin(s) still used by sessions that could not be closed: "
                + ", ".join(f"{n!r} ({u} session(s))" for n, u in busy.items())
                + (f" ({'; '.join(errors)})" if errors else "") + "; nothing was released")
        self._closed = True
        for name in reversed(list(self._plugins)):
            try:
                self.unregister_plugin(name)
            except PluginLoadError as exc:
                errors.append(str(exc))
        with self._lock:
            self._sessions.clear()
        if errors:
            raise PluginLoadError("; ".join(errors))

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_at_exit() -> None:
    """Interpreter exit: sessions, then EPs, then factories, in that order, and silently (left to
    garbage collection, their order is arbitrary and allocations outlive their allocators)."""
    for env in list(_ENVIRONMENTS):
        try:
            env.close()
        except Exception as exc:  # noqa: BLE001 - exit goes on
            _log.debug("closing an Environment at exit failed: %s", exc)
