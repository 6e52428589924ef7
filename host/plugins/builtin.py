"""Plugins that ship with ephost, found by provider name and built on first use.

A session that asks for "CUDAExecutionProvider" without registering a library gets the CUDA plugin
built for this interpreter into the per-user cache (abi.builder), so a `pip install .` works without a
checkout and without running build.py first. The host refers to the plugin's entry point only as a
string handed to the builder: it never imports the plugin's modules.

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


def find_builtin_plugin(provider: str) -> Path | None:
    """Path of the library for built-in `provider` (building it if needed); None if not built in.

    $EPHOST_CUDA_PLUGIN (a path) overrides the cache for the CUDA plugin.
    """
    spec = BUILTIN_PLUGINS.get(provider)
    if spec is None:
        return None
    name, entry = spec
    override = os.environ.get(f"EPHOST_{name.upper()}_PLUGIN")
    if override:
        return Path(override)
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
    try:
        builder.check_toolchain(name)  # first: cheaper than the cache key
    except builder.BuildError as exc:
        if builder.cached_plugin_path(name, entry)[0].is_file():  # built before, when there was a compiler
            return None
        return f"{provider} needs its plugin built for this Python: {exc}"
    return None
