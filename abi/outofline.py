"""The ABI's cffi declarations as an out-of-line module (cffi's ABI mode with `set_source(name, None)`).

An in-line FFI parses each C type string the first time it meets it (`ffi.new("EpCallFrame*")`) with
pycparser, the header's typedefs in front: 1.5-3.6 ms a string, and a CUDA session's creation met 73 of
them on the H200 (0.27 s; the plugin load more). An out-of-line module holds the declarations already
parsed, and its FFI parses type strings in C. A module's name carries a hash of its declarations; it
comes from, in this order:
  1. the installed package: the package build writes every ABI version's module into abi/_cffi
     (setup.py, `write_package_modules`), so an installed ephost writes nothing at run time;
  2. the cache, $EPHOST_CACHE_DIR/cffi: written by the first process that needs it (a source tree), and
     imported by every later one.
Where neither can be read (a module cffi no longer accepts, an unwritable cache), the caller's in-line FFI
serves instead."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import cffi

PACKAGE_DIR = Path(__file__).resolve().parent / "_cffi"


def module_name(name: str, cdef: str) -> str:
    return f"{name}_{hashlib.sha256(cdef.encode()).hexdigest()[:16]}"


def module_path(name: str, cdef: str) -> Path:
    """Where the cache keeps the module for `cdef`: $EPHOST_CACHE_DIR/cffi/<name>_<hash>.py."""
    from abi.builder import cache_dir

    return cache_dir() / "cffi" / f"{module_name(name, cdef)}.py"


def load(name: str, cdef: str):
    """The out-of-line FFI of `cdef` (the package's, else the cache's, written first when missing), or None."""
    packaged = PACKAGE_DIR / f"{module_name(name, cdef)}.py"
    if packaged.is_file():
        ffi = _import(packaged)
        if ffi is not None:
            return ffi
    path = module_path(name, cdef)
    if not path.is_file() and not write(path, cdef):
        return None
    ffi = _import(path)
    if ffi is None:  # damaged, or from a cffi that no longer reads it: written again by the next process
        path.unlink(missing_ok=True)
    return ffi


def _import(path: Path):
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.ffi
    except Exception:  # noqa: BLE001 - see load: the in-line FFI serves
        return None


def write(path: Path, cdef: str) -> bool:
    """Write the module for `cdef` to `path` (atomically); False where that fails."""
    try:
        from cffi.recompiler import make_py_source  # emit_python_code's own writer, without its "generating" line

        builder = cffi.FFI()
        builder.cdef(cdef)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        make_py_source(builder, path.stem, str(tmp))
        os.replace(tmp, path)  # readers see the whole module or none
        return True
    except Exception:  # noqa: BLE001 - an unwritable folder: the in-line FFI serves
        return False


def ffi_of(name: str, cdef: str):
    """An FFI holding `cdef`: the out-of-line module's (`load`), else an in-line FFI.
    `EPHOST_CFFI_MODULES=0`: the in-line one always."""
    if os.environ.get("EPHOST_CFFI_MODULES", "1") != "0":
        ffi = load(name, cdef)
        if ffi is not None:
            return ffi
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    return ffi


def write_package_modules(dest: Path, extra: dict[str, str] | None = None) -> list[Path]:
    """Every supported ABI version's module into `dest` (the package build's abi/_cffi), and the
    modules of `extra` (name -> declarations: the CUDA plugin's libraries, plugin_cuda/device/cdefs.py)."""
    import abi
    from abi.header import cdef

    modules = {f"_ephost_abi_v{version}": cdef(version) for version in abi.SUPPORTED_VERSIONS}
    modules.update(extra or {})
    paths = []
    for name, text in modules.items():
        path = dest / f"{module_name(name, text)}.py"
        if not write(path, text):
            raise OSError(f"cannot write the cffi module {path}")
        paths.append(path)
    return paths
