"""Build plugin shared libraries: cffi embedding shims for Python plugins, and plain-C plugins.

This module is installed with the package, so a `pip install .` (not only an editable install) can
build the built-in plugins for the running interpreter. `build.py` in a checkout uses it too.

A Python plugin's .so carries a small C shim whose exported CreateEpFactories/ReleaseEpFactory run
the plugin's Python code in the interpreter that loads it (or start one when a C program loads it).
Each build gets its own module name, so several builds of one plugin can live in one process.

The package build (setup.py) compiles the built-in plugins into their package as setuptools extensions
(`packaged_extension`), so an installed ephost carries them. Where it does not (a source tree, an
install made without a compiler), built-in plugins go to a per-user cache keyed by everything the
compiled shim depends on (the ABI declarations, the SDK's extern declarations, the init code with the
package root, the interpreter), so a moved checkout, another Python or a changed header each get a fresh
build and never a stale one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import abi
from abi.header import cdef

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the directory holding abi/, host/, plugin_cuda/


class BuildError(RuntimeError):
    """A plugin could not be built; the message says what is missing and how to get it."""


_EXPORTS = """
EpStatus* CreateEpFactories(const char* registration_name, const EpApiBase* api_base, const EpLogger* logger,
                            EpFactory** factories, size_t max_factories, size_t* num_factories);
EpStatus* ReleaseEpFactory(EpFactory* factory);
"""

# A build from a source tree puts that tree on sys.path (a C program embedding Python may not have it);
# the package build's shim leaves sys.path alone: the package is installed where the interpreter looks.
_PATH_INIT = """
import sys
if {root!r} not in sys.path:
    sys.path.insert(0, {root!r})
"""
_INIT = """
import importlib
from {module} import ffi, lib
from abi import sdk
_impl = importlib.import_module({impl!r})
sdk.serve(ffi, lib, {version}, getattr(_impl, {func!r}), {module!r})
"""

_INSTALL_HINT = ("install one (Debian/Ubuntu: `apt-get install gcc`, Fedora: `dnf install gcc`, "
                 "macOS: `xcode-select --install`) or point CC at one")


def compiler() -> list[str]:
    """The C compiler command cffi will use: $CC, else the one Python was built with, else `cc`."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def check_toolchain(plugin: str, python_plugin: bool = True) -> None:
    """Raise BuildError naming what is missing (compiler, Python headers, setuptools) and how to get it."""
    cc = compiler()
    if not cc or shutil.which(cc[0]) is None:
        found = [name for name in ("gcc", "clang", "cc") if shutil.which(name)]
        hint = f"; found {found[0]!r}: set CC={found[0]}" if found else ""
        raise BuildError(f"building plugin {plugin!r} needs a C compiler; {cc[0] if cc else 'CC'!r} was not "
                         f"found on PATH{hint}; {_INSTALL_HINT}")
    if not python_plugin:
        return
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise BuildError(f"building plugin {plugin!r} needs the Python {sys.version_info.major}."
                         f"{sys.version_info.minor} headers; {include / 'Python.h'} is missing; install them "
                         f"(Debian/Ubuntu: `apt-get install python3-dev`)")
    if sys.version_info >= (3, 12) and importlib.util.find_spec("setuptools") is None:
        raise BuildError(f"building plugin {plugin!r} needs setuptools on Python 3.12+ (cffi compiles through "
                         f"it); `pip install setuptools`")


def embedding_sources(module: str, entry: str, version: int, root: Path | None = PACKAGE_ROOT) -> dict[str, str]:
    """The texts a Python plugin's shim is compiled from (also what its cache key hashes). `root`
    None: the package build's shim, which adds nothing to sys.path."""
    # plugin_runtime, not sdk (which re-exports it): the package build's environment has cffi, not NumPy.
    from abi.plugin_runtime import extern_python_decls

    abi.check_known_version(version)
    impl, func = entry.split(":")
    path_init = "" if root is None else _PATH_INIT.format(root=str(root))
    return {
        "cdef": cdef(version, exports=False) + extern_python_decls(version),
        "source": cdef(version, exports=False),
        "exports": _EXPORTS,
        "init": path_init + _INIT.format(module=module, impl=impl, func=func, version=version),
    }


def _embedding_ffi(module: str, entry: str, version: int, root: Path | None = PACKAGE_ROOT):
    import cffi

    src = embedding_sources(module, entry, version, root)
    ffi = cffi.FFI()
    ffi.cdef(src["cdef"])
    ffi.embedding_api(src["exports"])
    ffi.set_source(module, src["source"])
    ffi.embedding_init_code(src["init"])
    return ffi


