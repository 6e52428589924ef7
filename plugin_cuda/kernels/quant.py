"""Quantized ops of the default domain on the GPU: QuantizeLinear, DequantizeLinear (per tensor, per
axis, blocked; 8- and 16-bit integers), DynamicQuantizeLinear, MatMulInteger, QLinearMatMul.

Integer products run as int8 GEMMs on the tensor cores (quant_gemm.py); the arithmetic around them is
that of the CPU EP (host/cpu_ep/ops_quant.py) and onnxruntime's MLAS, in float32 operations that round
the same way. Scales and zero points stay on the device (no host read: capturable), so a zero point
computed at run time (DynamicQuantizeLinear -> MatMulInteger) needs nothing special.
"""

from __future__ import annotations

import numpy as np

from .base import CudaKernel, num_outputs, register
from .quant_gemm import F32, Q8, Q16, bounds, kernel, matmul, zero

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

F32_ONLY = frozenset({"float32"})
DQ_INPUTS = Q16 | {"int32"}
# ONNX element types QuantizeLinear's output_dtype may name here: uint8, int8, uint16, int16
_OUTPUT_DTYPES = {2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16}


class _PerAxis(CudaKernel):
    """The axis / block_size attributes and shaping a scale or zero point against x on the device."""

    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", 1)
        self.block_size = self.attr_int("block_size", 0)
        if self.block_size < 0:
            raise self.bad_attr("block_size", self.block_size, "an integer >= 0")

    def param(self, p, x_shape):
        """p shaped to broadcast against x: 0-d (per tensor), along `axis` (per axis), or repeated
        block_size times along `axis` (blocked)."""
        if p.size == 1 and p.ndim <= 1 and not self.block_size:
            return p.reshape(())
        axis = self.axis(self.axis_attr, len(x_shape))
        if p.ndim <= 1 and not self.block_size:
            if p.shape[0] != x_shape[axis]:
                raise ValueError(f"{self.where}: a per-axis parameter of length {p.shape[0]} for axis {axis} of input "
                                 f"shape {tuple(x_shape)}; allowed: length {x_shape[axis]} (one per element of the axis)")
            return p.reshape([-1 if i == axis else 1 for i in range(len(x_shape))])
        if p.ndim != len(x_shape) or not self.block_size:
            raise ValueError(f"{self.where}: a parameter of shape {tuple(p.shape)} with block_size {self.block_size} for "
                             f"input shape {tuple(x_shape)}; allowed: a scalar, one value per element of the axis, or "
                             "the input's rank with block_size > 0 (blocked)")
        index = [slice(None)] * p.ndim
        index[axis] = slice(0, x_shape[axis])
        return cupy.repeat(p, self.block_size, axis=axis)[tuple(index)]


@register("QuantizeLinear", 10)
class QuantizeLinear(_PerAxis):
    """y = saturate(round(x / y_scale) + y_zero_point), float32 x and scale, 8/16-bit integer y."""

    input_types = (F32_ONLY, F32_ONLY, Q16)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        code = self.attr_int("output_dtype", 0)
        if code and code not in _OUTPUT_DTYPES:
            raise self.bad_attr("output_dtype", code, "0 or an 8/16-bit integer type (2, 3, 4, 5)")
        self.out_dtype = np.dtype(_OUTPUT_DTYPES.get(code, np.uint8))

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, scale = inputs[0], inputs[1]
        zp = inputs[2] if len(inputs) > 2 else None
        dtype = zp.dtype if zp is not None else self.out_dtype
        zp = zero(dtype) if zp is None else self.param(zp, x.shape)
        lo, hi = bounds(dtype)
        kernel("quantize")(x, self.param(scale, x.shape), zp, lo, hi, ctx.output(0, x.shape, dtype))


@register("DequantizeLinear", 10)
class DequantizeLinear(_PerAxis):
    """y = (x - x_zero_point) * x_scale in float32."""

    input_types = (DQ_INPUTS, F32_ONLY, DQ_INPUTS)

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, scale = inputs[0], inputs[1]
        zp = inputs[2] if len(inputs) > 2 else None
        if zp is not None and zp.dtype != x.dtype:
            raise TypeError(f"{self.where}: x is {x.dtype} and x_zero_point {zp.dtype}; they must be one type")
        zp = zero(x.dtype) if zp is None else self.param(zp, x.shape)
        kernel("dequantize")(x, self.param(scale, x.shape), zp, ctx.output(0, x.shape, F32))


