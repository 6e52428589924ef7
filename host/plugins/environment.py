"""The Environment: plugins registered by path, the host API version served, EP devices."""

from __future__ import annotations

import threading
from pathlib import Path

import abi
from host.errors import InvalidArgument, PluginLoadError
from host.plugins.builtin import builtin_registration_name, find_builtin_plugin  # noqa: F401 (re-export)
from host.plugins.hostapi import HostApi
from host.plugins.loader import EpDeviceInfo, PluginRegistration


class Environment:
    """Registers EP plugin libraries and serves them host API version `api_version`."""

    def __init__(self, api_version: int = abi.ABI_VERSION):
        if api_version not in abi.SUPPORTED_VERSIONS:
            raise InvalidArgument(f"api_version {api_version} is not served; allowed: "
                                  f"{abi.ABI_MIN_VERSION}..{abi.ABI_VERSION}")
        self.api_version = api_version
        self.api = HostApi(api_version)
        self._plugins: dict[str, PluginRegistration] = {}
        self._lock = threading.Lock()
        self._closed = False

    def register_plugin(self, name: str, path: str | Path) -> PluginRegistration:
        """Load the library at `path` and create its factories under `name`."""
        if not name or not isinstance(name, str):
            raise InvalidArgument(f"plugin registration name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self._plugins:
                raise InvalidArgument(f"a plugin is already registered as {name!r} "
                                      f"({self._plugins[name].path}); unregister it first")
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
        if self._closed:
            return
        errors = []
        for name in list(self._plugins):
            try:
                self.unregister_plugin(name)
            except PluginLoadError as exc:
                errors.append(str(exc))
        self._closed = True
        if errors:
            raise PluginLoadError("; ".join(errors))

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
