"""The CUDA EP's EpDataTransfer: host<->device and device<->device copies.

A host-to-device copy made while this thread's stream is being captured (the host copies a CPU
shape computation's result for a kernel of the capture run) is recorded into the graph, in stream
order, from pinned memory the graph keeps: made at once on another stream, it would land before
the recorded kernels run, in a block an earlier recorded kernel may still write (the capture's
pool reuses freed blocks), and a replay would not repeat it.
"""

from __future__ import annotations

import ctypes

import abi
from abi import sdk

_MEMCPY_H2D, _MEMCPY_D2H, _MEMCPY_D2D = 1, 2, 3


def _copy_into_capture(cp, src: int, dst: int, n: int, state, keep: list) -> None:
    pinned = cp.cuda.alloc_pinned_memory(n)
    ctypes.memmove(pinned.ptr, src, n)
    keep.append(pinned)  # the graph's replays copy from here again
    cp.cuda.runtime.memcpyAsync(dst, pinned.ptr, n, _MEMCPY_H2D, state.stream.ptr)
    if state.ep is not None:
        state.ep.stats["copies_captured"] += 1


class CudaDataTransfer(sdk.Impl):
    """Host<->device and device<->device copies, on the compute stream or the default stream."""

    table = "EpDataTransfer"

    def __init__(self, runtime, factory):
        super().__init__(runtime, factory)
        self.factory = factory

    def CanCopy(self, src, dst):
        kinds = {src.device_type, dst.device_type}
        return int(kinds <= {abi.DEVICE_CPU, abi.DEVICE_GPU} and abi.DEVICE_GPU in kinds)

    def CopyTensors(self, src, dst, streams, count):
        for i in range(count):
            owner = self.runtime.obj(streams[i]) if streams != self.ffi.NULL and streams[i] != self.ffi.NULL else None
            self._copy(src[i], dst[i], getattr(owner, "state", None))  # a CudaSyncStream's stream state

    def _copy(self, s, d, state) -> None:
        cp = self.factory.cupy
        rt = cp.cuda.runtime
        n = int(s.nbytes)
        if n == 0:
            return
        sp, dp = int(self.ffi.cast("uintptr_t", s.data)), int(self.ffi.cast("uintptr_t", d.data))
        kind = (_MEMCPY_H2D if s.device_type == abi.DEVICE_CPU else
                _MEMCPY_D2H if d.device_type == abi.DEVICE_CPU else _MEMCPY_D2D)
        ep = state.ep if state is not None else None
        if kind == _MEMCPY_H2D and ep is not None:
            keep = ep.graphs.capture_keep()
            if keep is not None:
                _copy_into_capture(cp, sp, dp, n, state, keep)
                return
        default = ep is None or ep.opts.do_copy_in_default_stream
        copy_stream = cp.cuda.Stream.null if default else state.stream
        if ep is not None:
            ep.stats["copies_default_stream" if default else "copies_compute_stream"] += 1
        if default and state is not None and kind != _MEMCPY_H2D:
            # The default stream must first see the compute stream's work on the source.
            cp.cuda.Stream.null.wait_event(state.stream.record())
        rt.memcpyAsync(dp, sp, n, kind, copy_stream.ptr)
        if kind == _MEMCPY_D2H:
            copy_stream.synchronize()  # host memory must be readable when CopyTensors returns
        elif default and state is not None:
            state.stream.wait_event(copy_stream.record())

    def Release(self):
        self.runtime.forget(self._c_table, "EpDataTransfer")
