"""cuDNN 9 owned by the CUDA plugin, called through cffi in ABI mode (the legacy convolution API).

Why this route (docs/cuda_ops.md, "Convolutions through cuDNN"): the plugin already binds cuBLAS
this way (device/cublas.py); cuDNN 9 keeps the legacy convolution entry points
(cudnnConvolutionForward, cudnnConvolutionBiasActivationForward, cudnnConvolutionBackwardData) in
its shim library libcudnn.so.9, whose calls take raw device pointers and the handle's stream, so
they are capturable in CUDA graphs. NVIDIA's `nvidia-cudnn-frontend` package would have to travel
as a wheel and builds graphs per shape through the backend API: more moving parts for the same
kernels.

This module: loading the library (the `nvidia-cudnn-cu13` / `-cu12` wheel first, then the system's
libcudnn), the error funnel, one handle per stream (HandlePool, like the EP's cuBLAS handles), and
the descriptor objects. The convolutions themselves are in device/cudnn_conv.py.
"""

from __future__ import annotations

import ctypes.util
import os
import threading
import warnings
import weakref

import numpy as np

from abi import outofline
from plugin_cuda.device import cdefs

__all__ = [
    "CudnnError",
    "CudnnHandle",
    "HandlePool",
    "availability",
    "check",
    "data_type",
    "ffi",
    "load_library",
    "version",
]

# Enum values from cudnn_graph_v9.h / cudnn_ops_v9.h / cudnn_cnn_v9.h (cuDNN 9.x).
CUDNN_STATUS_SUCCESS = 0
CUDNN_DATA_FLOAT = 0
CUDNN_DATA_HALF = 2
CUDNN_DATA_BFLOAT16 = 9
CUDNN_DEFAULT_MATH = 0
CUDNN_TENSOR_OP_MATH = 1
CUDNN_FMA_MATH = 3
CUDNN_TENSOR_NCHW = 0
CUDNN_CROSS_CORRELATION = 1
CUDNN_NOT_PROPAGATE_NAN = 0
CUDNN_ACTIVATION_RELU = 1
CUDNN_ACTIVATION_IDENTITY = 5
CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM = 1
CUDNN_CONVOLUTION_BWD_DATA_ALGO_1 = 1

_DATA_TYPES = {"float32": CUDNN_DATA_FLOAT, "float16": CUDNN_DATA_HALF, "bfloat16": CUDNN_DATA_BFLOAT16}

_STATUS_HINTS = {
    1: "cuDNN was not initialised (the handle was not created or the device is gone)",
    2: "an argument is out of range (shapes, strides, enum values, descriptor combination)",
    3: "this combination of layout, types, algorithm or geometry is not supported",
    4: "an internal cuDNN operation failed, often a CUDA error on the stream",
    5: "the kernel failed to launch: check the stream, the device and any capture in progress",
}


ffi = outofline.ffi_of("_ephost_cudnn", cdefs.CUDNN)  # parsed once, at build (abi/outofline.py)
NULL = ffi.NULL

# Host scalars for alpha/beta: cuDNN reads them when the call is made (a captured graph holds their
# values). For float32, float16 and bfloat16 data cuDNN takes float scalars.
ONE = ffi.new("float *", 1.0)
ZERO = ffi.new("float *", 0.0)


class CudnnError(RuntimeError):
    """A cuDNN call failed, or cuDNN could not be loaded."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def status_name(status: int) -> str:
    """cuDNN's own text for a status (cudnnGetErrorString), or its number."""
    if _lib is not None:
        try:
            raw = _lib.cudnnGetErrorString(status)
            if raw != NULL:
                return ffi.string(raw).decode("ascii", "replace")
        except AttributeError:
            pass
    return f"CUDNN_STATUS_{status}"


