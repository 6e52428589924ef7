"""Plugins that ship with ephost, found by provider name.

A session that asks for "CUDAExecutionProvider" without registering a library gets the CUDA plugin the
package build compiled into plugin_cuda/ (`pip install .`, a wheel: setup.py calls `package_extensions`).
Where there is none (a source tree, an install made without a compiler), the plugin is built for this
interpreter into the per-user cache on first use (abi.builder). The host refers to the plugin's entry
point only as a string handed to the builder: it never imports the plugin's modules.

Where the plugin cannot be built (no C compiler, no Python headers) or loaded, a session falls back to
the CPU EP with a warning, as onnxruntime does, and get_available_providers() leaves it out
(`unavailable_reason` says why, without building anything).
"""

from __future__ import annotations

import os
from pathlib import Path

from abi import builder
from host.errors import PluginBuildError

# provider name -> (registration name, "module:function" entry point the shim calls)
BUILTIN_PLUGINS: dict[str, tuple[str, str]] = {
    "CUDAExecutionProvider": ("cuda", "plugin_cuda.plugin:create_factories"),
}


def builtin_registration_name(provider: str) -> str | None:
    """The name a built-in provider is registered under, or None if `provider` is not built in."""
    spec = BUILTIN_PLUGINS.get(provider)
    return spec[0] if spec else None


def package_extensions() -> list:
    """The setuptools Extensions that compile every built-in plugin into its package (setup.py)."""
    return [builder.packaged_extension(name, entry, _package(entry)) for name, entry in BUILTIN_PLUGINS.values()]


def _package(entry: str) -> str:
    """The top-level package of an entry point ("plugin_cuda.plugin:f" -> "plugin_cuda"): the build puts
    the plugin's library there."""
    return entry.split(":")[0].split(".")[0]


def packaged_plugin(provider: str) -> Path | None:
    """The library the package build compiled for built-in `provider` and this interpreter, if it is there."""
    name, entry = BUILTIN_PLUGINS[provider]
    path = builder.packaged_plugin_path(name, entry, builder.PACKAGE_ROOT / _package(entry))
    return path if path.is_file() else None


def find_builtin_plugin(provider: str) -> Path | None:
    """Path of the library for built-in `provider`; None if not built in. In order: $EPHOST_CUDA_PLUGIN
    (a path) for the CUDA plugin, the package's own build, the per-user cache (built there if needed).
    """
    spec = BUILTIN_PLUGINS.get(provider)
    if spec is None:
        return None
    name, entry = spec
    override = os.environ.get(f"EPHOST_{name.upper()}_PLUGIN")
    if override:
        return Path(override)
    packaged = packaged_plugin(provider)
    if packaged is not None:
        return packaged
    try:
        return builder.cached_plugin(name, entry)
    except builder.BuildError as exc:
        raise PluginBuildError(f"{provider} needs its plugin built for this Python: {exc}") from exc


def unavailable_reason(provider: str) -> str | None:
    """None when built-in `provider`'s plugin is there or can be built now, else why not (nothing is
    built: a toolchain check and file lookups only)."""
    spec = BUILTIN_PLUGINS.get(provider)
    if spec is None:
        return f"{provider} is not a built-in provider"
    name, entry = spec
    variable = f"EPHOST_{name.upper()}_PLUGIN"
    override = os.environ.get(variable)
    if override:
        return None if Path(override).is_file() else f"${variable} names {override}, which is not a file"
    if packaged_plugin(provider) is not None:
        return None
    try:
        builder.check_toolchain(name)  # first: cheaper than the cache key
    except builder.BuildError as exc:
        if builder.cached_plugin_path(name, entry)[0].is_file():  # built before, when there was a compiler
            return None
        return f"{provider} needs its plugin built for this Python: {exc}"
    return None
