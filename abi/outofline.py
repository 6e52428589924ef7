"""The ABI's cffi declarations as an out-of-line module (cffi's ABI mode with `set_source(name, None)`).

An in-line FFI parses each C type string the first time it meets it (`ffi.new("EpCallFrame*")`) with
pycparser, the header's typedefs in front: 1.5-3.6 ms a string, and a CUDA session's creation met 73 of
them on the H200 (0.27 s; the plugin load more). An out-of-line module holds the declarations already
parsed, and its FFI parses type strings in C. The module is written once per declarations (its name
carries a hash of them and of cffi's version) into $EPHOST_CACHE_DIR/cffi, and every later process
imports it; where it cannot be written or read, the caller's in-line FFI serves instead."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import cffi


def module_path(name: str, cdef: str) -> Path:
    """Where the module for `cdef` lives: $EPHOST_CACHE_DIR/cffi/<name>_<hash>.py."""
    from abi.builder import cache_dir

    digest = hashlib.sha256(f"{cffi.__version__}\0{cdef}".encode()).hexdigest()[:16]
    return cache_dir() / "cffi" / f"{name}_{digest}.py"


def load(name: str, cdef: str):
    """The out-of-line FFI of `cdef` (written first when missing), or None where that fails."""
    path = module_path(name, cdef)
    if not path.is_file() and not _write(path, cdef):
        return None
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.ffi
    except Exception:  # noqa: BLE001 - a damaged file: the in-line FFI serves, and the file is written again
        path.unlink(missing_ok=True)
        return None


def _write(path: Path, cdef: str) -> bool:
    try:
        from cffi.recompiler import make_py_source  # emit_python_code's own writer, without its "generating" line

        builder = cffi.FFI()
        builder.cdef(cdef)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        make_py_source(builder, path.stem, str(tmp))
        os.replace(tmp, path)  # readers see the whole module or none
        return True
    except Exception:  # noqa: BLE001 - an unwritable cache: the in-line FFI serves
        return False
