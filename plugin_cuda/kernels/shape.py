"""Data-movement ONNX ops: Reshape, Squeeze, Unsqueeze, Flatten, Identity, Dropout, Expand,
Transpose, Concat, Gather, Slice.

The output buffer is preallocated by the runtime, so even the view-only ops are one device-to-device
copy into it (cupy.copyto). Shape arithmetic is memoised per input shape (and host-side values), so
repeated calls with the same shapes do no Python work beyond a dict lookup.
"""

from __future__ import annotations

import numpy as np

from ..semantics import shapes
from ..semantics.shapes import broadcast_shape
from .base import ALL, BOOL, FLOAT, INDEX, CudaKernel, host_ints, num_outputs, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

@register("Identity", 1)
class Identity(CudaKernel):
    input_types = (ALL,)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        cupy.copyto(ctx.output(0, x.shape, x.dtype), x)


@register("Dropout", 1)
class Dropout(CudaKernel):
    """Inference Dropout: Y = X and, when asked for, a mask of all True."""

    input_types = (FLOAT, FLOAT, BOOL)
    same_type = ()
    host_inputs = (2,)

    def _compute(self, ctx):
        # The runtime only runs inference; a training_mode handed over on the host is still checked.
        inputs = ctx.inputs
        x = inputs[0]
        if len(inputs) > 2 and isinstance(inputs[2], np.ndarray) and bool(inputs[2].reshape(-1)[0]):
            raise ValueError(f"Dropout node '{self.node_name}': training_mode is true; only inference runs")
        cupy.copyto(ctx.output(0, x.shape, x.dtype), x)
        if num_outputs(ctx) > 1:
            ctx.output(1, x.shape, np.dtype(np.bool_)).fill(True)


@register("Reshape", 1)
class Reshape(CudaKernel):
    input_types = (ALL, INDEX)
    same_type = ()
    host_inputs = (1,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.allowzero = self.attr_int("allowzero", 0, (0, 1)) if self.opset >= 14 else 0
        self.shape_attr = self.attr_ints("shape") if self.opset < 5 else None

    def _out_shape(self, in_shape, shape):
        return shapes.reshape_shape(in_shape, shape, self.allowzero, self.where)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        shape = self.shape_attr if self.shape_attr is not None else host_ints(ctx.inputs[1])
        out_shape = self.plan((x.shape, shape), self._out_shape)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x.reshape(out_shape))


class _Axes(CudaKernel):
    """Squeeze / Unsqueeze: axes are an attribute before opset 13, an input from 13 on."""

    input_types = (ALL, INDEX)
    same_type = ()
    host_inputs = (1,)  # from opset 13 on

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axes_attr = self.attr_ints("axes") if self.opset < 13 else None

    def axes_of(self, ctx):
        if self.opset < 13:
            return self.axes_attr
        inputs = ctx.inputs
        return host_ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None


@register("Squeeze", 1)
class Squeeze(_Axes):
    def _out_shape(self, in_shape, axes):
        return shapes.squeeze_shape(in_shape, axes, self.where)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        out_shape = self.plan((x.shape, self.axes_of(ctx)), self._out_shape)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x.reshape(out_shape))


@register("Unsqueeze", 1)
class Unsqueeze(_Axes):
    def _out_shape(self, in_shape, axes):
        return shapes.unsqueeze_shape(in_shape, axes, self.where)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        out_shape = self.plan((x.shape, self.axes_of(ctx)), self._out_shape)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x.reshape(out_shape))


@register("Flatten", 1)
class Flatten(CudaKernel):
    input_types = (ALL,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", 1)

    def _out_shape(self, in_shape):
        return shapes.flatten_shape(in_shape, self.axis_attr, self.where)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        out_shape = self.plan((x.shape,), self._out_shape)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x.reshape(out_shape))