@register("DynamicQuantizeLinear", 11)
class DynamicQuantizeLinear(CudaKernel):
    """uint8 y with the scale and zero point of x's range including 0, computed on the device."""

    input_types = (F32_ONLY,)
    max_outputs = 3

    def _compute(self, ctx):
        x = ctx.inputs[0]
        count = num_outputs(ctx)
        y = ctx.output(0, x.shape, np.uint8)
        scale = ctx.output(1, (), F32) if count > 1 else None
        zp = ctx.output(2, (), np.uint8) if count > 2 else None
        quantize_dynamic(x, y, scale, zp)


def quantize_dynamic(x, y=None, scale=None, zp=None):
    """(y uint8, scale float32 0-d, zero point uint8 0-d) of DynamicQuantizeLinear, all on the device
    (into the given buffers where there are)."""
    scale = cupy.empty((), F32) if scale is None else scale
    zp = cupy.empty((), np.uint8) if zp is None else zp
    if x.size:
        kernel("dynamic_params")(cupy.min(x), cupy.max(x), scale, zp)
    else:
        scale.fill(1)
        zp.fill(0)
    y = cupy.empty(x.shape, np.uint8) if y is None else y
    kernel("quantize")(x, scale, zp, np.float32(0), np.float32(255), y)
    return y, scale, zp


def per_row(zp, p_shape):
    """MatMulInteger's a_zero_point against the GEMM's (batch, M, N) product: a scalar, one per row
    (M values, shared by the batch), or one per row of every matrix of the batch ((..., M, 1))."""
    if zp is None or zp.size == 1:
        return None if zp is None else zp.reshape(())
    if zp.size == p_shape[-2]:
        return zp.reshape(-1, 1)
    if zp.size != p_shape[0] * p_shape[-2]:
        raise ValueError(f"a_zero_point of shape {tuple(zp.shape)} for {p_shape[-2]} rows in a batch of "
                         f"{p_shape[0]}; allowed: a scalar, one per row, or one per row of each matrix")
    return zp.reshape(p_shape[0], p_shape[-2], 1)


def per_column(v):
    """A b zero point or scale against the GEMM's (batch, M, N) product: a scalar, one per column N
    ((1, N)), or one per column of every matrix of the batch ((..., 1, N) -> (batch, 1, N))."""
    if v is None or v.size == 1:
        return None if v is None else v.reshape(())
    return v.reshape(-1, 1, v.shape[-1]) if v.ndim > 1 else v.reshape(1, -1)


@register("MatMulInteger", 10)
class MatMulInteger(CudaKernel):
    """int32 (a - a_zero_point) @ (b - b_zero_point) on the int8 tensor cores."""

    input_types = (Q8, Q8, Q8, Q8)
    same_type = ()

    def _compute(self, ctx):
        inputs = list(ctx.inputs) + [None] * (4 - len(ctx.inputs))
        a, b, a_zp, b_zp = inputs
        product, out_shape = matmul(a, b)
        y = ctx.output(0, out_shape, np.int32)
        args = product.args(per_row(a_zp, product.p.shape), per_column(b_zp), a.dtype, b.dtype)
        kernel("acc_int")(*args, y.reshape(product.p.shape))


@register("QLinearMatMul", 10)
class QLinearMatMul(CudaKernel):
    """requantize((a - a_zp) @ (b - b_zp)) with the multiplier a_scale * b_scale / y_scale (per tensor
    or per column of b)."""

    input_types = (Q8, F32_ONLY, Q8, Q8, F32_ONLY, Q8, F32_ONLY, Q8)
    same_type = ()

    def _compute(self, ctx):
        a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = ctx.inputs
        product, out_shape = matmul(a, b)
        y = ctx.output(0, out_shape, y_zp.dtype)
        lo, hi = bounds(y_zp.dtype)
        args = product.args(per_row(a_zp, product.p.shape), per_column(b_zp), a.dtype, b.dtype)
        kernel("acc_quant")(*args, a_scale.reshape(()), per_column(b_scale), np.float32(1), y_scale.reshape(()),
                            y_zp.reshape(()), lo, hi, y.reshape(product.p.shape))
