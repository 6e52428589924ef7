"""NVRTC compilation with its one cache, for every CUDA source of the plugin: the compiled plans'
generated modules and the per-node kernels' raw sources (`KernelLibrary`) alike.

`load` compiles a source with NVRTC for the device's own architecture (`sm_XY`: a cubin; `compute_XY`
PTX where this NVRTC does not know the device) and keeps the binary, so a compiled plan can save it
in its context (ABI v7, plugin_cuda/plan/saved.py). Binaries come, in this order, from:
  1. the process: one module per (device, source hash), shared by every user of the same source;
  2. `provide`d binaries (a saved context's modules), keyed by (architecture, source hash);
  3. the disk cache, `$EPHOST_CACHE_DIR/nvrtc/<architecture>/<hash>.bin`, keyed by the source with
     the compile options (`source_hash`), the architecture and NVRTC's version: a second process
     loads the binary instead of compiling;
  4. NVRTC (`stats["compiles"]` counts these and only these).
Where the low-level NVRTC binding is missing or refuses the source, CuPy's RawModule compiles it
(CuPy's own disk cache, CUPY_CACHE_DIR), and the module has no binary to save.
CuPy's ElementwiseKernels (`elementwise_table`) compile through CuPy's own cache, per dtype.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy (or a broken CUDA install) means zero devices, not a crash
    cupy = None

__all__ = ["OPTIONS", "PROBE", "CompileError", "KernelLibrary", "Module", "architecture", "clear", "elementwise_table",
           "load", "provide", "source_hash", "stats"]

OPTIONS = ("--std=c++17",)
PROBE = 'extern "C" __global__ void ep_probe() {}\n'

_modules: dict = {}
_lock = threading.Lock()
_provided: dict = {}  # (architecture, source hash) -> binary: a saved context's modules (provide)
stats = {"hits": 0, "compiles": 0, "compile_seconds": 0.0, "provided": 0, "disk": 0, "fallback": 0}
# The sources compiled last, newest at the end (digest, source): which module a new shape compiled,
# for a benchmark to show (bench/dynamic_gpu.py --dump-compiles); bounded, the sources are tens of kB.
recent = collections.deque(maxlen=8)


def source_hash(source: str) -> str:
    """The cache key of a source (with the compile options)."""
    return hashlib.sha256(("\0".join(OPTIONS) + "\0" + source).encode()).hexdigest()


class Module:
    """A loaded module: `function(name)` -> the CUfunction address (int), `kernel(name)` -> the
    callable CuPy kernel (for launches through CuPy)."""

    def __init__(self, raw_module, digest: str, arch: str = "", binary: bytes | None = None):
        self.raw = raw_module
        self.digest = digest
        self.arch = arch  # "sm_90" (binary is a cubin) or "compute_90" (PTX); "" for CuPy's RawModule
        self.binary = binary  # what a saved context keeps; None when CuPy compiled it (no bytes to keep)
        self._functions: dict = {}
        self._kernels: dict = {}

    def kernel(self, name: str):
        fn = self._kernels.get(name)
        if fn is None:
            fn = self._kernels[name] = self.raw.get_function(name)
        return fn

    def function(self, name: str) -> int:
        ptr = self._functions.get(name)
        if ptr is None:
            fn = self.kernel(name)
            kernel = getattr(fn, "kernel", fn)  # RawKernel wraps a cupy.cuda.Function; both have .ptr
            ptr = self._functions[name] = int(kernel.ptr)
        return ptr


class CompileError(RuntimeError):
    """NVRTC refused a source (the message holds its log)."""


def load(cp, source: str, device_id: int, probe: str | None = None) -> Module:
    """The module for `source` on `device_id` (compiled at most once per process and device; see the
    module doc for where binaries come from). `probe`: a function of the source looked up now, so
    that loading happens here rather than at the first launch."""
    digest = source_hash(source)
    key = (device_id, digest)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            stats["hits"] += 1
            return mod
        with cp.cuda.Device(device_id):
            mod = _module(cp, source, digest, architecture(cp, device_id))
            if probe is not None:
                mod.function(probe)
        _modules[key] = mod
        return mod


def _module(cp, source: str, digest: str, arch: str) -> Module:
    path = _disk_path(arch, digest)
    for where, read in (("provided", lambda: _provided.get((arch, digest))), ("disk", lambda: _read(path))):
        binary = read()
        if binary is None:
            continue
        try:
            raw = _load_binary(cp, binary)
        except Exception:  # noqa: BLE001 - a damaged binary (the driver refuses it): compile instead
            _provided.pop((arch, digest), None)
            continue
        stats[where] += 1
        return Module(raw, digest, arch, binary)
    t0 = time.perf_counter()
    binary = _compile(source, arch)
    if binary is None:  # no low-level binding, or it refused the source: CuPy compiles (or says why not)
        stats["fallback"] += 1
        mod = Module(_raw_module(cp, source), digest)
    else:
        _write(path, binary)
        mod = Module(_load_binary(cp, binary), digest, arch, binary)
    stats["compiles"] += 1
    stats["compile_seconds"] += time.perf_counter() - t0
    recent.append((digest, source))
    return mod


def provide(arch: str, digest: str, binary: bytes) -> None:
    """Make `binary` (NVRTC's output for the source of hash `digest` on `arch`) what `load` uses for
    that source: a saved context's modules load without compiling."""
    with _lock:
        _provided[(arch, digest)] = binary


def architecture(cp, device_id: int) -> str:
    """What `load` compiles for on `device_id`: its own sm_XY where this NVRTC knows it, else PTX for
    the newest architecture it knows (the driver finishes it)."""
    cc = int(cp.cuda.Device(device_id).compute_capability)
    known = _supported_archs()
    if not known or cc in known:
        return f"sm_{cc}"
    older = [a for a in known if a <= cc]
    return f"compute_{max(older) if older else min(known)}"


@functools.cache
def _supported_archs() -> tuple:
    try:
        return tuple(int(a) for a in _binding().getSupportedArchs())
    except Exception:  # noqa: BLE001 - an old binding: assume the device's own architecture is known
        return ()


def _binding():
    from cupy_backends.cuda.libs import nvrtc as binding

    return binding


def _compile(source: str, arch: str) -> bytes | None:
    """NVRTC's binary for `source` (cubin for sm_XY, PTX for compute_XY), or None where the binding is
    missing or NVRTC refuses the source (the caller then asks CuPy, whose error carries the log)."""
    try:
        nv = _binding()
        prog = nv.createProgram(source, "ephost.cu", (), ())
    except Exception:  # noqa: BLE001 - no usable binding: CuPy's RawModule compiles instead
        return None
    try:
        nv.compileProgram(prog, list(OPTIONS) + [f"--gpu-architecture={arch}"])
        return nv.getCUBIN(prog) if arch.startswith("sm_") else nv.getPTX(prog) + b"\0"
    except Exception:  # noqa: BLE001 - a compile error: CuPy compiles it again and reports NVRTC's log
        return None
    finally:
        nv.destroyProgram(prog)


def _load_binary(cp, binary: bytes):
    function = getattr(cp.cuda, "function", None)
    if function is None:  # a CuPy that has not imported the submodule yet
        from cupy.cuda import function
    mod = function.Module()
    mod.load(binary)
    return mod


def _raw_module(cp, source: str):
    try:
        return cp.RawModule(code=source, options=OPTIONS)
    except Exception as exc:
        if type(exc).__name__ != "CompileException":  # cupy.cuda.compiler's: NVRTC's log inside
            raise
        raise CompileError(str(exc)) from None


def _disk_path(arch: str, digest: str) -> Path | None:
    """Where the disk cache keeps a binary: per architecture and NVRTC version; None: no cache."""
    if os.environ.get("EPHOST_NVRTC_CACHE", "1") == "0":
        return None
    from abi.builder import cache_dir

    try:
        version = "-".join(str(v) for v in _binding().getVersion())
    except Exception:  # noqa: BLE001 - no binding: nothing is compiled through it either
        return None
    return cache_dir() / "nvrtc" / f"{arch}-nvrtc{version}" / f"{digest}.bin"


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data or None


def _write(path: Path | None, binary: bytes) -> None:
    """Best effort: an unwritable cache directory only costs the next process a compile."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(binary)
        os.replace(tmp, path)  # readers see the whole binary or none
    except OSError:
        pass


def clear() -> None:
    """Forget the in-process modules (tests use it to see the disk cache at work)."""
    with _lock:
        _modules.clear()
        _provided.clear()


class KernelLibrary:
    """Kernels of one CUDA body, built per element type by `make_source(body, dtype)`, compiled once
    per (device, dtype) through `load` and looked up by name."""

    def __init__(self, body: str, names: tuple[str, ...], make_source):
        self.body = body
        self.names = names
        self.make_source = make_source
        self._functions: dict = {}

    def function(self, name: str, dtype):
        """The compiled kernel `name` for `dtype` on the current device (compiled on first use)."""
        dtype = np.dtype(dtype)
        device = cupy.cuda.runtime.getDevice()
        key = (name, dtype, device)
        fn = self._functions.get(key)
        if fn is None:
            fn = load(cupy, self.make_source(self.body, dtype), device).kernel(name)
            self._functions[key] = fn
        return fn


def elementwise_table(sources: dict, preamble: str = ""):
    """A getter building each ElementwiseKernel of `sources` (name -> (in, out, body)) once.

    CuPy then compiles it lazily, once per device and dtype combination.
    """

    @functools.cache
    def get(name: str):
        in_params, out_params, body = sources[name]
        return cupy.ElementwiseKernel(in_params, out_params, body, f"ephost_{name}", preamble=preamble)

    return get