def check(status: int, what: str) -> None:
    """The single error funnel: raise CudnnError naming the status and what was being done."""
    if status == CUDNN_STATUS_SUCCESS:
        return
    message = f"{what} failed: {status_name(status)} ({status})"
    hint = _STATUS_HINTS.get(status // 1000)
    if hint:
        message += f"; {hint}"
    raise CudnnError(message, status)


def data_type(dtype) -> int:
    """The cudnnDataType_t of a NumPy dtype; CudnnError for another dtype."""
    name = np.dtype(dtype).name
    code = _DATA_TYPES.get(name)
    if code is None:
        raise CudnnError(f"cuDNN convolution got dtype {name}; allowed: {', '.join(_DATA_TYPES)}")
    return code


# ---------------------------------------------------------------------------------------------
# Library loading: the wheel's copy, then the system's, then a typed error (once, cached).

_lib = None
_load_error: str | None = None
_lib_path: str | None = None
_lib_lock = threading.Lock()
_warned = False
_SONAMES = ("libcudnn.so.9",)


def wheel_candidates() -> list:
    """libcudnn.so.9 inside the installed nvidia-cudnn-cu13 / -cu12 wheels (namespace `nvidia.cudnn`)."""
    try:
        import nvidia.cudnn as pkg
    except ImportError:
        return []
    dirs = list(getattr(pkg, "__path__", []))
    if getattr(pkg, "__file__", None):
        dirs.append(os.path.dirname(pkg.__file__))
    found = []
    for d in dirs:
        path = os.path.join(d, "lib", "libcudnn.so.9")
        if os.path.exists(path) and path not in found:
            found.append(path)
    return found


def candidates(tried: list) -> list:
    """Where to look, in order: the wheel, ctypes.util.find_library, the plain soname."""
    found = wheel_candidates()
    if not found:
        tried.append("nvidia.cudnn (nvidia-cudnn-cu13 wheel): not installed")
    system = ctypes.util.find_library("cudnn")
    if system:
        found.append(system)
    else:
        tried.append("ctypes.util.find_library('cudnn'): not found")
    return found + list(_SONAMES)


# The shim loads these on its first call and ABORTS the process when one is missing, so they are
# checked before any call: beside a shim given by path, or through the loader's search path.
_SUBLIBRARIES = ("libcudnn_graph.so.9", "libcudnn_ops.so.9", "libcudnn_cnn.so.9")


def missing_sublibrary(path: str) -> str | None:
    """The first sub-library the shim at `path` would not find, or None."""
    folder = os.path.dirname(path)
    for name in _SUBLIBRARIES:
        if folder and os.path.exists(os.path.join(folder, name)):
            continue
        try:
            ctypes.CDLL(name)
        except OSError:
            return name
    return None


def _open(paths, tried: list):
    for path in paths:
        missing = missing_sublibrary(path)
        if missing is not None:
            tried.append(f"{path}: {missing} not found beside it nor on the loader's path")
            continue
        try:
            lib = ffi.dlopen(path)
            lib.cudnnCreate  # noqa: B018 - a library that is not cuDNN 9 fails here, early
            major = int(lib.cudnnGetVersion()) // 10000
        except (OSError, AttributeError) as e:
            tried.append(f"{path}: {e}")
            continue
        if major != 9:
            tried.append(f"{path}: cuDNN version {int(lib.cudnnGetVersion())}, expected 9.x")
            continue
        return lib, path
    return None


def load_library():
    """Load libcudnn once per process; CudnnError (cached: the search runs once) when it cannot."""
    global _lib, _lib_path, _load_error
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        if _load_error is None:
            tried: list[str] = []
            found = _open(candidates(tried), tried)
            if found is not None:
                _lib, _lib_path = found
                return _lib
            _load_error = ("cannot load cuDNN 9: install the nvidia-cudnn-cu13 wheel (pip install "
                           "nvidia-cudnn-cu13) matching CuPy's CUDA version; tried: " + "; ".join(tried))
        raise CudnnError(_load_error)


def availability() -> str | None:
    """None when cuDNN loads; else why not, warned once per process (the convolutions then run
    on the plugin's own kernels)."""
    global _warned
    try:
        load_library()
        return None
    except CudnnError as e:
        if not _warned:
            _warned = True
            warnings.warn(f"CUDA plugin: convolutions run on the plugin's own kernels: {e}",
                          RuntimeWarning, stacklevel=2)
        return str(e)


_probe: str | None | bool = False  # False: not probed; None: a handle could be made; else why not
_probe_handle = None


def usable() -> bool:
    """Whether cuDNN loads and a handle can be made on the current device (probed once per process):
    compiled plans commit to cuDNN at build time only then."""
    global _probe, _probe_handle
    if availability() is not None:
        return False
    if _probe is False:
        try:
            _probe_handle = CudnnHandle(0, use_tf32=False)
            _probe = None
        except Exception as e:  # noqa: BLE001 - any failure means: not here
            _probe = f"{type(e).__name__}: {e}"
    return _probe is None


def probe_handle():
    """The handle usable() made (host-side queries at plan build: heuristics), or None."""
    return _probe_handle if usable() else None


def reset_for_tests() -> None:
    """Forget the loaded library and the cached failure (tests that simulate a missing cuDNN)."""
    global _lib, _lib_path, _load_error, _warned, _probe
    _lib = _lib_path = _load_error = None
    _warned = False
    _probe = False


def version() -> dict:
    """cuDNN's version, the CUDA runtime it was built against and where it was loaded from."""
    lib = load_library()
    return {"cudnn": int(lib.cudnnGetVersion()), "cudart": int(lib.cudnnGetCudartVersion()), "path": _lib_path}


# ---------------------------------------------------------------------------------------------
# Handles


class _HandleState:
    __slots__ = ("lib", "handle")

    def __init__(self, lib, handle):
        self.lib = lib
        self.handle = handle


def _release(state: _HandleState) -> None:
    handle, state.handle = state.handle, None
    if handle is not None:
        try:
            state.lib.cudnnDestroy(handle)
        except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter exit, dead context)
            pass


