"""Lowering rules of the 2-D windowed ops: Conv (split over input channels when its outputs are
few) and MaxPool / AveragePool."""

from __future__ import annotations

import math

from plugin_cuda.plan import cudnn_step
from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.lowering import (
    attributes,
    lowers,
    present,
)
from plugin_cuda.plan.program import F32
from plugin_cuda.semantics import OpError, shapes


def _window(node, size: tuple, kernel: tuple, ceil_mode: bool = False) -> tuple:
    """(out_sizes, strides, dilations, pads_begin, pads_end) of a 2-D windowed op, as the per-node
    kernels compute them (semantics.shapes.output_geometry: auto_pad, ceil_mode)."""
    attrs = attributes(node)
    auto = attrs.string("auto_pad", "NOTSET", shapes.AUTO_PADS)
    strides = attrs.integers("strides") or (1, 1)
    dil = attrs.integers("dilations") or (1, 1)
    pads = attrs.integers("pads") or (0, 0, 0, 0)
    if len(strides) != 2 or len(dil) != 2 or len(pads) != 4:
        raise PlanError(f"{node.op_type} node '{node.name}': strides {strides}, dilations {dil}, pads {pads}; "
                        "a compiled plan runs 2-D windows (2, 2 and 4 values)")
    try:
        out, begin, end = shapes.output_geometry(node.name, size, kernel, strides, dil, pads, auto, ceil_mode)
    except OpError as exc:  # its message starts "node '<name>'"
        raise PlanError(f"{node.op_type} {exc}") from None
    return out, strides, dil, begin, end


# A convolution whose outputs alone give fewer threads than this is split over its input channels
# (partial sums, then one reduction kernel that also runs the epilogue): the deep layers of a
# batch-1 CNN have a few thousand outputs, each a sum of thousands of products.
CONV_THREADS_WANTED = 1 << 16
CONV_MIN_SLICE = 64  # products per thread and slice, at least


def conv_slices(outputs: int, channels: int, taps: int) -> int:
    """How many channel slices a convolution with `outputs` elements is split into (1: not split)."""
    slices = 1
    while (outputs * slices < CONV_THREADS_WANTED and slices * 2 <= channels
           and -(-channels // (slices * 2)) * taps >= CONV_MIN_SLICE):
        slices *= 2
    return slices


@lowers("Conv")
def _conv(ctx, node):
    x, w = node.inputs[:2]
    xs, ws = ctx.shape(x), ctx.shape(w)
    group = attributes(node).integer("group", 1)
    if len(xs) != 4 or len(ws) != 4:
        raise PlanError(f"Conv node '{node.name}': input {xs} and weight {ws}; a compiled plan runs 2-D convolutions "
                        "(4-D input and weight)")
    if group < 1 or xs[1] % group or ws[0] % group or ws[1] * group != xs[1]:
        raise PlanError(f"Conv node '{node.name}': {xs[1]} input channels, weight {ws} and group {group} do not fit")
    out, strides_, dil, begin, end = _window(node, xs[2:], tuple(ws[2:]))
    bias = node.inputs[2] if present(node, 2) else None
    if bias is not None and ctx.prog.values[bias].size != ws[0]:
        raise PlanError(f"Conv node '{node.name}': bias has shape {ctx.shape(bias)}; expected ({ws[0]},)")
    out_shape = (xs[0], ws[0], out[0], out[1])
    ctx.set_shape(node, node.outputs[0], out_shape)
    geometry = dict(group=group, strides=strides_, dilations=dil, pads=tuple(begin))
    slices = conv_slices(math.prod(out_shape), ws[1], ws[2] * ws[3])
    extra = [bias] if bias is not None else []
    if cudnn_step.wants_cudnn(xs, ws, out_shape, begin, end, group, strides_, dil, ctx.dtype(x)):
        ctx.emit(cudnn_step.KIND, node, [x, w] + extra, [node.outputs[0]], **geometry)
        return
    if slices == 1:
        ctx.emit("conv", node, [x, w] + extra, [node.outputs[0]], **geometry)
        return
    partial = ctx.temp(node, (slices,) + out_shape, "partial", F32)  # float32 partial sums in any type
    ctx.emit("conv_partial", node, [x, w], [partial], slices=slices, **geometry)
    ctx.emit("slice_sum", node, [partial] + extra, [node.outputs[0]], slices=slices)


@lowers("MaxPool", "AveragePool")
def _pool(ctx, node):
    x = node.inputs[0]
    xs = ctx.shape(x)
    attrs = attributes(node)
    kernel = attrs.integers("kernel_shape") or ()
    if len(xs) != 4 or len(kernel) != 2:
        raise PlanError(f"{node.op_type} node '{node.name}': input {xs}, kernel_shape {kernel}; a compiled plan "
                        "runs 2-D pools (4-D input)")
    if any(v >= 0 for v in node.outputs[1:]):
        raise PlanError(f"{node.op_type} node '{node.name}': the Indices output is not supported in a compiled plan")
    out, strides_, dil, begin, end = _window(node, xs[2:], kernel, attrs.flag("ceil_mode"))
    ctx.set_shape(node, node.outputs[0], (xs[0], xs[1], out[0], out[1]))
    ctx.emit("pool", node, [x], [node.outputs[0]], kernel=kernel, strides=strides_, dilations=dil,
             pads=tuple(begin), pads_end=tuple(end), average=node.op_type == "AveragePool",
             include_pad=attrs.flag("count_include_pad"))


