"""The com.microsoft quantized ops that onnxruntime's quantizer emits (QOperator format and
quantize_dynamic): QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearAveragePool, QGemm,
QLinearSigmoid, QLinearLeakyRelu, QLinearConcat, DynamicQuantizeMatMul, MatMulIntegerToFloat.

Arithmetic follows onnxruntime's reference (non-SIMD) MLAS kernels: scale ratios in float32, rounding
half to even, saturation. onnxruntime's vectorized kernels may round a value the other way where the
float32 result sits on a .5 boundary (rare: the tests allow one step on these element-wise ops).
"""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep.base import OpKernel, normalize_axis
from host.cpu_ep.ops_pool import AveragePool
from host.cpu_ep.ops_quant import (
    F32,
    DynamicQuantizeLinear,
    int_matmul,
    requantize,
    saturate_round,
)
from host.cpu_ep.registry import register

MS = "com.microsoft"


def _f32(v) -> np.ndarray:
    return np.asarray(v, dtype=F32)


def _centered32(x, zero_point) -> np.ndarray:
    """float32(x - zero_point), as MLAS converts int32 differences."""
    return (x.astype(np.int32) - np.asarray(zero_point if zero_point is not None else 0).astype(np.int32)).astype(F32)


def _out_dtype(zero_point, fallback) -> np.dtype:
    return np.asarray(zero_point).dtype if zero_point is not None else np.dtype(fallback)


@register("QLinearAdd", domain=MS)
class QLinearAdd(OpKernel):
    """MLAS's form, which its rounding depends on: the zero points folded into one float32
    constant, zp_c - (ratio_a * zp_a + ratio_b * zp_b), plus ratio_a * a + ratio_b * b."""

    def _run(self, a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp=None):
        ratio_a = _f32(a_scale) / _f32(c_scale)
        ratio_b = _f32(b_scale) / _f32(c_scale)
        zp_a, zp_b, zp_c = (_f32(z if z is not None else 0) for z in (a_zp, b_zp, c_zp))
        fixed = zp_c - (ratio_a * zp_a + ratio_b * zp_b)
        values = (a.astype(F32) * ratio_a + fixed) + b.astype(F32) * ratio_b
        return (saturate_round(values, np.float32(0), _out_dtype(c_zp, a.dtype)),)


@register("QLinearMul", domain=MS)
class QLinearMul(OpKernel):
    def _run(self, a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp=None):
        mult = _f32(a_scale) * _f32(b_scale) / _f32(c_scale)
        values = (_centered32(a, a_zp) * _centered32(b, b_zp)) * mult
        return (saturate_round(values, _f32(c_zp if c_zp is not None else 0), _out_dtype(c_zp, a.dtype)),)


@register("QLinearGlobalAveragePool", domain=MS)
class QLinearGlobalAveragePool(OpKernel):
    """int32 sums per channel, requantized by x_scale / (y_scale * image size)."""

    def __init__(self, node):
        super().__init__(node)
        self.channels_last = self.attr_bool("channels_last", 0)

    def _run(self, x, x_scale, x_zp, y_scale, y_zp=None):
        axes = tuple(range(1, x.ndim - 1)) if self.channels_last else tuple(range(2, x.ndim))
        size = math.prod(x.shape[a] for a in axes)
        acc = x.astype(np.int64).sum(axis=axes, keepdims=True)
        acc -= int(np.asarray(x_zp if x_zp is not None else 0)) * size
        scale = _f32(x_scale) / (_f32(y_scale) * np.float32(size))
        return (requantize(acc, scale, y_zp, _out_dtype(y_zp, x.dtype)),)


@register("QLinearAveragePool", domain=MS)
class QLinearAveragePool(OpKernel):
    """Dequantize, the float AveragePool, quantize."""

    def __init__(self, node):
        super().__init__(node)
        self.channels_last = self.attr_bool("channels_last", 0)
        self.pool = AveragePool(node)

    def _run(self, x, x_scale, x_zp, y_scale, y_zp=None):
        values = _centered32(x, x_zp) * _f32(x_scale)
        if self.channels_last:
            values = np.moveaxis(values, -1, 1)
        y = self.pool._run(values)[0]
        if self.channels_last:
            y = np.moveaxis(y, 1, -1)
        return (saturate_round(y / _f32(y_scale), _f32(y_zp if y_zp is not None else 0), _out_dtype(y_zp, x.dtype)),)


def _table_op(x, x_scale, x_zp, y_scale, y_zp, fn) -> np.ndarray:
    """An 8-bit element-wise op through a 256-entry table: quantize(fn(dequantize(q))) for every q."""
    info = np.iinfo(x.dtype)
    codes = np.arange(info.min, info.max + 1, dtype=np.int32)
    values = fn(_centered32(codes, x_zp) * _f32(x_scale)).astype(F32)
    table = saturate_round(values / _f32(y_scale), _f32(y_zp if y_zp is not None else 0), _out_dtype(y_zp, x.dtype))
    return table[x.astype(np.int32) - info.min]


@register("QLinearSigmoid", domain=MS)
class QLinearSigmoid(OpKernel):
    def _run(self, x, x_scale, x_zp, y_scale, y_zp=None):
        return (_table_op(x, x_scale, x_zp, y_scale, y_zp, lambda v: 1 / (1 + np.exp(-v))),)


