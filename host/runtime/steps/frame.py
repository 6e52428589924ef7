"""The run step of a compiled partition (ABI v6): its call frame and the frame's host callbacks.

A `FrameContext` per thread and partition owns one EpCallFrame, refilled per run. Outputs whose
shapes shape inference fixed are preallocated on the EP's device before the call (no callback); the
others come through the frame's AllocateOutput callback. Scratch blocks a Compute did not free are
freed when it returns.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

import abi
from host.errors import InvalidArgument, KernelError
from host.plugins import hostapi
from host.plugins.ep import PluginEp, SyncStream
from host.plugins.handles import HandleTable
from host.plugins.hostapi import ffi
from host.runtime.plan import PlanNode
from host.runtime.tensor import Allocation, check_output_dims

if TYPE_CHECKING:
    from host.runtime.partition.compile import CompiledPartition

_NULL = ffi.NULL
MAX_TENSOR_BYTES = 1 << 62  # beyond any device; keeps shape arithmetic inside int64


# Call frames lent to a compiled partition's Compute, by their context pointer.
FRAMES: HandleTable[FrameContext] = HandleTable(ffi, "void*")


def _status(code: int, message: str):
    return hostapi.STATUSES.create(code, message.encode("utf-8", "replace"))


@ffi.callback("EpStatus*(*)(void*, int32_t, const int64_t*, int32_t, void**)", onerror=hostapi._status_onerror)
def _allocate_output(context, index, dims, rank, data):
    ctx = FRAMES.get(context)
    if ctx is None or not ctx.active or data == _NULL or rank < 0 or (rank > 0 and dims == _NULL):
        return _status(abi.EP_INVALID_ARGUMENT, "AllocateOutput: unknown frame context (a frame used outside "
                                                "Compute), NULL out, or a bad rank/dims")
    if rank > hostapi.MAX_RANK:  # checked before a single dim is read
        return _status(abi.EP_INVALID_ARGUMENT, f"AllocateOutput: rank {int(rank)} is not allowed; expected "
                                                f"0..{hostapi.MAX_RANK}")
    try:
        data[0] = ctx.allocate_output(int(index), tuple(int(dims[d]) for d in range(rank)))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status for the plugin
        return _status(getattr(exc, "abi_code", abi.EP_FAIL), f"AllocateOutput: {exc}")
    return _NULL


@ffi.callback("EpStatus*(*)(void*, size_t, void**)", onerror=hostapi._status_onerror)
def _alloc_scratch(context, nbytes, data):
    ctx = FRAMES.get(context)
    if ctx is None or not ctx.active or data == _NULL:
        return _status(abi.EP_INVALID_ARGUMENT, "AllocScratch: unknown frame context or NULL out")
    try:
        data[0] = ffi.cast("void*", ctx.alloc_scratch(int(nbytes)))
    except Exception as exc:  # noqa: BLE001
        return _status(abi.EP_OUT_OF_MEMORY, f"AllocScratch: {exc}")
    return _NULL


@ffi.callback("void(*)(void*, void*)", onerror=hostapi._log_onerror)
def _free_scratch(context, data):
    ctx = FRAMES.get(context)
    if ctx is not None and ctx.active:
        ctx.free_scratch(int(ffi.cast("uintptr_t", data)))


class _OutputRequest(InvalidArgument):
    abi_code = abi.EP_INVALID_ARGUMENT


class FrameContext:
    """The EpCallFrame of one compiled partition on one thread, with its C arrays."""

    def __init__(self, run, step: CompiledStep, stream: SyncStream | None):
        node = step.node
        part: CompiledPartition = node.kernel
        self.run = run
        self.node = node
        self.part = part
        self.ep: PluginEp = node.ep
        self.stream = stream
        self.compute = step.compute
        self.frame = f = ffi.new("EpCallFrame*")
        f.struct_size, f.version = ffi.sizeof("EpCallFrame"), abi.ABI_VERSION
        f.stream = stream.handle if stream is not None else _NULL
        f.sync_stream = stream.ptr if stream is not None else _NULL
        f.num_inputs, f.num_outputs = len(node.inputs), len(node.outputs)
        self.inputs = ffi.new("EpFrameTensor[]", max(len(node.inputs), 1))
        self.outputs = ffi.new("EpFrameTensor[]", max(len(node.outputs), 1))
        f.inputs, f.outputs = self.inputs, self.outputs
        self.active = False  # True only during Compute: a frame kept past its call is refused
        self.key = FRAMES.add(self)
        f.AllocateOutput, f.allocate_context = _allocate_output, self.key
        f.AllocScratch, f.FreeScratch, f.scratch_context = _alloc_scratch, _free_scratch, self.key
        self.static = part.static_shapes
        self._dims = []  # dims arrays of outputs the host does not preallocate (inferred, -1 unknown)
        for dims in part.inferred_dims:
            self._dims.append((ffi.new("int64_t[]", list(dims) or [0]), len(dims)) if dims is not None
                              else (_NULL, -1))
        # Element types are the plan's, fixed: written once, not per run.
        executor = run.executor
        for j, vid in enumerate(node.outputs):
            self.outputs[j].elem_type = executor.elem_type_of(executor.dtype_of(vid))
        self.scratch: dict[int, object] = {}

    # callbacks
    def allocate_output(self, index: int, dims: tuple) -> object:
        if not 0 <= index < len(self.node.outputs):
            raise _OutputRequest(f"output index {index} out of range 0..{len(self.node.outputs) - 1}")
        t = self.outputs[index]
        vid = self.node.outputs[index]
        name = self.run.plan.value_names[vid]
        itemsize = self.run.executor.dtype_of(vid).itemsize
        if any(d < 0 for d in dims) or math.prod(dims) * itemsize > MAX_TENSOR_BYTES:
            raise _OutputRequest(f"output {index} ('{name}'): dims {list(dims)} must be >= 0 and hold at most "
                                 f"{MAX_TENSOR_BYTES} bytes")
        check_output_dims(dims, self.run.executor.dtype_of(vid), f"output {index} of fused node '{self.part.name}'")
        if t.data != _NULL:
            have = tuple(t.dims[d] for d in range(t.rank))
            if have != dims:
                raise _OutputRequest(f"output {index} ('{name}') is already allocated "
                                     f"with shape {list(have)}; asked for {list(dims)}")
            return t.data
        value = self.run.make_output(vid, dims, self.ep, self.stream)
        self._fill(t, value)
        return t.data

    def alloc_scratch(self, nbytes: int) -> int:
        ep = self.ep
        if ep.allocator is None:
            block = np.empty(max(nbytes, 1), np.uint8)  # a CPU EP with no allocator: host memory
            ptr = block.ctypes.data
        else:
            block = Allocation(ep.allocator, max(nbytes, 1), self.stream.ptr if self.stream else None, ep.owner)
            ptr = block.ptr
        self.scratch[ptr] = block
        return ptr

    def free_scratch(self, ptr: int) -> None:
        block = self.scratch.pop(ptr, None)
        if isinstance(block, Allocation):
            block.close()

    # one run
    def _fill(self, t, value) -> None:
        if isinstance(value, np.ndarray):
            # Not from_buffer: an empty array must still give a non-NULL pointer ("allocated").
            t.data = ffi.cast("void*", value.ctypes.data)
        else:
            t.data = ffi.cast("void*", value.ptr)
        shape = value.shape
        t.dims = self.run.shape_array(shape)
        t.rank = len(shape)
        t.elem_type = self.run.executor.elem_type_of(value.dtype)

    def execute(self, capturing: bool) -> None:
        st, node, ep, stream = self.run, self.node, self.ep, self.stream
        input_for, host = st.executor.input_for, self.part.group.host_inputs
        for j, vid in enumerate(node.inputs):
            if j in host:  # a shape-program value read on the host only (compile.describe_group)
                self._fill(self.inputs[j], np.ascontiguousarray(st.values[vid]))
                continue
            self._fill(self.inputs[j], input_for(st, vid, ep.location, stream, ep))
        outs = self.outputs
        for j, vid in enumerate(node.outputs):
            t = outs[j]
            shape = self.static[j]
            if shape is not None:
                self._fill(t, st.make_output(vid, shape, ep, stream))
            else:
                t.data = _NULL
                t.dims, t.rank = self._dims[j]
        f = self.frame
        f.capturing = 1 if capturing else 0
        f.error_node = -1
        self.active = True
        try:
            status = self.compute(self.part.ptr, self.part.state, f)
        finally:
            self.active = False
            for ptr in list(self.scratch):
                self.free_scratch(ptr)
        if status != _NULL:
            where = self.part.describe_error(int(f.error_node))
            try:
                hostapi.check(status, where, KernelError)
            except KernelError as exc:
                exc.node, exc.ep = self.part.name, ep.name
                raise
        missing = [st.plan.value_names[vid] for j, vid in enumerate(node.outputs) if outs[j].data == _NULL]
        if missing:
            raise KernelError(f"{self.part.describe_error(-1)} returned without producing output(s) {missing}",
                              self.part.name, ep.name)
        if stream is not None:
            for vid in node.outputs:
                st.producer[vid] = stream

    def close(self) -> None:
        FRAMES.remove(self.key)
        for ptr in list(self.scratch):
            self.free_scratch(ptr)


class CompiledStep:
    """Runs one compiled partition (ABI v6): one Compute on the thread's call frame."""

    def __init__(self, node: PlanNode, observer=None):
        self.node = node
        self.ep = node.ep
        self.compute = node.kernel.compute
        if observer is not None:
            self.compute = observer.node_call(self.compute, node, "frame")

    def context(self, run, stream: SyncStream | None) -> FrameContext:
        return FrameContext(run, self, stream)

    def __call__(self, st, ctx: FrameContext) -> None:
        ctx.execute(st.capturing)


__all__ = ["CompiledStep", "FrameContext", "FRAMES"]
