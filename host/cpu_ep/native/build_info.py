"""How the CPU EP's kernels (kernels.c) are compiled: the one place that says so.

Three builders use it: the package build (setup.py: a setuptools extension module inside this
package, so `pip install .` and a wheel carry the library), `python build.py` in a checkout, and
`ephost build` (into the per-user cache). Standard library only, with the imports that need more
inside the functions: setup.py loads this file by path in a build environment that has setuptools
and nothing else of ephost's dependencies.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
# Files kernels.c #includes (beside it): part of the source the hash covers.
INCLUDES = ("kernels_rows.c", "kernels_gemm.c", "kernels_pool.c", "kernels_attention.c", "kernels_quant.c", "kernels_quant_chain.c",
            "kernels_trees.c", "kernels_ml.c")
LIB_NAME = "libephost_cpu_kernels.so"
# The package build's extension module; it has no PyInit (it is a plain C library opened with
# ffi.dlopen), the module form is only how setuptools compiles it and tags the wheel.
MODULE = "host.cpu_ep.native._kernels"
# -O3, no -ffast-math (NaN/Inf as NumPy has them); the hot loops carry their own AVX2/AVX-512 clones.
CFLAGS = ("-O3", "-Wall")
LIBRARIES = ("m", "pthread", "dl")
# The same kernels as a cffi API-mode extension module (compile_api_module), looked for beside the library:
# its calls convert their arguments in compiled code, 0.3-0.7 us less per call than the library's libffi
# calls in ABI mode (13 arguments to ep_gemm: 0.5 against 0.19 us), which is most of a small node's cost.
API_MODULE = "_ephost_kernels_api"


def hash_of(source: Path) -> str:
    """The hash compiled into the library: the loader opens a build only when it matches kernels.c and
    the files it includes (INCLUDES, beside it)."""
    digest = hashlib.sha256(source.read_bytes())
    for name in INCLUDES:
        digest.update(source.with_name(name).read_bytes())
    return digest.hexdigest()[:16]


def source_hash() -> str:
    return hash_of(SOURCE)


def hash_macro() -> tuple[str, str]:
    return "EPHOST_CPU_SOURCE_HASH", f'"{source_hash()}"'


def extension(root: Path):
    """The setuptools Extension that compiles kernels.c into the package (setup.py calls it)."""
    from setuptools import Extension

    # optional: a source install on a machine without a compiler still installs (the kernels then keep their
    # NumPy paths, and native.LOAD_ERROR says how to build the library); -g0: Python's CFLAGS add -g.
    depends = [SOURCE.with_name(name).relative_to(root).as_posix() for name in INCLUDES]
    return Extension(MODULE, sources=[SOURCE.relative_to(root).as_posix()], depends=depends, define_macros=[hash_macro()],
                     extra_compile_args=[*CFLAGS, "-g0"], libraries=list(LIBRARIES), optional=True)


def compile_library(target: Path, werror: bool = False) -> Path:
    """Compile kernels.c into the shared library `target` with the C compiler abi.builder finds
    (raising builder.BuildError when there is none or it fails); replaced atomically."""
    from abi import builder

    builder.check_toolchain("cpu_kernels", python_plugin=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    name, value = hash_macro()
    cmd = [*builder.compiler(), *CFLAGS, *(["-Werror"] if werror else []), "-fPIC", "-shared",
           f"-D{name}={value}", str(SOURCE), "-o", str(tmp), *(f"-l{lib}" for lib in LIBRARIES)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise builder.BuildError(f"building the CPU kernels from {SOURCE} failed "
                                 f"(exit {done.returncode}): {done.stderr.strip()}")
    os.replace(tmp, target)
    return target


def cdef_hash(cdef: str) -> str:
    """The hash of the declarations an API module was built with: the loader opens a module only when its
    declarations are the loader's too (its wrappers convert arguments as they declare them)."""
    return hashlib.sha256(cdef.encode()).hexdigest()[:16]


def api_module_path(library: Path) -> Path:
    """Where compile_api_module puts the module for this interpreter: beside `library`."""
    import sysconfig

    return library.with_name(API_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def compile_api_module(library: Path, cdef: str, werror: bool = False) -> Path:
    """Compile kernels.c with cffi's API-mode wrappers for `cdef` into an extension module beside `library`
    (api_module_path), carrying the same source hash. Needs cffi and Python's headers; raises
    builder.BuildError when the compiler fails (the library alone still serves, through ABI mode)."""
    import sysconfig

    import cffi

    from abi import builder

    target = api_module_path(library)
    ffi = cffi.FFI()
    ffi.cdef(cdef + "\nconst char *ep_api_cdef_hash(void);")
    ffi.set_source(API_MODULE, f'#include "{SOURCE.name}"\n'
                               f'static const char *ep_api_cdef_hash(void) {{ return "{cdef_hash(cdef)}"; }}\n')
    c_file = target.with_name(f".{API_MODULE}.{os.getpid()}.c")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):  # cffi says 'generating <file>'
        ffi.emit_c_code(str(c_file))
    name, value = hash_macro()
    cmd = [*builder.compiler(), *CFLAGS, *(["-Werror"] if werror else []), "-fPIC", "-shared", f"-D{name}={value}",
           f"-I{SOURCE.parent}", f"-I{sysconfig.get_paths()['include']}", str(c_file), "-o", str(tmp),
           *(f"-l{lib}" for lib in LIBRARIES)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        c_file.unlink(missing_ok=True)
    if done.returncode != 0:
        raise builder.BuildError(f"building the CPU kernels' API module from {SOURCE} failed "
                                 f"(exit {done.returncode}): {done.stderr.strip()}")
    os.replace(tmp, target)
    return target
