"""NVRTC compilation with its one cache, for every CUDA source of the plugin: the compiled plans'
generated modules and the per-node kernels' raw sources (`KernelLibrary`) alike.

NVRTC compiles through CuPy's RawModule; CuPy keeps the compiled binary on disk under its kernel
cache directory (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache) keyed by a hash of the source and
options, so a second session, even in another process, loads the binary instead of compiling.
In process, one module per (device, source hash) is shared by every user of the same source.
CuPy's ElementwiseKernels (`elementwise_table`) compile through CuPy's own cache, per dtype.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time

import numpy as np

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy (or a broken CUDA install) means zero devices, not a crash
    cupy = None

__all__ = ["OPTIONS", "PROBE", "CompileError", "KernelLibrary", "Module", "clear", "elementwise_table", "load", "source_hash",
           "stats"]

OPTIONS = ("--std=c++17",)
PROBE = 'extern "C" __global__ void ep_probe() {}\n'

_modules: dict = {}
_lock = threading.Lock()
stats = {"hits": 0, "compiles": 0, "compile_seconds": 0.0}


def source_hash(source: str) -> str:
    """The cache key of a source (with the compile options)."""
    return hashlib.sha256(("\0".join(OPTIONS) + "\0" + source).encode()).hexdigest()


class Module:
    """A loaded module: `function(name)` -> the CUfunction address (int), `kernel(name)` -> the
    callable CuPy kernel (for launches through CuPy)."""

    def __init__(self, raw_module, digest: str):
        self.raw = raw_module
        self.digest = digest
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
    """The module for `source` on `device_id` (compiled at most once per process and device).
    `probe`: a function of the source looked up now, so that compiling (or loading from CuPy's
    disk cache) happens here rather than at the first launch."""
    digest = source_hash(source)
    key = (device_id, digest)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            stats["hits"] += 1
            return mod
        t0 = time.perf_counter()
        try:
            with cp.cuda.Device(device_id):
                mod = Module(cp.RawModule(code=source, options=OPTIONS), digest)
                if probe is not None:
                    mod.function(probe)
        except Exception as exc:
            if type(exc).__name__ != "CompileException":  # cupy.cuda.compiler's: NVRTC's log inside
                raise
            raise CompileError(str(exc)) from None
        stats["compiles"] += 1
        stats["compile_seconds"] += time.perf_counter() - t0
        _modules[key] = mod
        return mod


def clear() -> None:
    """Forget the in-process modules (tests use it to see the disk cache at work)."""
    with _lock:
        _modules.clear()


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
