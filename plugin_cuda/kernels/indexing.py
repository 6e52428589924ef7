"""Indexing and generator ONNX ops: Split, Tile, Pad, Range, ConstantOfShape, Trilu, GatherElements,
GatherND, ScatterND, CumSum, ArgMax, ArgMin.

Every op writes into the runtime's preallocated output; temporaries come from CuPy's current
(stream-aware) pool, which during graph capture is the graph's private pool filled by the warm-up
runs. Nothing here copies from the host to the device at run time: small per-call numbers (dims,
strides, offsets) travel as kernel arguments, shapes and axes come from host inputs.
"""

from __future__ import annotations

import math

import numpy as np

from ..device.nvrtc import elementwise_table
from .base import ALL, INDEX, NUMERIC, CudaKernel, host_ints, is_half, num_outputs, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

SOURCES = {
    "range": ("T start, T delta", "T y", "y = start + (T)i * delta;"),
    # i indexes the output (and the same-shaped input); rows/cols are the last two dims.
    "trilu": (
        "T x, int64 rows, int64 cols, int64 k, int32 upper", "T y",
        """
        const long long c = i % cols;
        const long long r = (i / cols) % rows;
        const bool keep = upper ? (c - r >= k) : (c - r <= k);
        y = keep ? x : T(0);
        """,
    ),
    # Negative indices count from the end, as ONNX allows for the gather/scatter family.
    "wrap_index": ("T idx, int64 dim", "int64 y", "y = idx < 0 ? (long long)idx + dim : (long long)idx;"),
}

elementwise = elementwise_table(SOURCES)
_I64 = np.dtype(np.int64)
_F32 = np.dtype(np.float32)


