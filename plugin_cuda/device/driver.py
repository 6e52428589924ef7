"""The CUDA driver API, through cffi in ABI mode on libcuda.so.1 (the compiled plans' launches).

Launching a prepared kernel with prepacked arguments through `cuLaunchKernel` costs the same
from cffi as from any binding; CuPy's per-call path (argument inspection, packing, stream lookup)
is what the plan avoids. Graph capture of the plan's own launches also goes through the driver
(device/capture.py), so the plan needs no CuPy stream object. One error funnel: `check()`.
"""

from __future__ import annotations

import threading

from abi import outofline
from plugin_cuda.device import cdefs
from plugin_cuda.device.errors import DriverError

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201

ffi = outofline.ffi_of("_ephost_cuda_driver", cdefs.DRIVER)  # parsed once, at build (abi/outofline.py)
NULL = ffi.NULL

_lib = None
_lock = threading.Lock()


def loaded():
    """libcuda when it is loaded already, else None (teardown must not load it)."""
    return _lib


def lib():
    """libcuda, loaded once per process and kept alive; DriverError when there is no driver."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    _lib = ffi.dlopen("libcuda.so.1")
                except OSError as exc:
                    raise DriverError(f"cannot load the CUDA driver libcuda.so.1 ({exc}); a compiled plan "
                                      "needs an NVIDIA driver") from None
    return _lib


def error_name(code: int) -> str:
    """The symbolic name of a CUresult (CUDA_ERROR_<code> when the driver cannot say)."""
    box = ffi.new("const char**")
    try:
        if lib().cuGetErrorName(code, box) == CUDA_SUCCESS and box[0] != NULL:
            return ffi.string(box[0]).decode("ascii", "replace")
    except DriverError:
        pass
    return f"CUDA_ERROR_{code}"


def check(code: int, what: str) -> None:
    """The single error funnel for driver results: DriverError naming the call and the CUresult."""
    if code != CUDA_SUCCESS:
        raise DriverError(f"{what} failed: {error_name(code)} ({code})", code)


def stream(ptr: int):
    """A CUstream handle (cffi cdata) for a raw stream pointer."""
    return ffi.cast("CUstream", ptr)


def function(ptr: int):
    """A CUfunction handle (cffi cdata) for a function address."""
    return ffi.cast("CUfunction", ptr)
