"""The run step of a plugin kernel: one Compute crossing on the thread's kernel context.

A `KernelContext` per thread and node holds what the kernel sees during Compute (its EpKernelIO,
the input and output EpTensor arrays, the thread's stream); it is built once and refilled per run.
"""

from __future__ import annotations

import numpy as np

import abi
from abi.host_inputs import host_read_inputs
from host.errors import InvalidArgument, KernelError
from host.plugins import hostapi
from host.plugins.ep import SyncStream
from host.plugins.hostapi import CONTEXTS, ffi
from host.runtime.plan import PlanNode
from host.runtime.tensor import check_output_dims

_NULL = ffi.NULL


class KernelContext:
    """What one plugin node sees during Compute on one thread; `handle` is the C pointer."""

    def __init__(self, run, step: PluginStep, stream: SyncStream | None):
        node = step.node
        self.run = run
        self.node = node
        self.ep = node.ep
        self.inputs = ffi.new("EpTensor[]", max(len(node.inputs), 1))
        self.outputs = ffi.new("EpTensor[]", max(len(node.outputs), 1))
        self.io = ffi.new("EpKernelIO*")
        self.io.struct_size = ffi.sizeof("EpKernelIO")
        self.io.version = abi.ABI_VERSION
        self.io.num_inputs, self.io.num_outputs = len(node.inputs), len(node.outputs)
        self.io.inputs = self.inputs
        self.stream = stream
        self.sync_stream = stream.ptr if stream is not None else None
        self.io.gpu_compute_stream = stream.handle if stream is not None else _NULL
        self.active = False  # True only during Compute: a kept context is refused afterwards
        self.handle = CONTEXTS.add(self)
        self.compute = step.compute
        self.kernel_ptr = node.kernel.ptr

    def get_output(self, index: int, dims: tuple):
        if not 0 <= index < len(self.node.outputs):
            raise InvalidArgument(f"output index {index} out of range 0..{len(self.node.outputs) - 1}")
        vid = self.node.outputs[index]
        check_output_dims(dims, self.run.executor.dtype_of(vid), f"output {index} of node '{self.node.name}'")
        value = self.run.make_output(vid, dims, self.ep, self.stream)
        self.run.fill(self.outputs[index], value)
        return self.outputs + index

    def close(self) -> None:
        CONTEXTS.remove(self.handle)


class PluginStep:
    """Runs one node on a plugin EP's kernel: inputs moved to the EP's device, then Compute."""

    def __init__(self, node: PlanNode, observer=None, host_computed: frozenset[int] = frozenset()):
        self.node = node
        self.ep = node.ep
        # Values the shape program computes reach a v7+ EP's kernel in host memory where the op
        # reads that input on the host (abi/host_inputs.py; the view flagged them
        # VALUE_HOST_COMPUTED), so a device EP reads a shape without a device sync.
        reads = host_read_inputs(node.op_type, node.domain) if node.ep.slots.negotiated >= 7 else ()
        self.host_positions = frozenset(j for j in reads if j < len(node.inputs) and node.inputs[j] in host_computed)
        self.compute = node.kernel.Compute
        if observer is not None:
            self.compute = observer.node_call(self.compute, node, "kernel")
        self.what = f"node '{node.name}' ({node.op_type}) on {node.ep.name}"

    def context(self, run, stream: SyncStream | None) -> KernelContext:
        return KernelContext(run, self, stream)

    def __call__(self, st, ctx: KernelContext) -> None:
        node = self.node
        ep = node.ep
        ins = ctx.inputs
        input_for, fill, host = st.executor.input_for, st.fill, self.host_positions
        for j, vid in enumerate(node.inputs):
            if vid < 0:
                ins[j].data, ins[j].ndim = _NULL, -1
                continue
            if j in host:
                fill(ins[j], np.ascontiguousarray(st.values[vid]))  # this signature's shape-program value
                continue
            fill(ins[j], input_for(st, vid, ep.location, ctx.stream, ep))
        ctx.active = True
        try:
            status = ctx.compute(ctx.kernel_ptr, ctx.handle)
        finally:
            ctx.active = False
            for j in range(len(node.outputs)):
                ctx.outputs[j].data = _NULL  # an EpTensor* kept past the call points nowhere
        if status != _NULL:
            try:
                hostapi.check(status, self.what, KernelError)
            except KernelError as exc:
                exc.node, exc.ep = node.name, ep.name
                raise
        values = st.values
        for j, vid in enumerate(node.outputs):
            if vid >= 0 and values[vid] is None:
                raise KernelError(f"node '{node.name}' ({node.op_type}) on {ep.owner} returned OK without producing "
                                  f"output {j} ('{st.plan.value_names[vid]}'); a kernel must call "
                                  "KernelContext_GetOutput for every output", node.name, ep.name)
        if ctx.stream is not None:
            for vid in node.outputs:
                if vid >= 0:
                    st.producer[vid] = ctx.stream


__all__ = ["KernelContext", "PluginStep"]