@register("Split", 2)
class Split(CudaKernel):
    """Split by sizes (attribute before opset 13, host input from 13 on) or into equal parts
    (opset 18's num_outputs: ceil-sized parts, the last one smaller)."""

    input_types = (ALL, INDEX)
    same_type = ()
    host_inputs = (1,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", 0)
        self.split_attr = self.attr_ints("split") if self.opset < 13 else None
        self.num_outputs_attr = self.attr_int("num_outputs") if self.opset >= 18 else None

    def _plan(self, shape, split, count):
        axis = self.axis(self.axis_attr, len(shape))
        dim = shape[axis]
        if split is None:
            if self.num_outputs_attr is not None:
                if self.num_outputs_attr != count:
                    raise ValueError(f"Split node '{self.node_name}': num_outputs is {self.num_outputs_attr} "
                                     f"but the node has {count} outputs")
                part = -(-dim // count)
                split = tuple(min(part, max(dim - part * i, 0)) for i in range(count))
            else:
                if dim % count:
                    raise ValueError(f"Split node '{self.node_name}': dimension {dim} of axis {axis} does not "
                                     f"split into {count} equal parts")
                split = (dim // count,) * count
        if len(split) != count or sum(split) != dim or any(s < 0 for s in split):
            raise ValueError(f"Split node '{self.node_name}': split {list(split)} does not cut dimension {dim} "
                             f"of axis {axis} into {count} parts")
        regions, start = [], 0
        for size in split:
            index = (slice(None),) * axis + (slice(start, start + size),)
            regions.append((shape[:axis] + (size,) + shape[axis + 1:], index))
            start += size
        return tuple(regions)

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = inputs[0]
        if self.opset < 13:
            split = self.split_attr
        else:
            split = host_ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
        regions = self.plan((x.shape, split, num_outputs(ctx)), self._plan)
        for i, (shape, index) in enumerate(regions):
            out = ctx.output(i, shape, x.dtype)
            if out.size:
                cupy.copyto(out, x[index])


@register("Tile", 6)
class Tile(CudaKernel):
    """One broadcasting copy: the output viewed as (r0, d0, r1, d1, ...) takes x viewed as (1, d0, 1, d1, ...)."""

    input_types = (ALL, INDEX)
    same_type = ()
    host_inputs = (1,)

    def _plan(self, shape, repeats):
        if len(repeats) != len(shape) or any(r < 0 for r in repeats):
            raise ValueError(f"Tile node '{self.node_name}': repeats {list(repeats)} do not fit input shape "
                             f"{list(shape)}; allowed: {len(shape)} integers >= 0")
        out_shape = tuple(d * r for d, r in zip(shape, repeats))
        out_view = tuple(v for r, d in zip(repeats, shape) for v in (r, d))
        in_view = tuple(v for d in shape for v in (1, d))
        return out_shape, out_view, in_view

    def _compute(self, ctx):
        x, repeats = ctx.inputs
        out_shape, out_view, in_view = self.plan((x.shape, host_ints(repeats)), self._plan)
        out = ctx.output(0, out_shape, x.dtype)
        if out.size:
            cupy.copyto(out.reshape(out_view), x.reshape(in_view))


@register("Pad", 2)
class Pad(CudaKernel):
    """Pad: pads (and the constant value, axes) are attributes before opset 11, host inputs after."""

    input_types = (ALL, INDEX, ALL, INDEX)
    same_type = ()
    host_inputs = (1, 2, 3)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        allowed = ("constant", "reflect", "edge", "wrap") if self.opset >= 19 else ("constant", "reflect", "edge")
        self.mode = self.attr_str("mode", "constant", allowed)
        if self.opset < 11:
            self.pads_attr = self.attr_ints("pads")
            self.value_attr = self.attr_float("value", 0.0)

    def _plan(self, shape, pads, axes):
        rank = len(shape)
        axes = tuple(range(rank)) if axes is None else tuple(self.axis(a, rank, "axes") for a in axes)
        if len(pads) != 2 * len(axes):
            raise ValueError(f"Pad node '{self.node_name}': pads {list(pads)} do not fit {len(axes)} axes; "
                             f"allowed: {2 * len(axes)} integers")
        begin, end = [0] * rank, [0] * rank
        for k, a in enumerate(axes):
            begin[a], end[a] = pads[k], pads[k + len(axes)]
        out_shape = tuple(d + b + e for d, b, e in zip(shape, begin, end))
        if any(d < 0 for d in out_shape):
            raise ValueError(f"Pad node '{self.node_name}': pads {list(pads)} crop input shape {list(shape)} "
                             "below zero")
        # Negative pads crop: the source region drops them, the destination region skips the positive ones.
        src = tuple(slice(max(-b, 0), d - max(-e, 0)) for d, b, e in zip(shape, begin, end))
        dst = tuple(slice(max(b, 0), max(b, 0) + (d - max(-b, 0) - max(-e, 0))) for d, b, e in zip(shape, begin, end))
        widths = tuple((max(b, 0), max(e, 0)) for b, e in zip(begin, end))
        return out_shape, src, dst, widths

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = inputs[0]
        n = len(inputs)
        if self.opset < 11:
            pads, value, axes = self.pads_attr, self.value_attr, None
        else:
            pads = host_ints(inputs[1])
            value = inputs[2].reshape(-1)[0].item() if n > 2 and inputs[2] is not None and inputs[2].size else 0
            axes = host_ints(inputs[3]) if n > 3 and inputs[3] is not None else None
        out_shape, src, dst, widths = self.plan((x.shape, pads, axes), self._plan)
        out = ctx.output(0, out_shape, x.dtype)
        if not out.size:
            return
        if self.mode == "constant":
            out.fill(value)
            if x[src].size:
                cupy.copyto(out[dst], x[src])
            return
        cupy.copyto(out, cupy.pad(x[src], widths, mode=self.mode))


@register("Range", 11)
class Range(CudaKernel):
    input_types = (NUMERIC, NUMERIC, NUMERIC)
    host_inputs = (0, 1, 2)

    def _compute(self, ctx):
        start, limit, delta = (np.asarray(v).reshape(()) for v in ctx.inputs[:3])
        dtype = start.dtype
        if delta == 0:
            raise ValueError(f"Range node '{self.node_name}': delta is 0")
        count = max(int(math.ceil((float(limit) - float(start)) / float(delta))), 0)
        out = ctx.output(0, (count,), dtype)
        if count:
            elementwise("range")(dtype.type(start), dtype.type(delta), out)


@register("ConstantOfShape", 9)
class ConstantOfShape(CudaKernel):
    input_types = (INDEX,)
    host_inputs = (0,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        value = self.attrs.get("value")
        if value is None:
            value = np.zeros(1, np.float32)
        value = np.asarray(value)
        if value.size != 1 or value.dtype.name not in ALL:
            raise self.bad_attr("value", value, "a one-element tensor of float32, float16, bfloat16, int32, int64 or bool")
        self.value = value.reshape(-1)[0]

    def _compute(self, ctx):
        shape = host_ints(ctx.inputs[0])
        if any(d < 0 for d in shape):
            raise ValueError(f"ConstantOfShape node '{self.node_name}': shape {list(shape)} has a negative dim")
        out = ctx.output(0, shape, self.value.dtype)
        if out.size:
            out.fill(self.value)


@register("Trilu", 14)
class Trilu(CudaKernel):
    input_types = (ALL, INDEX)
    same_type = ()
    host_inputs = (1,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.upper = self.attr_int("upper", 1, (0, 1))

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = inputs[0]
        if x.ndim < 2:
            raise ValueError(f"Trilu node '{self.node_name}': input rank {x.ndim}; allowed: 2 or more")
        k = host_ints(inputs[1])[0] if len(inputs) > 1 and inputs[1] is not None else 0
        out = ctx.output(0, x.shape, x.dtype)
        if out.size:
            elementwise("trilu")(x, x.shape[-2], x.shape[-1], k, self.upper, out)


def _wrapped(indices, dim: int):
    """int64 indices with negatives counted from the end (a new device array)."""
    return elementwise("wrap_index")(indices, dim)


@register("GatherElements", 11)
class GatherElements(CudaKernel):
    input_types = (ALL, INDEX)
    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", 0)

    def _compute(self, ctx):
        data, indices = ctx.inputs
        if data.ndim != indices.ndim:
            raise ValueError(f"GatherElements node '{self.node_name}': data rank {data.ndim} and indices rank "
                             f"{indices.ndim} differ")
        axis = self.axis(self.axis_attr, data.ndim)
        out = ctx.output(0, indices.shape, data.dtype)
        if out.size:
            cupy.copyto(out, cupy.take_along_axis(data, _wrapped(indices, data.shape[axis]), axis))


def _linear_index(node: str, data_shape: tuple, indices, batch_dims: int):
    """(rows of data viewed as (batch * M, inner), row index per index tuple, inner shape) for the
    ND gather/scatter family: an index tuple of length q addresses data.shape[batch_dims:batch_dims+q]."""
    q = indices.shape[-1] if indices.ndim else 0
    lead = data_shape[:batch_dims]
    if q == 0 or indices.shape[:batch_dims] != lead or batch_dims + q > len(data_shape):
        raise ValueError(f"{node}: indices shape {list(indices.shape)} does not fit data shape {list(data_shape)} "
                         f"with batch_dims {batch_dims}")
    dims = data_shape[batch_dims:batch_dims + q]
    inner = data_shape[batch_dims + q:]
    m = int(np.prod(dims, dtype=np.int64))
    batch = int(np.prod(lead, dtype=np.int64))
    idx = indices.reshape(batch, -1, q)
    lin = None
    stride = 1
    for j in range(q - 1, -1, -1):
        term = _wrapped(idx[:, :, j], dims[j])
        if stride != 1:
            term *= stride
        lin = term if lin is None else lin + term
        stride *= dims[j]
    if batch > 1:
        lin += cupy.arange(batch, dtype=_I64)[:, None] * m
    return lin.reshape(-1), inner


@register("GatherND", 11)
class GatherND(CudaKernel):
    input_types = (ALL, INDEX)
    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.batch_dims = self.attr_int("batch_dims", 0) if self.opset >= 12 else 0

    def _compute(self, ctx):
        data, indices = ctx.inputs
        node = f"GatherND node '{self.node_name}'"
        lin, inner = _linear_index(node, data.shape, indices, self.batch_dims)
        out = ctx.output(0, indices.shape[:-1] + inner, data.dtype)
        if out.size:
            rows = data.reshape(-1, int(np.prod(inner, dtype=np.int64)))
            cupy.take(rows, lin, axis=0, out=out.reshape(lin.size, rows.shape[1]))


_SCATTER_UFUNCS = {} if cupy is None else {"add": cupy.add, "max": cupy.maximum, "min": cupy.minimum}


@register("ScatterND", 11)
class ScatterND(CudaKernel):
    input_types = (ALL, INDEX, ALL)
    same_type = (0, 2)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        allowed = ("none", "add", "max", "min") if self.opset >= 18 else ("none", "add") if self.opset >= 16 \
            else ("none",)
        self.reduction = self.attr_str("reduction", "none", allowed)

    def _compute(self, ctx):
        data, indices, updates = ctx.inputs
        node = f"ScatterND node '{self.node_name}'"
        out = ctx.output(0, data.shape, data.dtype)
        if not out.size:
            return
        cupy.copyto(out, data)
        lin, inner = _linear_index(node, data.shape, indices, 0)
        if not lin.size:
            return
        width = int(np.prod(inner, dtype=np.int64))
        rows = out.reshape(-1, width)
        upd = updates.reshape(-1, width)
        if upd.shape[0] != lin.size:
            raise ValueError(f"{node}: updates shape {list(updates.shape)} does not fit indices shape "
                             f"{list(indices.shape)} and data shape {list(data.shape)}")
        if self.reduction == "none":
            rows[lin] = upd
        elif is_half(out.dtype):
            # Half types reduce in float32 (one rounding at the end; CuPy's scatter has no bfloat16
            # atomics), then are stored back in their own type.
            wide = rows.astype(_F32)
            _SCATTER_UFUNCS[self.reduction].at(wide, lin, upd.astype(_F32))
            cupy.copyto(rows, wide, casting="unsafe")
        else:
            # ufunc.at applies repeated indices one after another, as ScatterND's reductions require.
            _SCATTER_UFUNCS[self.reduction].at(rows, lin, upd)


@register("CumSum", 11)
class CumSum(CudaKernel):
    input_types = (NUMERIC, INDEX)
    same_type = ()
    host_inputs = (1,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.exclusive = bool(self.attr_int("exclusive", 0, (0, 1)))
        self.reverse = bool(self.attr_int("reverse", 0, (0, 1)))

    def _compute(self, ctx):
        x, axis_in = ctx.inputs
        axis = self.axis(host_ints(axis_in)[0], x.ndim)
        out = ctx.output(0, x.shape, x.dtype)
        if not out.size:
            return
        flip = (slice(None),) * axis + (slice(None, None, -1),)
        src = x[flip] if self.reverse else x
        dst = out[flip] if self.reverse else out
        # CuPy's cumsum has no bfloat16 loop; both half types accumulate in float32.
        total = cupy.cumsum(src.astype(_F32) if is_half(x.dtype) else src, axis=axis)
        if self.exclusive:
            head = (slice(None),) * axis + (slice(0, 1),)
            dst[head] = 0
            if x.shape[axis] > 1:
                cupy.copyto(dst[(slice(None),) * axis + (slice(1, None),)],
                            total[(slice(None),) * axis + (slice(0, -1),)], casting="unsafe")
        else:
            cupy.copyto(dst, total, casting="unsafe")


class _ArgReduce(CudaKernel):
    input_types = (NUMERIC,)
    reducer = ""

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", 0)
        self.keepdims = bool(self.attr_int("keepdims", 1, (0, 1)))
        self.last = bool(self.attr_int("select_last_index", 0, (0, 1))) if self.opset >= 12 else False
        self._fn = getattr(cupy, self.reducer) if cupy is not None else None

    def _compute(self, ctx):
        x = ctx.inputs[0]
        axis = self.axis(self.axis_attr, x.ndim)
        shape = x.shape[:axis] + ((1,) if self.keepdims else ()) + x.shape[axis + 1:]
        out = ctx.output(0, shape, _I64)
        if not out.size:
            return
        if self.last:
            flipped = x[(slice(None),) * axis + (slice(None, None, -1),)]
            r = self._fn(flipped, axis=axis)
            cupy.subtract(x.shape[axis] - 1, r, out=out.reshape(r.shape))
        else:
            cupy.copyto(out.reshape(x.shape[:axis] + x.shape[axis + 1:]), self._fn(x, axis=axis))


@register("ArgMax", 1)
class ArgMax(_ArgReduce):
    reducer = "argmax"


@register("ArgMin", 1)
class ArgMin(_ArgReduce):
    reducer = "argmin"

