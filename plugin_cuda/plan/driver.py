"""The CUDA driver API calls of the plan, through cffi in ABI mode on libcuda.so.1.

Launching a prepared kernel with prepacked arguments through `cuLaunchKernel` costs the same
from cffi as from any binding; CuPy's per-call path (argument inspection, packing, stream lookup)
is what the plan avoids. Graph capture of the plan's own launches also goes through the driver, so
the plan needs no CuPy stream object. One error funnel: `check()`.
"""

from __future__ import annotations

import threading

import cffi

from plugin_cuda.plan.errors import DriverError

_CDEF = """
typedef int CUresult;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUgraph;
typedef void* CUgraphExec;
CUresult cuGetErrorName(CUresult error, const char** pStr);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void** kernelParams, void** extra);
CUresult cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t ByteCount, CUstream hStream);
CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph* phGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec* phGraphExec, CUgraph hGraph, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
"""

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CAPTURE_MODE_THREAD_LOCAL = 1

ffi = cffi.FFI()
ffi.cdef(_CDEF)
NULL = ffi.NULL

_lib = None
_lock = threading.Lock()


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
    return ffi.cast("CUfunction", ptr)


class Graph:
    """A captured and instantiated CUDA graph, destroyed by close() (idempotent) or when collected."""

    def __init__(self, graph, exec_):
        self._graph = graph
        self._exec = exec_

    @classmethod
    def capture(cls, stream_handle, record) -> Graph:
        """Capture what `record()` enqueues on `stream_handle` (thread-local mode); capture always ends."""
        cu = lib()
        check(cu.cuStreamBeginCapture_v2(stream_handle, CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        box = ffi.new("CUgraph*")
        try:
            record()
        finally:
            ended = cu.cuStreamEndCapture(stream_handle, box)
        check(ended, "cuStreamEndCapture")
        graph = box[0]
        exec_box = ffi.new("CUgraphExec*")
        code = cu.cuGraphInstantiateWithFlags(exec_box, graph, 0)
        if code != CUDA_SUCCESS:
            cu.cuGraphDestroy(graph)
            check(code, "cuGraphInstantiateWithFlags")
        return cls(graph, exec_box[0])

    @property
    def exec_handle(self):
        return self._exec

    def close(self) -> None:
        graph, exec_, self._graph, self._exec = self._graph, self._exec, None, None
        if _lib is None:
            return
        try:
            if exec_ is not None:
                _lib.cuGraphExecDestroy(exec_)
            if graph is not None:
                _lib.cuGraphDestroy(graph)
        except Exception:  # noqa: BLE001 - teardown at interpreter exit must not raise
            pass

    def __del__(self):
        self.close()
