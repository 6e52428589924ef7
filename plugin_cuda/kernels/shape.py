"""Data-movement ONNX ops: Reshape, Squeeze, Unsqueeze, Flatten, Identity, Dropout, Expand,
Transpose, Concat, Gather, Slice.

The output buffer is preallocated by the runtime, so even the view-only ops are one device-to-device
copy into it (cupy.copyto). Shape arithmetic is memoised per input shape (and host-side values), so
repeated calls with the same shapes do no Python work beyond a dict lookup.
"""

from __future__ import annotations

import numpy as np

from .base import ALL, BOOL, FLOAT, INDEX, CudaKernel, broadcast_shape, host_ints, num_outputs, register

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
        out = list(shape)
        for i, d in enumerate(out):
            if d == 0 and not self.allowzero:
                if i >= len(in_shape):
                    raise ValueError(f"Reshape node '{self.node_name}': shape {shape} copies dim {i} "
                                     f"that input shape {in_shape} lacks")
                out[i] = in_shape[i]
        if out.count(-1) > 1:
            raise ValueError(f"Reshape node '{self.node_name}': shape {shape} has more than one -1")
        if any(d < -1 for d in out):
            raise ValueError(f"Reshape node '{self.node_name}': shape {shape} has a dimension below -1")
        size = int(np.prod(in_shape))
        if -1 in out:
            known = int(np.prod([d for d in out if d != -1]))
            if known == 0 or size % known:
                raise ValueError(f"Reshape node '{self.node_name}': cannot infer -1 in {shape} "
                                 f"for input shape {in_shape}")
            out[out.index(-1)] = size // known
        if int(np.prod(out)) != size:
            raise ValueError(f"Reshape node '{self.node_name}': input shape {in_shape} does not fit {shape}")
        return tuple(out)

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
        if axes is None:
            return tuple(d for d in in_shape if d != 1)
        rank = len(in_shape)
        drop = {self.axis(a, rank, "axes") for a in axes}
        for a in drop:
            if in_shape[a] != 1:
                raise ValueError(f"Squeeze node '{self.node_name}': axis {a} of shape {in_shape} is not 1")
        return tuple(d for i, d in enumerate(in_shape) if i not in drop)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        out_shape = self.plan((x.shape, self.axes_of(ctx)), self._out_shape)
        cupy.copyto(ctx.output(0, out_shape, x.dtype), x.reshape(out_shape))


@register("Unsqueeze", 1)
class Unsqueeze(_Axes):
    def _out_shape(self, in_shape, axes):
        if not axes:
            raise ValueError(f"Unsqueeze node '{self.node_name}': axes are required")
        rank = len(in_shape) + len(axes)
        insert = sorted({self.axis(a, rank, "axes") for a in axes})
        if len(insert) != len(axes):
            raise ValueError(f"Unsqueeze node '{self.node_name}': axes {axes} repeat an axis")
        dims = iter(in_shape)
        return tuple(1 if i in insert else next(dims) for i in range(rank))

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
        axis = self.axis(self.axis_attr, len(in_shape), allow_end=True)
        return (int(np.prod(in_shape[:axis])), int(np.prod(in_shape[axis:])))

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
        perm = self.perm if self.perm is not None else tuple(range(len(in_shape)))[::-1]
        if len(perm) != len(in_shape):
            raise ValueError(f"Transpose node '{self.node_name}': perm {perm} does not fit rank {len(in_shape)}")
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

    def _plan(self, shapes):
        rank = len(shapes[0])
        axis = self.axis(self.axis_attr, rank)
        total = 0
        regions = []
        for i, s in enumerate(shapes):
            if len(s) != rank or s[:axis] != shapes[0][:axis] or s[axis + 1:] != shapes[0][axis + 1:]:
                raise ValueError(f"Concat node '{self.node_name}': input shapes {list(shapes)} differ "
                                 f"outside axis {axis}")
            if s[axis]:
                regions.append((i, (slice(None),) * axis + (slice(total, total + s[axis]),)))
            total += s[axis]
        out_shape = shapes[0][:axis] + (total,) + shapes[0][axis + 1:]
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
        axis = self.axis(self.axis_attr, len(data_shape))
        return axis, data_shape[:axis] + index_shape + data_shape[axis + 1:]

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
        rank = len(in_shape)
        if axes is None:
            axes = tuple(range(len(starts)))
        if steps is None:
            steps = (1,) * len(starts)
        if not len(starts) == len(ends) == len(axes) == len(steps):
            raise ValueError(f"Slice node '{self.node_name}': starts {starts}, ends {ends}, axes {axes} and "
                             f"steps {steps} differ in length")
        index = [slice(None)] * rank
        seen = set()
        for start, end, axis, step in zip(starts, ends, axes, steps):
            axis = self.axis(axis, rank, "axes")
            if axis in seen:
                raise ValueError(f"Slice node '{self.node_name}': axes {axes} repeat axis {axis}")
            seen.add(axis)
            if step == 0:
                raise ValueError(f"Slice node '{self.node_name}': steps {steps} contain 0")
            # Clamp the ONNX way (which is Python's), then rebuild a slice CuPy reads the same way:
            # a negative-step stop of -1 from indices() means "past the first element", i.e. None.
            lo, hi, st = slice(start, end, step).indices(in_shape[axis])
            if not range(lo, hi, st):
                index[axis] = slice(0, 0, 1)
            else:
                index[axis] = slice(lo, None if hi < 0 else hi, st)
        index = tuple(index)
        out_shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, in_shape))
        return index, out_shape

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
