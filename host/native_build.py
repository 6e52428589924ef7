"""Build every compiled part of ephost for this Python (`ephost build` calls build_everything()).

An installed package carries its CPU kernels (compiled by the package build, docs/install.md); a source
tree without `python build.py` has none, and the built-in plugins are built on first use. This builds
what is missing into the per-user cache (abi.builder.cache_dir()), where the loaders look last.
"""

from __future__ import annotations

from pathlib import Path


def build_cpu_kernels() -> Path:
    """The CPU kernels library the CPU EP opens: the one already there when it loads, else compiled
    into the cache now (and switched on in this process). Raises PluginBuildError."""
    from abi.builder import BuildError
    from host.cpu_ep import native
    from host.cpu_ep.native import build_info
    from host.errors import PluginBuildError

    lib = native.load()
    if lib is None:
        try:
            build_info.compile_library(native.cache_path())
        except BuildError as exc:
            raise PluginBuildError(str(exc)) from exc
        lib = native.load()
        if lib is None:  # compiled, yet not opened: say why rather than report a path that does not work
            raise PluginBuildError(f"the CPU kernels were built into {native.cache_path()} but do not load: "
                                   f"{native.LOAD_ERROR}")
    native.use(lib)
    return native.LOADED_FROM


def build_everything() -> dict[str, Path]:
    """{what: library path} for the CPU kernels and each built-in plugin, building those missing."""
    from host.plugins.builtin import BUILTIN_PLUGINS, find_builtin_plugin

    built = {"CPU kernels": build_cpu_kernels()}
    for provider in BUILTIN_PLUGINS:
        built[provider] = find_builtin_plugin(provider)
    return built


__all__ = ["build_cpu_kernels", "build_everything"]
