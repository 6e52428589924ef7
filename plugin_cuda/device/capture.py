"""Capture helpers of the device layer: CUDA graph capture modes, the sticky-error reset after a
failed capture, and `Graph`, a driver-level capture of what a callable enqueues (the compiled
plans' auto graph). The EP's host-orchestrated capture (plugin_cuda/graphs.py) uses the first two.
"""

from __future__ import annotations

from plugin_cuda.device import driver

__all__ = ["CAPTURE_MODE_RELAXED", "CAPTURE_MODE_THREAD_LOCAL", "Graph", "clear_sticky_error"]

# cudaStreamCaptureMode / CUstreamCaptureMode (the same values in the runtime and the driver API).
CAPTURE_MODE_THREAD_LOCAL = 1
CAPTURE_MODE_RELAXED = 2


def clear_sticky_error(cupy) -> None:
    """Read (and so reset) the runtime's last error after a failed capture."""
    rt = cupy.cuda.runtime
    fn = getattr(rt, "getLastError", None) or getattr(rt, "peekAtLastError", None)
    if fn is not None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - reading the error resets it
            pass


class Graph:
    """A captured and instantiated CUDA graph, destroyed by close() (idempotent) or when collected."""

    def __init__(self, graph, exec_):
        self._graph = graph
        self._exec = exec_

    @classmethod
    def capture(cls, stream_handle, record) -> Graph:
        """Capture what `record()` enqueues on `stream_handle` (thread-local mode); capture always ends."""
        cu = driver.lib()
        driver.check(cu.cuStreamBeginCapture_v2(stream_handle, CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        box = driver.ffi.new("CUgraph*")
        try:
            record()
        finally:
            ended = cu.cuStreamEndCapture(stream_handle, box)
        driver.check(ended, "cuStreamEndCapture")
        graph = box[0]
        exec_box = driver.ffi.new("CUgraphExec*")
        code = cu.cuGraphInstantiateWithFlags(exec_box, graph, 0)
        if code != driver.CUDA_SUCCESS:
            cu.cuGraphDestroy(graph)
            driver.check(code, "cuGraphInstantiateWithFlags")
        return cls(graph, exec_box[0])

    @property
    def exec_handle(self):
        return self._exec

    def close(self) -> None:
        graph, exec_, self._graph, self._exec = self._graph, self._exec, None, None
        cu = driver.loaded()
        if cu is None:
            return
        try:
            if exec_ is not None:
                cu.cuGraphExecDestroy(exec_)
            if graph is not None:
                cu.cuGraphDestroy(graph)
        except Exception:  # noqa: BLE001 - teardown at interpreter exit must not raise
            pass

    def __del__(self):
        self.close()