@register("Expand", 8)
class Expand(CudaKernel):
    input_types = (ALL, INDEX)
    same_type = ()
    host_inputs = (1,)

    def _out_shape(self, in_shape, shape):
        try:
            return broadcast_shape(in_shape, shape)
        except ValueError:
            raise ValueError(f"Expand node '{self.node_name}': shape {shape} does not broadcast with "
                             f"input shape {in_shape}") from None

    def _compute(self, ctx):
        x, shape = ctx.inputs
        out_shape = self.plan((x.shape, host_ints(shape)), self._out_shape)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x)


@register("Transpose", 1)
class Transpose(CudaKernel):
    input_types = (ALL,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.perm = self.attr_ints("perm")
        if self.perm is not None and sorted(self.perm) != list(range(len(self.perm))):
            raise self.bad_attr("perm", self.perm, f"a permutation of 0..{len(self.perm) - 1}")

    def _plan(self, in_shape):
        perm = shapes.transpose_perm(self.perm, len(in_shape), self.where)
        return perm, tuple(in_shape[p] for p in perm)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        perm, out_shape = self.plan((x.shape,), self._plan)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x.transpose(perm))


@register("Concat", 4)
class Concat(CudaKernel):
    """Concat as one copy per input into its slice of the output (capture-safe: no pointer table
    uploaded from the host, which cupy.concatenate may do)."""

    input_types = (ALL,)
    variadic = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis")
        if self.axis_attr is None:
            raise self.bad_attr("axis", None, "an integer (the attribute is required)")

    def _plan(self, in_shapes):
        axis, out_shape = shapes.concat_shape(in_shapes, self.axis_attr, self.where)
        total = 0
        regions = []
        for i, s in enumerate(in_shapes):
            if s[axis]:
                regions.append((i, (slice(None),) * axis + (slice(total, total + s[axis]),)))
            total += s[axis]
        return out_shape, tuple(regions)

    def _compute(self, ctx):
        xs = ctx.inputs
        out_shape, regions = self.plan((tuple(x.shape for x in xs),), self._plan)
        out = ctx.output(0, out_shape, xs[0].dtype)
        for i, region in regions:
            cupy.copyto(out[region], xs[i])


@register("Gather", 1)
class Gather(CudaKernel):
    input_types = (ALL, INDEX)
    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", 0)

    def _plan(self, data_shape, index_shape):
        return shapes.gather_shape(data_shape, index_shape, self.axis_attr, self.where)

    def _compute(self, ctx):
        data, indices = ctx.inputs
        axis, out_shape = self.plan((data.shape, indices.shape), self._plan)
        # cupy.take wraps indices (mode 'wrap'), so negative indices count from the end as in ONNX.
        cupy.take(data, indices, axis=axis, out=ctx.output(0, out_shape, data.dtype))


@register("Slice", 1)
class Slice(CudaKernel):
    """Slice: bounds are attributes before opset 10, host inputs (starts, ends, axes, steps) after."""

    input_types = (ALL, INDEX, INDEX, INDEX, INDEX)
    same_type = (1, 2)
    max_outputs = 1
    host_inputs = (1, 2, 3, 4)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        if self.opset < 10:
            self.starts = self.attr_ints("starts")
            self.ends = self.attr_ints("ends")
            self.axes_attr = self.attr_ints("axes")
            if self.starts is None or self.ends is None or len(self.starts) != len(self.ends):
                raise self.bad_attr("starts/ends", (self.starts, self.ends), "two lists of equal length")

    def _plan(self, in_shape, starts, ends, axes, steps):
        return shapes.slice_indices(in_shape, starts, ends, axes, steps, self.where)

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = inputs[0]
        if self.opset < 10:
            key = (x.shape, self.starts, self.ends, self.axes_attr, None)
        else:
            n = len(inputs)
            key = (
                x.shape,
                host_ints(inputs[1]),
                host_ints(inputs[2]),
                host_ints(inputs[3]) if n > 3 and inputs[3] is not None else None,
                host_ints(inputs[4]) if n > 4 and inputs[4] is not None else None,
            )
        index, out_shape = self.plan(key, self._plan)
        out = ctx.output(0, out_shape, x.dtype)
        if out.size:
            cupy.copyto(out, x[index])