@register("QLinearLeakyRelu", domain=MS)
class QLinearLeakyRelu(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.alpha = np.float32(self.attr_float("alpha", 0.01))

    def _run(self, x, x_scale, x_zp, y_scale, y_zp=None):
        return (_table_op(x, x_scale, x_zp, y_scale, y_zp, lambda v: np.where(v >= 0, v, v * self.alpha)),)


@register("QLinearConcat", domain=MS)
class QLinearConcat(OpKernel):
    """Inputs: y_scale, y_zero_point, then (x, x_scale, x_zero_point) per tensor; each tensor is
    requantized to the output's parameters (copied when they are the same)."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis")

    def _run(self, y_scale, y_zp, *triples):
        if len(triples) % 3:
            raise ValueError(f"QLinearConcat takes (x, scale, zero point) triples after y_scale, y_zero_point; "
                             f"got {len(triples)} inputs there")
        parts = []
        for x, x_scale, x_zp in zip(triples[0::3], triples[1::3], triples[2::3]):
            if np.array_equal(x_scale, y_scale) and np.array_equal(x_zp, y_zp):
                parts.append(x)
            else:
                parts.append(_table_op(x, x_scale, x_zp, y_scale, y_zp, lambda v: v))
        axis = normalize_axis(self.axis, parts[0].ndim)
        return (np.concatenate(parts, axis=axis),)


@register("QGemm", domain=MS)
class QGemm(OpKernel):
    """alpha * A' @ B' over zero-point-centered integers plus the int32 bias C; quantized output when
    y_scale is given, float32 otherwise."""

    def __init__(self, node):
        super().__init__(node)
        self.alpha = np.float32(self.attr_float("alpha", 1.0))
        self.trans_a = self.attr_bool("transA", 0)
        self.trans_b = self.attr_bool("transB", 0)

    def _run(self, a, a_scale, a_zp, b, b_scale, b_zp, c=None, y_scale=None, y_zp=None):
        a2 = a.T if self.trans_a else a
        b2 = b.T if self.trans_b else b
        b_zp2 = None if b_zp is None else np.asarray(b_zp).reshape(-1)
        acc = int_matmul(a2, b2, a_zp, b_zp2)
        if c is not None:
            acc += np.asarray(c).astype(np.float64)
        b_scale = np.asarray(b_scale, F32).reshape(1, -1) if np.asarray(b_scale).size > 1 else _f32(b_scale)
        scale = _f32(a_scale) * b_scale * self.alpha
        if y_scale is None:
            return ((acc.astype(F32) * scale).astype(F32),)
        mult = (scale / _f32(y_scale)).astype(F32)
        return (requantize(acc, mult, y_zp, _out_dtype(y_zp, np.uint8)),)


def _per_column(v) -> np.ndarray:
    v = np.asarray(v, F32)
    return v if v.size == 1 else v.reshape(1, -1)


@register("MatMulIntegerToFloat", domain=MS)
class MatMulIntegerToFloat(OpKernel):
    def _run(self, a, b, a_scale, b_scale, a_zp=None, b_zp=None, bias=None):
        acc = int_matmul(a, b, a_zp, b_zp)
        y = acc.astype(F32) * (_f32(a_scale) * _per_column(b_scale))
        if bias is not None:
            y += bias
        return (y.astype(F32),)


@register("DynamicQuantizeMatMul", domain=MS)
class DynamicQuantizeMatMul(OpKernel):
    """A quantized to uint8 on the fly (as DynamicQuantizeLinear), then MatMulIntegerToFloat."""

    def __init__(self, node):
        super().__init__(node)
        self.quantize = DynamicQuantizeLinear(node)

    def _run(self, a, b, b_scale, b_zp=None, bias=None):
        qa, a_scale, a_zp = self.quantize._run(a)
        acc = int_matmul(qa, b, a_zp, b_zp)
        y = acc.astype(F32) * (a_scale * _per_column(b_scale))
        if bias is not None:
            y += bias
        return (y.astype(F32),)


@register("QLinearSoftmax", domain=MS)
class QLinearSoftmax(OpKernel):
    """Dequantize, softmax in float32 along `axis` (the whole tail from `axis` where the op's `opset`
    attribute is below 13, as Softmax-1/11 coerce to 2-D), quantize. onnxruntime sums a table of
    exponentials instead
    (and scales by floor(1 / y_scale)); the results agree within one quantization step."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)
        self.flatten = self.attr_int("opset", 13) < 13

    def _run(self, x, x_scale, x_zp, y_scale, y_zp=None):
        axis = normalize_axis(self.axis, x.ndim)
        shape = x.shape
        codes = x.reshape(*shape[:axis], -1) if self.flatten else x
        axis = codes.ndim - 1 if self.flatten else axis
        # exp((q - max(q)) * scale): the zero point cancels out.
        shifted = (codes.astype(np.int32) - codes.max(axis=axis, keepdims=True).astype(np.int32)).astype(F32)
        e = np.exp(shifted * _f32(x_scale))
        # onnxruntime scales by floor(1 / y_scale), not 1 / y_scale (254, not 255, for a 1/255 scale)
        steps = np.floor(np.float32(1) / _f32(y_scale)).astype(F32)
        p = (e * steps) / e.sum(axis=axis, keepdims=True)
        y = saturate_round(p, _f32(y_zp if y_zp is not None else 0), _out_dtype(y_zp, x.dtype))
        return (y.reshape(shape),)
