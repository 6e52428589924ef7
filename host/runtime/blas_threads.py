"""The thread count of NumPy's BLAS (OpenBLAS), which the CPU EP's MatMul/Gemm/Conv kernels use.

`SessionOptions.intra_op_num_threads = N` bounds it to N during each run of that session (and
restores the previous count afterwards). The CPU EP's other kernels are single-threaded NumPy.
OpenBLAS's pool is process-wide: two sessions with different bounds running at the same time
share one setting. Without OpenBLAS (another BLAS, or none found) the bound cannot be applied;
`available()` says so and the session logs it once.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os

# Symbol pairs (get, set) that OpenBLAS builds export: NumPy's scipy-openblas wheels, then plain builds.
_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads"))


def _loaded_libraries() -> list[str]:
    """OpenBLAS libraries mapped into this process (Linux), else those shipped next to NumPy."""
    import numpy  # noqa: F401  - make sure NumPy (and its BLAS) is loaded before looking

    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "openblas" in os.path.basename(path).lower() and path not in found:
                    found.append(path)
    except OSError:
        pass
    if not found:
        import numpy as np

        found = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    return found


def _find():
    for path in _loaded_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _SYMBOLS:
            get, set_ = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and set_ is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                return get, set_
    return None


_API = None
_SEARCHED = False


def _api():
    global _API, _SEARCHED
    if not _SEARCHED:
        _API, _SEARCHED = _find(), True
    return _API


def available() -> bool:
    """Whether this process's BLAS thread count can be read and bounded."""
    return _api() is not None


def get_threads() -> int | None:
    """The BLAS pool's current thread count, or None when no OpenBLAS was found."""
    api = _api()
    return None if api is None else int(api[0]())


@contextlib.contextmanager
def bounded(threads: int):
    """At most `threads` BLAS threads inside the block (no change when already at most that many)."""
    api = _api()
    before = int(api[0]()) if api is not None else None
    if before is None or before <= threads:
        yield
        return
    api[1](threads)
    try:
        yield
    finally:
        api[1](before)


__all__ = ["available", "bounded", "get_threads"]
