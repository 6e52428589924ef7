"""ReduceSum, ReduceMean, ReduceMax.

Axes are an attribute until ReduceSum-13 / ReduceMean-18 / ReduceMax-18 and an optional host input
from then on; keepdims and noop_with_empty_axes as in the spec. float16 and bfloat16 sums and means
accumulate in float32 and are cast back.
"""

from __future__ import annotations

import numpy as np

from .base import FLOAT, INDEX, CudaKernel, host_ints, is_half, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

_F32 = np.dtype(np.float32)


class _Reduce(CudaKernel):
    input_types = (FLOAT, INDEX)
    same_type = ()
    host_inputs = (1,)
    axes_input_since = 13  # the opset from which axes arrive as input 1
    reducer = ""
    accumulate_f32 = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.keepdims = bool(self.attr_int("keepdims", 1, (0, 1)))
        self.noop = bool(self.attr_int("noop_with_empty_axes", 0, (0, 1)))
        self.axes_attr = self.attr_ints("axes") if self.opset < self.axes_input_since else None
        self._fn = getattr(cupy, self.reducer) if cupy is not None else None

    def _plan(self, shape, axes):
        rank = len(shape)
        if not axes:
            if self.noop:
                return None, shape  # identity
            axes = range(rank)
        norm = tuple(sorted({self.axis(a, rank, "axes") for a in axes}))
        if self.keepdims:
            out_shape = tuple(1 if i in norm else d for i, d in enumerate(shape))
        else:
            out_shape = tuple(d for i, d in enumerate(shape) if i not in norm)
        return norm, out_shape

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = inputs[0]
        if self.opset < self.axes_input_since:
            axes = self.axes_attr
        else:
            axes = host_ints(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
        norm, out_shape = self.plan((x.shape, axes), self._plan)
        out = ctx.output(0, out_shape, x.dtype)
        if norm is None:
            cupy.copyto(out, x)
        elif self.accumulate_f32 and is_half(x.dtype):
            cupy.copyto(out, self._fn(x, axis=norm, dtype=_F32, keepdims=self.keepdims))
        else:
            self._fn(x, axis=norm, keepdims=self.keepdims, out=out)


@register("ReduceSum", 1)
class ReduceSum(_Reduce):
    reducer = "sum"


@register("ReduceMean", 1)
class ReduceMean(_Reduce):
    axes_input_since = 18
    reducer = "mean"


@register("ReduceMax", 1)
class ReduceMax(_Reduce):
    axes_input_since = 18
    reducer = "amax"
    accumulate_f32 = False  # max is exact in float16 and bfloat16
