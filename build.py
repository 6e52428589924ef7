"""Build every shared library ephost needs.

    python build.py                       # all plugins, every ABI version of the example plugin
    python build.py --plugin example --abi-version 3 --out-dir /tmp/x
    python build.py --plugin cpu_kernels               # only the CPU EP's compiled kernels

Python plugins are cffi embedding-mode libraries: the .so carries a small C shim whose
exported CreateEpFactories/ReleaseEpFactory run the plugin's Python code in the interpreter
that loads it (or start one when a C program loads it). Each build gets a unique module name,
so several versions of one plugin can live in one process.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "build" / "lib"
sys.path.insert(0, str(ROOT))

import abi  # noqa: E402
from abi import builder  # noqa: E402


@dataclass(frozen=True)
class PythonPlugin:
    name: str
    entry: str          # "package.module:function" returning the factory list
    versions: tuple[int, ...]


PYTHON_PLUGINS = {
    "example": PythonPlugin("example", "tests.plugins.example_ep:create_factories",
                            tuple(abi.SUPPORTED_VERSIONS)),
    "cuda": PythonPlugin("cuda", "plugin_cuda.plugin:create_factories", (abi.ABI_VERSION,)),
}
C_PLUGINS = {"example_c": ROOT / "tests" / "plugins" / "c_plugin" / "example_c.c"}

def module_name(plugin: str, version: int) -> str:
    return f"_ephost_{plugin}_v{version}"


def library_path(plugin: str, version: int | None = None, out_dir: Path = DEFAULT_OUT) -> Path:
    """Where build.py puts a plugin: lib<plugin>.so, or lib<plugin>_v<N>.so for older ABIs."""
    if plugin in C_PLUGINS:
        # The current ABI keeps the plain name; an older one (-DEXAMPLE_C_ABI=N) gets _v<N>.
        suffix = "" if version in (None, abi.ABI_VERSION) else f"_v{version}"
        return out_dir / f"libephost_{plugin}{suffix}.so"
    spec = PYTHON_PLUGINS[plugin]
    v = version or max(spec.versions)
    return out_dir / f"libephost_{plugin}_v{v}.so"


def build_python_plugin(plugin: str, version: int, out_dir: Path = DEFAULT_OUT) -> Path:
    spec = PYTHON_PLUGINS[plugin]
    return builder.build_python_plugin(module_name(plugin, version), spec.entry, version,
                                       library_path(plugin, version, out_dir), root=ROOT, name=plugin)


def build_c_plugin(plugin: str, out_dir: Path = DEFAULT_OUT, version: int | None = None) -> Path:
    """A plain-C plugin, for the current ABI or (`version`) an older one."""
    if version is not None:
        abi.check_known_version(version)
    flags = () if version is None else (f"-DEXAMPLE_C_ABI={version}",)
    return _build_c_cached(plugin, C_PLUGINS[plugin], library_path(plugin, version, out_dir), flags)


def _c_build_key(source: Path, flags: tuple[str, ...]) -> str:
    """Hash of what a plain-C plugin's library depends on: its source, the ABI header, the build
    recipe (abi/builder.py holds the compiler flags), the compiler command and the extra flags."""
    h = hashlib.sha256()
    for path in (source, ROOT / "abi" / "ep_abi.h", ROOT / "abi" / "builder.py"):
        h.update(path.read_bytes())
    for part in (*builder.compiler(), "|", *flags):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _build_c_cached(name: str, source: Path, target: Path, flags: tuple[str, ...] = ()) -> Path:
    """builder.build_c_plugin, skipped when `target` was built from the same inputs (its key is in
    `<target>.key`): the test fixtures call this once per test session, right after build.py did."""
    stamp = target.with_name(target.name + ".key")
    key = _c_build_key(source, flags)
    if target.is_file() and stamp.is_file() and stamp.read_text() == key:
        return target
    built = builder.build_c_plugin(name, source, target, flags)
    stamp.write_text(key)
    return built


HOSTILE_SOURCE = ROOT / "tests" / "hostile" / "hostile_plugin.c"


def build_hostile(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """The hostile test plugin (tests/hostile), and its variant whose CreateEpFactories is a data object."""
    return [_build_c_cached("hostile", HOSTILE_SOURCE, out_dir / "libephost_hostile.so"),
            _build_c_cached("hostile_data_entry", HOSTILE_SOURCE, out_dir / "libephost_hostile_data_entry.so",
                            ("-DHOSTILE_DATA_ENTRY",))]


def build_cpu_kernels(out_dir: Path = DEFAULT_OUT) -> Path:
    """The CPU EP's compiled kernels (host/cpu_ep/native), tagged with the hash of the source they
    were built from: the host opens the library only when that hash matches its kernels.c."""
    from abi.builder import BuildError
    from host.cpu_ep import native
    from host.cpu_ep.native import build_info

    library = build_info.compile_library(out_dir / build_info.LIB_NAME, werror=True)
    try:  # the faster-to-call form of the same kernels; without it the library serves alone
        build_info.compile_api_module(library, native.CDEF)
    except (BuildError, ImportError) as exc:
        print(f"note: CPU kernels without their API module (calls through libffi): {exc}")
    return library


def build_cffi_modules() -> list[Path]:
    """The out-of-line cffi modules (the ABI's, the CUDA plugin's libraries') into the source tree's
    abi/_cffi, as the package build writes them into an installed ephost: no process of this checkout
    parses those declarations at run time (abi/outofline.py)."""
    from abi import outofline
    from plugin_cuda.device import cdefs

    return outofline.write_package_modules(outofline.PACKAGE_DIR, cdefs.MODULES)


def build_all(out_dir: Path = DEFAULT_OUT, plugin: str | None = None, version: int | None = None) -> list[Path]:
    built = build_cffi_modules() if plugin is None else []
    for name, spec in PYTHON_PLUGINS.items():
        if plugin not in (None, name):
            continue
        for v in ([version] if version else spec.versions):
            built.append(build_python_plugin(name, v, out_dir))
    for name in C_PLUGINS:
        if plugin in (None, name):
            built.append(build_c_plugin(name, out_dir, version))
    if plugin in (None, "hostile"):
        built += build_hostile(out_dir)
    if plugin in (None, "cpu_kernels"):
        built.append(build_cpu_kernels(out_dir))
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plugin", choices=sorted([*PYTHON_PLUGINS, *C_PLUGINS, "hostile", "cpu_kernels"]), help="build only this plugin")
    p.add_argument("--abi-version", type=int, choices=list(abi.SUPPORTED_VERSIONS),
                   help="target ABI version of a plugin (default: every version a Python plugin supports, the "
                        "current one for a C plugin)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if sysconfig.get_config_var("Py_ENABLE_SHARED") != 1:
        print("note: this Python has no shared libpython; plugins resolve it from the executable",
              file=sys.stderr)
    try:
        built = build_all(args.out_dir, args.plugin, args.abi_version)
    except builder.BuildError as exc:
        print(f"build.py: error: {exc}", file=sys.stderr)
        return 2
    for path in built:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
