"""Normalisation ONNX ops: Softmax, LogSoftmax, BatchNormalization (inference); LayerNormalization and
RMSNormalization are fused kernels in fused.py.

Reductions (max, sums, means) run in float32 for float16 inputs; results are cast back on the last
write, which also applies the affine part in the same kernel.
"""

from __future__ import annotations

import numpy as np

from ..device.nvrtc import elementwise_table
from ..semantics import shapes
from . import fused
from .base import FLOAT, CudaKernel, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

# (in_params, out_params, body), readable as text.
SOURCES = {
    "exp_sub": ("T x, T m", "float32 e", "e = expf(float(x) - float(m));"),
    "div": ("float32 e, float32 s", "T y", "y = T(e / s);"),
    "log_softmax": ("T x, T m, float32 s", "T y", "y = T(float(x) - float(m) - logf(s));"),
    "batch_norm": (
        "T x, U s, U b, V m, V v, float32 eps", "T y",
        "y = T((float(x) - float(m)) * (float(s) / sqrtf(float(v) + eps)) + float(b));",
    ),
}

elementwise = elementwise_table(SOURCES)


class _SoftmaxBase(CudaKernel):
    """Opset >= 13: along `axis` (default -1). Before 13: over the input coerced to 2-D at `axis`
    (default 1), i.e. over all dimensions from `axis` on."""

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", shapes.softmax_default_axis(self.opset))

    def _plan(self, shape):
        rank = len(shape)
        if self.opset >= 13:
            return None, self.axis(self.axis_attr, rank)
        axis = self.axis(self.axis_attr, rank, allow_end=True)
        rows = int(np.prod(shape[:axis]))
        return (rows, int(np.prod(shape[axis:]))), 1

    def _compute(self, ctx):
        x = ctx.inputs[0]
        shape2d, axis = self.plan((x.shape,), self._plan)
        out = ctx.output(0, x.shape, x.dtype)
        if x.size == 0:
            return
        if (shape2d is not None or axis == x.ndim - 1) and x.flags.c_contiguous:
            # Rows over the last axis (or the coerced 2-D form): one fused kernel.
            n = shape2d[1] if shape2d is not None else x.shape[-1]
            fused.launch_softmax(x.dtype, x.size // n, n, x.data.ptr, out.data.ptr, log=self.log)
            return
        if shape2d is not None:
            x = x.reshape(shape2d)
            out = out.reshape(shape2d)  # a view: out is C-contiguous
        if x.size == 0:
            return
        m = cupy.amax(x, axis=axis, keepdims=True)
        e = elementwise("exp_sub")(x, m)
        s = cupy.sum(e, axis=axis, keepdims=True)
        self._finish(x, m, e, s, out)


@register("Softmax", 1)
class Softmax(_SoftmaxBase):
    log = False

    def _finish(self, x, m, e, s, out):
        elementwise("div")(e, s, out)


@register("LogSoftmax", 1)
class LogSoftmax(_SoftmaxBase):
    log = True

    def _finish(self, x, m, e, s, out):
        elementwise("log_softmax")(x, m, s, out)


@register("BatchNormalization", 1)
class BatchNormalization(CudaKernel):
    """Inference BatchNormalization with running statistics; channels on axis 1."""

    input_types = (FLOAT, FLOAT, FLOAT, FLOAT, FLOAT)
    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        if self.opset >= 14:
            self.attr_int("training_mode", 0, (0,))
        if self.opset < 9:
            self.attr_int("spatial", 1, (1,))

    @classmethod
    def claims(cls, attrs, dtypes, opset):
        # X may differ from the parameters (opset 15: T, T1, T2), but scale/B and mean/var pair up.
        if not super().claims(attrs, dtypes, opset):
            return False
        return len(dtypes) == 5 and dtypes[1] == dtypes[2] and dtypes[3] == dtypes[4]

    def _param_shape(self, rank):
        if rank < 2:
            raise ValueError(f"BatchNormalization node '{self.node_name}': input rank {rank}; allowed: 2 or more")
        return (1, -1) + (1,) * (rank - 2)

    def _compute(self, ctx):
        x, scale, bias, mean, var = ctx.inputs
        shape = self.plan((x.ndim,), self._param_shape)
        elementwise("batch_norm")(
            x, scale.reshape(shape), bias.reshape(shape), mean.reshape(shape), var.reshape(shape),
            self.epsilon, ctx.output(0, x.shape, x.dtype),
        )
