"""Build every shared library ephost needs.

    python build.py                       # all plugins, every ABI version of the example plugin
    python build.py --plugin example --abi-version 3 --out-dir /tmp/x

Python plugins are cffi embedding-mode libraries: the .so carries a small C shim whose
exported CreateEpFactories/ReleaseEpFactory run the plugin's Python code in the interpreter
that loads it (or start one when a C program loads it). Each build gets a unique module name,
so several versions of one plugin can live in one process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "build" / "lib"
sys.path.insert(0, str(ROOT))

import abi  # noqa: E402
from abi import sdk  # noqa: E402
from abi.header import cdef  # noqa: E402


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

_EXPORTS = """
EpStatus* CreateEpFactories(const char* registration_name, const EpApiBase* api_base, const EpLogger* logger,
                            EpFactory** factories, size_t max_factories, size_t* num_factories);
EpStatus* ReleaseEpFactory(EpFactory* factory);
"""

_INIT = """
import sys
if {root!r} not in sys.path:
    sys.path.insert(0, {root!r})
import importlib
from {module} import ffi, lib
from abi import sdk
_impl = importlib.import_module({impl!r})
sdk.serve(ffi, lib, {version}, getattr(_impl, {func!r}), {module!r})
"""


def module_name(plugin: str, version: int) -> str:
    return f"_ephost_{plugin}_v{version}"


def library_path(plugin: str, version: int | None = None, out_dir: Path = DEFAULT_OUT) -> Path:
    """Where build.py puts a plugin: lib<plugin>.so, or lib<plugin>_v<N>.so for older ABIs."""
    if plugin in C_PLUGINS:
        return out_dir / f"libephost_{plugin}.so"
    spec = PYTHON_PLUGINS[plugin]
    v = version or max(spec.versions)
    return out_dir / f"libephost_{plugin}_v{v}.so"


def build_python_plugin(plugin: str, version: int, out_dir: Path = DEFAULT_OUT) -> Path:
    import cffi

    spec = PYTHON_PLUGINS[plugin]
    abi.check_known_version(version)
    mod = module_name(plugin, version)
    impl, func = spec.entry.split(":")
    ffi = cffi.FFI()
    ffi.cdef(cdef(version, exports=False) + sdk.extern_python_decls(version))
    ffi.embedding_api(_EXPORTS)
    ffi.set_source(mod, cdef(version, exports=False))
    ffi.embedding_init_code(_INIT.format(root=str(ROOT), module=mod, impl=impl, func=func, version=version))
    target = library_path(plugin, version, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        built = ffi.compile(tmpdir=tmp, target=f"lib{mod}.*", verbose=False)
        _install(Path(built), target)
    return target


def _install(built: Path, target: Path) -> None:
    """Replace `target` atomically: a process that has the old library mapped keeps a valid
    file (writing into the same inode would corrupt its mapped code)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(built, tmp)
    os.replace(tmp, target)


def build_c_plugin(plugin: str, out_dir: Path = DEFAULT_OUT) -> Path:
    src = C_PLUGINS[plugin]
    target = library_path(plugin, out_dir=out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-fPIC", "-shared", "-Wall", "-Werror", "-I", str(ROOT / "abi"), str(src), "-o", str(tmp)]
    subprocess.run(cmd, check=True)
    os.replace(tmp, target)
    return target


def build_all(out_dir: Path = DEFAULT_OUT, plugin: str | None = None, version: int | None = None) -> list[Path]:
    built = []
    for name, spec in PYTHON_PLUGINS.items():
        if plugin not in (None, name):
            continue
        for v in ([version] if version else spec.versions):
            built.append(build_python_plugin(name, v, out_dir))
    for name in C_PLUGINS:
        if plugin in (None, name):
            built.append(build_c_plugin(name, out_dir))
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plugin", choices=sorted([*PYTHON_PLUGINS, *C_PLUGINS]), help="build only this plugin")
    p.add_argument("--abi-version", type=int, choices=list(abi.SUPPORTED_VERSIONS),
                   help="target ABI version of a Python plugin (default: every version it supports)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if sysconfig.get_config_var("Py_ENABLE_SHARED") != 1:
        print("note: this Python has no shared libpython; plugins resolve it from the executable",
              file=sys.stderr)
    for path in build_all(args.out_dir, args.plugin, args.abi_version):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