class CudnnHandle:
    """A cuDNN handle bound to one stream, with the session's settings for convolutions.

    `use_tf32`: float32 convolutions may use TF32 tensor cores (else CUDNN_FMA_MATH: strict
    float32). `algo_search`: HEURISTIC, EXHAUSTIVE or DEFAULT (options.py). Bind the stream
    before any capture: cudnnSetStream is not a capturable operation. Not thread-safe: one stream,
    one thread at a time, as the EP's cuBLAS handles.
    """

    def __init__(self, stream_ptr: int = 0, use_tf32: bool = True, algo_search: str = "HEURISTIC"):
        lib = load_library()
        box = ffi.new("cudnnHandle_t *")
        check(lib.cudnnCreate(box), "cudnnCreate")
        self.lib = lib
        self._state = _HandleState(lib, box[0])
        self._finalizer = weakref.finalize(self, _release, self._state)
        self._finalizer.atexit = False  # at exit the CUDA context may be gone; the OS reclaims it
        self.use_tf32 = bool(use_tf32)
        self.algo_search = algo_search
        self._stream_ptr: int | None = None
        try:
            self.set_stream(stream_ptr)
        except BaseException:
            self.close()
            raise

    @property
    def raw(self):
        handle = self._state.handle
        if handle is None:
            raise CudnnError("cuDNN handle is closed; create a new CudnnHandle")
        return handle

    @property
    def stream_ptr(self) -> int | None:
        return self._stream_ptr

    @property
    def closed(self) -> bool:
        return self._state.handle is None

    def set_stream(self, stream_ptr: int) -> None:
        ptr = int(stream_ptr)
        if ptr == self._stream_ptr:
            return
        check(self.lib.cudnnSetStream(self.raw, ffi.cast("cudaStream_t", ptr)), "cudnnSetStream")
        self._stream_ptr = ptr

    def close(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"stream=0x{self._stream_ptr or 0:x}"
        return f"<CudnnHandle {state} tf32={self.use_tf32} search={self.algo_search}>"


class HandlePool:
    """The EP's cuDNN handles: one per stream, handed back when the stream is released and reused
    for the next stream (destroying a handle may synchronise the device, which would invalidate a
    capture another thread has under way)."""

    def __init__(self, use_tf32: bool, algo_search: str):
        self.use_tf32 = bool(use_tf32)
        self.algo_search = algo_search
        self._spare: list[CudnnHandle] = []
        self._lock = threading.Lock()
        self._closed = False
        self.failed: str | None = None  # why a handle could not be made (then none is tried again)

    def take(self, stream_ptr: int) -> CudnnHandle | None:
        """A handle bound to `stream_ptr`, or None when cuDNN is not available (warned once)."""
        if availability() is not None:
            return None
        if self.failed is not None:
            return None
        with self._lock:
            handle = self._spare.pop() if self._spare else None
        try:
            if handle is None:
                return CudnnHandle(stream_ptr, self.use_tf32, self.algo_search)
            handle.set_stream(stream_ptr)
            return handle
        except CudnnError as e:  # loaded but unusable here (driver, device): the own kernels run
            self.failed = str(e)
            warnings.warn(f"CUDA plugin: convolutions run on the plugin's own kernels: {e}", RuntimeWarning,
                          stacklevel=2)
            return None

    def give_back(self, handle: CudnnHandle) -> None:
        # CUDA hands a destroyed stream's address to the next stream created: bind it again then.
        handle._stream_ptr = None
        with self._lock:
            if not self._closed:
                self._spare.append(handle)
                return
        handle.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, []
        for handle in spare:
            handle.close()
