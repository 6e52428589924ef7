"""Normalisation ONNX ops: Softmax, LogSoftmax, LayerNormalization, BatchNormalization (inference).

Reductions (max, sums, means) run in float32 for float16 inputs; results are cast back on the last
write, which also applies the affine part in the same kernel.
"""

from __future__ import annotations

import numpy as np

from .base import FLOAT, CudaKernel, kernel_table, num_outputs, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

# (in_params, out_params, body), readable as text.
SOURCES = {
    "exp_sub": ("T x, T m", "float32 e", "e = expf(float(x) - float(m));"),
    "div": ("float32 e, float32 s", "T y", "y = T(e / s);"),
    "log_softmax": ("T x, T m, float32 s", "T y", "y = T(float(x) - float(m) - logf(s));"),
    "sq_diff": ("T x, float32 m", "float32 d", "float v = float(x) - m; d = v * v;"),
    "rstd": ("float32 var, float32 eps", "float32 r", "r = 1.0f / sqrtf(var + eps);"),
    "ln_affine": (
        "T x, float32 m, float32 r, U s, U b", "T y",
        "y = T((float(x) - m) * r * float(s) + float(b));",
    ),
    "ln_scale": ("T x, float32 m, float32 r, U s", "T y", "y = T((float(x) - m) * r * float(s));"),
    "batch_norm": (
        "T x, U s, U b, V m, V v, float32 eps", "T y",
        "y = T((float(x) - float(m)) * (float(s) / sqrtf(float(v) + eps)) + float(b));",
    ),
}

_F32 = np.dtype(np.float32)


elementwise = kernel_table(SOURCES)


class _SoftmaxBase(CudaKernel):
    """Opset >= 13: along `axis` (default -1). Before 13: over the input coerced to 2-D at `axis`
    (default 1), i.e. over all dimensions from `axis` on."""

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", -1 if self.opset >= 13 else 1)

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
    def _finish(self, x, m, e, s, out):
        elementwise("div")(e, s, out)


@register("LogSoftmax", 1)
class LogSoftmax(_SoftmaxBase):
    def _finish(self, x, m, e, s, out):
        elementwise("log_softmax")(x, m, s, out)


@register("LayerNormalization", 17)
class LayerNormalization(CudaKernel):
    """Y = (X - mean) / sqrt(var + eps) * Scale + B over the dimensions from `axis` on.
    Optional outputs Mean and InvStdDev are float32 (stash_type 1)."""

    input_types = (FLOAT, FLOAT, FLOAT)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self.attr_int("stash_type", 1, (1,))

    def _plan(self, shape):
        rank = len(shape)
        axis = self.axis(self.axis_attr, rank)
        return tuple(range(axis, rank)), shape[:axis] + (1,) * (rank - axis)

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, scale = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        axes, stat_shape = self.plan((x.shape,), self._plan)
        out = ctx.output(0, x.shape, x.dtype)
        mean = cupy.mean(x, axis=axes, dtype=_F32, keepdims=True)
        var = cupy.mean(elementwise("sq_diff")(x, mean), axis=axes, keepdims=True)
        rstd = elementwise("rstd")(var, self.epsilon)
        if bias is None:
            elementwise("ln_scale")(x, mean, rstd, scale, out)
        else:
            elementwise("ln_affine")(x, mean, rstd, scale, bias, out)
        n = num_outputs(ctx)
        if n > 1:
            cupy.copyto(ctx.output(1, stat_shape, _F32), mean)
        if n > 2:
            cupy.copyto(ctx.output(2, stat_shape, _F32), rstd)


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
