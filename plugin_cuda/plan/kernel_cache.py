"""Compiled plan modules, cached by source hash: in process (per device) and on disk.

NVRTC compiles through CuPy's RawModule; CuPy keeps the compiled binary on disk under its kernel
cache directory (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache) keyed by a hash of the source and
options, so a second session, even in another process, loads the binary instead of compiling.
In process, one module per (device, source hash) is shared by every plan with the same source.
"""

from __future__ import annotations

import hashlib
import threading
import time

OPTIONS = ("--std=c++17",)

_modules: dict = {}
_lock = threading.Lock()
stats = {"hits": 0, "compiles": 0, "compile_seconds": 0.0}


def source_hash(source: str) -> str:
    return hashlib.sha256(("\0".join(OPTIONS) + "\0" + source).encode()).hexdigest()


class Module:
    """A loaded module: `function(name)` -> the CUfunction address (int)."""

    def __init__(self, raw_module, digest: str):
        self.raw = raw_module
        self.digest = digest
        self._functions: dict = {}

    def function(self, name: str) -> int:
        ptr = self._functions.get(name)
        if ptr is None:
            fn = self.raw.get_function(name)
            kernel = getattr(fn, "kernel", fn)  # RawKernel wraps a cupy.cuda.Function; both have .ptr
            ptr = self._functions[name] = int(kernel.ptr)
        return ptr


def load(cupy, source: str, device_id: int) -> Module:
    """The compiled module for `source` on `device_id` (compiled at most once per process and device)."""
    digest = source_hash(source)
    key = (device_id, digest)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            stats["hits"] += 1
            return mod
        t0 = time.perf_counter()
        with cupy.cuda.Device(device_id):
            raw = cupy.RawModule(code=source, options=OPTIONS)
            mod = Module(raw, digest)
            mod.function("ep_probe")  # compiles (or loads from CuPy's disk cache) now, not on first run
        stats["compiles"] += 1
        stats["compile_seconds"] += time.perf_counter() - t0
        _modules[key] = mod
        return mod


PROBE = 'extern "C" __global__ void ep_probe() {}\n'


def clear() -> None:
    """Forget the in-process modules (tests use it to see the disk cache at work)."""
    with _lock:
        _modules.clear()