def build_python_plugin(module: str, entry: str, version: int, target: Path, root: Path = PACKAGE_ROOT,
                        name: str | None = None) -> Path:
    """Compile the embedding shim for `entry` ("package.module:function") at ABI `version` into `target`.

    `name` is the plugin's name in error messages (default: the module name)."""
    name = name or module
    check_toolchain(name)
    ffi = _embedding_ffi(module, entry, version, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            built = ffi.compile(tmpdir=tmp, target=f"lib{module}.*", verbose=False)
        except Exception as exc:  # cffi/setuptools raise several unrelated types (CompileError, LinkError, ...)
            raise BuildError(f"building plugin {name!r} failed: {type(exc).__name__}: {exc}") from exc
        install(Path(built), target)
    return target


def build_c_plugin(name: str, source: Path, target: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile a plain-C plugin against abi/ep_abi.h into `target`."""
    check_toolchain(name, python_plugin=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [*compiler(), "-O2", "-fPIC", "-shared", "-Wall", "-Werror", "-I", str(PACKAGE_ROOT / "abi"),
           *extra_flags, str(source), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"building plugin {name!r} from {source} failed (exit {done.returncode}): "
                         f"{done.stderr.strip()}")
    os.replace(tmp, target)
    return target


def install(built: Path, target: Path) -> None:
    """Replace `target` atomically: a process that has the old library mapped keeps a valid
    file (writing into the same inode would corrupt its mapped code)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(built, tmp)
    os.replace(tmp, target)


def cache_dir() -> Path:
    """Per-user cache: $EPHOST_CACHE_DIR, else $XDG_CACHE_HOME/ephost, else ~/.cache/ephost."""
    if os.environ.get("EPHOST_CACHE_DIR"):
        return Path(os.environ["EPHOST_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ephost"


def cache_key(module: str, entry: str, version: int, root: Path = PACKAGE_ROOT) -> str:
    """Hash of everything the compiled shim depends on, with the interpreter it links against."""
    h = hashlib.sha256()
    for text in embedding_sources(module, entry, version, root).values():
        h.update(text.encode())
    for part in (sys.version, sys.executable, sysconfig.get_platform(), sysconfig.get_config_var("SOABI") or ""):
        h.update(part.encode())
    return h.hexdigest()[:16]


def cached_plugin_path(plugin: str, entry: str, version: int | None = None) -> tuple[Path, str]:
    """Where the cache keeps the built-in Python plugin `plugin` for this interpreter, and the module
    name it is built under (nothing is built)."""
    version = version or abi.ABI_VERSION
    base = f"_ephost_{plugin}_v{version}"
    key = cache_key(base, entry, version)
    module = f"{base}_{key[:8]}"  # unique per build, so a checkout build of the same plugin can coexist
    tag = f"{sys.implementation.cache_tag}-{key}"
    return cache_dir() / "plugins" / tag / f"lib{module}.so", module


def cached_plugin(plugin: str, entry: str, version: int | None = None) -> Path:
    """The built-in Python plugin `plugin` for this interpreter, built into the cache if not there yet."""
    version = version or abi.ABI_VERSION
    target, module = cached_plugin_path(plugin, entry, version)
    if not target.is_file():
        build_python_plugin(module, entry, version, target, name=plugin)
    return target


# ---- the package build: built-in plugins compiled by `pip install .` / `pip wheel .` ----------------------


def packaged_module(plugin: str, entry: str, version: int | None = None) -> str:
    """The module name the package build compiles built-in `plugin` under: `_ephost_<plugin>_v<N>_pkg<hash>`,
    the hash of the shim's sources (the extension suffix names the interpreter). A build from other
    sources, such as an editable install's in-place build left over from an older header, has another
    name, so it is never opened."""
    version = version or abi.ABI_VERSION
    base = f"_ephost_{plugin}_v{version}"
    h = hashlib.sha256()
    for text in embedding_sources(base, entry, version, root=None).values():
        h.update(text.encode())
    return f"{base}_pkg{h.hexdigest()[:8]}"


def packaged_extension(plugin: str, entry: str, package: str, tmpdir: str = "build/ephost_plugins",
                       version: int | None = None):
    """The setuptools Extension compiling built-in `plugin`'s shim into `package` (setup.py calls it;
    cffi writes the C source into `tmpdir` and adds libpython to the link, as for build_python_plugin).
    Optional, as the CPU kernels: without a compiler a source install still succeeds and the plugin is
    built on first use."""
    version = version or abi.ABI_VERSION
    module = packaged_module(plugin, entry, version)
    ext = _embedding_ffi(module, entry, version, root=None).distutils_extension(tmpdir, verbose=False)
    ext.name = f"{package}.{module}"  # the file lands in the package; the cffi module keeps its plain name
    ext.optional = True
    return ext


def packaged_plugin_path(plugin: str, entry: str, package_dir: Path, version: int | None = None) -> Path:
    """Where the package build put built-in `plugin` for this interpreter (nothing is built or checked)."""
    return package_dir / (packaged_module(plugin, entry, version) + sysconfig.get_config_var("EXT_SUFFIX"))
