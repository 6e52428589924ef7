"""The com.microsoft quantized ops onnxruntime's quantizer emits, on the GPU: MatMulIntegerToFloat,
DynamicQuantizeMatMul, QGemm (quantize_dynamic / QDQ fusion / QOperator GEMMs, on the int8 tensor
cores), QLinearAdd, QLinearMul (element-wise) and QLinearGlobalAveragePool. Registered in the com.microsoft domain, as
onnxruntime does; the arithmetic is that of the CPU EP's host/cpu_ep/ops_quant_ms.py.
"""

from __future__ import annotations

import math

import numpy as np

from .base import MS_DOMAIN, CudaKernel, register
from .quant import F32_ONLY, per_column, per_row, quantize_dynamic
from .quant_gemm import F32, Q8, bounds, kernel, matmul, zero

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

MS = MS_DOMAIN
INT32 = frozenset({"int32"})


def _padded(inputs, count: int) -> list:
    return list(inputs) + [None] * (count - len(inputs))


def _float_out(ctx, product, out_shape, args, a_scale, b_scale, bias, alpha=1.0) -> None:
    y = ctx.output(0, out_shape, F32)
    kernel("acc_float")(*args, a_scale.reshape(()), per_column(b_scale), np.float32(alpha),
                        zero(F32) if bias is None else bias, y.reshape(product.p.shape))


@register("MatMulIntegerToFloat", 1, domain=MS)
class MatMulIntegerToFloat(CudaKernel):
    """float32((a - a_zp) @ (b - b_zp)) * (a_scale * b_scale) + bias."""

    input_types = (Q8, Q8, F32_ONLY, F32_ONLY, Q8, Q8, F32_ONLY)
    same_type = ()

    def _compute(self, ctx):
        a, b, a_scale, b_scale, a_zp, b_zp, bias = _padded(ctx.inputs, 7)
        product, out_shape = matmul(a, b)
        args = product.args(per_row(a_zp, product.p.shape), per_column(b_zp), a.dtype, b.dtype)
        _float_out(ctx, product, out_shape, args, a_scale, b_scale, bias)


@register("DynamicQuantizeMatMul", 1, domain=MS)
class DynamicQuantizeMatMul(CudaKernel):
    """A quantized to uint8 on the device (DynamicQuantizeLinear), then MatMulIntegerToFloat."""

    input_types = (F32_ONLY, Q8, F32_ONLY, Q8, F32_ONLY)
    same_type = ()

    def _compute(self, ctx):
        a, b, b_scale, b_zp, bias = _padded(ctx.inputs, 5)
        qa, a_scale, a_zp = quantize_dynamic(a)
        product, out_shape = matmul(qa, b)
        args = product.args(a_zp, per_column(b_zp), qa.dtype, b.dtype)
        _float_out(ctx, product, out_shape, args, a_scale, b_scale, bias)


@register("QGemm", 1, domain=MS)
class QGemm(CudaKernel):
    """alpha * op(A) @ op(B) over zero-point-centered integers plus the int32 bias C; quantized by
    y_scale / y_zero_point when given, float32 otherwise."""

    input_types = (Q8, F32_ONLY, Q8, Q8, F32_ONLY, Q8, INT32, F32_ONLY, Q8)
    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.alpha = np.float32(self.attr_float("alpha", 1.0))
        self.trans_a = bool(self.attr_int("transA", 0, (0, 1)))
        self.trans_b = bool(self.attr_int("transB", 0, (0, 1)))

    def _compute(self, ctx):
        a, a_scale, a_zp, b, b_scale, b_zp, c, y_scale, y_zp = _padded(ctx.inputs, 9)
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(f"{self.where}: A {tuple(a.shape)} and B {tuple(b.shape)}; allowed: two 2-D matrices")
        product, out_shape = matmul(a, b, self.trans_a, self.trans_b)
        b_zp = None if b_zp is None else b_zp.reshape(-1)
        args = product.args(None if a_zp is None else a_zp.reshape(()), per_column(b_zp), a.dtype, b.dtype, c)
        if y_scale is None:
            _float_out(ctx, product, out_shape, args, a_scale, b_scale.reshape(-1), None, self.alpha)
            return
        dtype = y_zp.dtype if y_zp is not None else np.dtype(np.uint8)
        y = ctx.output(0, out_shape, dtype)
        lo, hi = bounds(dtype)
        kernel("acc_quant")(*args, a_scale.reshape(()), per_column(b_scale.reshape(-1)), self.alpha,
                            y_scale.reshape(()), zero(dtype) if y_zp is None else y_zp.reshape(()), lo, hi,
                            y.reshape(product.p.shape))


class _QLinearBinary(CudaKernel):
    """a, a_scale, a_zp, b, b_scale, b_zp, c_scale[, c_zp]: per-tensor parameters, broadcasting a and b."""

    input_types = (Q8, F32_ONLY, Q8, Q8, F32_ONLY, Q8, F32_ONLY, Q8)
    same_type = ()
    body = ""

    def _compute(self, ctx):
        a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp = _padded(ctx.inputs, 8)
        dtype = c_zp.dtype if c_zp is not None else a.dtype
        y = ctx.output(0, np.broadcast_shapes(a.shape, b.shape), dtype)
        lo, hi = bounds(dtype)
        a_zp = zero(a.dtype) if a_zp is None else a_zp.reshape(())
        b_zp = zero(b.dtype) if b_zp is None else b_zp.reshape(())
        c_zp = zero(dtype) if c_zp is None else c_zp.reshape(())
        kernel(self.body)(a, b, a_scale.reshape(()), a_zp, b_scale.reshape(()), b_zp, c_scale.reshape(()), c_zp,
                          lo, hi, y)


@register("QLinearAdd", 1, domain=MS)
class QLinearAdd(_QLinearBinary):
    """MLAS's form: ratio_a * a + (zp_c - (ratio_a * zp_a + ratio_b * zp_b)) + ratio_b * b."""

    body = "qadd"


@register("QLinearMul", 1, domain=MS)
class QLinearMul(_QLinearBinary):
    body = "qmul"



@register("QLinearGlobalAveragePool", 1, domain=MS)
class QLinearGlobalAveragePool(CudaKernel):
    """int32 sums over the image (exact), minus the zero point's share, requantized by
    x_scale / (y_scale * image size) as the CPU EP does it."""

    input_types = (Q8, F32_ONLY, Q8, F32_ONLY, Q8)
    same_type = ()

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.channels_last = bool(self.attr_int("channels_last", 0, (0, 1)))

    def _compute(self, ctx):
        x, x_scale, x_zp, y_scale, y_zp = _padded(ctx.inputs, 5)
        if x.ndim < 3:
            raise ValueError(f"{self.where}: input shape {tuple(x.shape)}; allowed: rank 3 or more (N, C, spatial...)")
        axes = tuple(range(1, x.ndim - 1)) if self.channels_last else tuple(range(2, x.ndim))
        sums = cupy.sum(x, axis=axes, dtype=np.int32, keepdims=True)
        dtype = y_zp.dtype if y_zp is not None else x.dtype
        lo, hi = bounds(dtype)
        kernel("qgap")(sums, zero(x.dtype) if x_zp is None else x_zp.reshape(()),
                       math.prod(x.shape[a] for a in axes), x_scale.reshape(()), y_scale.reshape(()),
                       zero(dtype) if y_zp is None else y_zp.reshape(()), lo, hi, ctx.output(0, sums.shape, dtype))
