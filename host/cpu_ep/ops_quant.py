"""Quantized ops of the default domain: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv.

Integer products are exact: operands minus their zero points are small integers, so a float GEMM
(BLAS) gives the int32 accumulator exactly: float32 (sgemm, half the memory traffic) where every partial
sum is bounded below 2**24 (reduction length x the two operand spans: 8-bit operands up to K = 258),
float64 otherwise (far below 2**53). Requantization
follows onnxruntime's MLAS: the multiplier is computed in float32 (x_scale * w_scale / y_scale), the
accumulator converted to float32, scaled, rounded half to even, offset by the zero point and saturated.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from host.cpu_ep.base import OpKernel, normalize_axis
from host.cpu_ep.ops_nn import Conv
from host.cpu_ep.registry import register

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def _float8_dtypes() -> dict:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a dependency
        return {}
    names = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn", "float8_e8m0fnu")
    # float4_e2m1fn and float8_e8m0fnu came in ml_dtypes 0.5: the small float types quantize by a cast
    return {np.dtype(getattr(ml_dtypes, n)): True for n in names if hasattr(ml_dtypes, n)}


_FLOAT8 = _float8_dtypes()


@functools.cache
def int_range(dtype: np.dtype) -> tuple[int, int]:
    """The saturation bounds of an integer type (int4/uint4 through ml_dtypes); cached, as np.iinfo
    costs microseconds and every quantized kernel asks on every run."""
    info = np.iinfo(dtype) if dtype.kind in "iu" else _ml_iinfo(dtype)
    return int(info.min), int(info.max)


def _ml_iinfo(dtype: np.dtype):
    import ml_dtypes
    return ml_dtypes.iinfo(dtype)


def _is_integer(dtype: np.dtype) -> bool:
    return dtype.kind in "iu" or dtype.name in ("int4", "uint4", "int2", "uint2")


def saturate_round(values: np.ndarray, zero_point, dtype: np.dtype) -> np.ndarray:
    """round-half-even(values) + zero_point, saturated to `dtype` (integer) or cast (float8)."""
    if dtype in _FLOAT8:
        return (values + np.asarray(zero_point).astype(values.dtype)).astype(dtype)
    lo, hi = int_range(dtype)
    q = np.rint(values)
    q += np.asarray(zero_point).astype(q.dtype)
    np.clip(q, lo, hi, out=q)
    return q.astype(dtype)


def broadcast_param(param: np.ndarray, x: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """A scale or zero point shaped to broadcast against `x`: scalar (per tensor), 1-D along `axis`
    (per axis), or the shape of `x` with `axis` divided by block_size (blocked)."""
    param = np.asarray(param)
    if param.size == 1 and param.ndim <= 1 and not block_size:
        return param.reshape(())
    if param.ndim <= 1 and not block_size:
        ax = normalize_axis(axis, x.ndim)
        if param.shape[0] != x.shape[ax]:
            raise ValueError(f"per-axis parameter of length {param.shape[0]} does not match axis {ax} "
                             f"of input shape {x.shape}")
        return param.reshape([-1 if i == ax else 1 for i in range(x.ndim)])
    ax = normalize_axis(axis, x.ndim)
    if param.ndim != x.ndim or not block_size:
        raise ValueError(f"blocked parameter of shape {param.shape} needs block_size > 0 and the rank of "
                         f"the input {x.shape}")
    rep = np.repeat(param, block_size, axis=ax)
    return np.take(rep, np.arange(x.shape[ax]), axis=ax)


@register("QuantizeLinear", since=10)
class QuantizeLinear(OpKernel):
    """y = saturate(round(x / y_scale) + y_zero_point); per tensor, per axis (13) or blocked (21)."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 1)
        self.block_size = self.attr_int("block_size", 0, lo=0)
        self.saturate = self.attr_bool("saturate", 1)
        out_dtype = self.attr_int("output_dtype", 0, lo=0)
        self.out_dtype = _onnx_dtype(out_dtype) if out_dtype else None

    def _run(self, x, y_scale, y_zero_point=None):
        dtype = (y_zero_point.dtype if y_zero_point is not None else self.out_dtype) or np.dtype(np.uint8)
        scale = broadcast_param(y_scale, x, self.axis, self.block_size)
        zp = 0 if y_zero_point is None else broadcast_param(y_zero_point, x, self.axis, self.block_size)
        if not isinstance(zp, int):
            zp = zp.astype(F32)
        ct = F32 if x.dtype != F64 else F64
        values = x.astype(ct, copy=False) / scale.astype(ct, copy=False)
        if dtype in _FLOAT8 and not self.saturate:
            return ((values + zp).astype(dtype),)
        if dtype in _FLOAT8:
            import ml_dtypes
            big = float(ml_dtypes.finfo(dtype).max)
            values = np.where(np.isfinite(values), np.clip(values + zp, -big, big), values + zp)
            return (values.astype(dtype),)
        return (saturate_round(values, zp, dtype),)


def _onnx_dtype(elem_type: int) -> np.dtype:
    from onnx.helper import tensor_dtype_to_np_dtype
    return np.dtype(tensor_dtype_to_np_dtype(elem_type))


@register("DequantizeLinear", since=10)
class DequantizeLinear(OpKernel):
    """y = (x - x_zero_point) * x_scale, in the scale's type; per tensor, per axis or blocked."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 1)
        self.block_size = self.attr_int("block_size", 0, lo=0)

    def _run(self, x, x_scale, x_zero_point=None):
        scale = broadcast_param(x_scale, x, self.axis, self.block_size)
        ct = F32 if scale.dtype != F64 else F64
        values = x.astype(ct)
        if x_zero_point is not None:
            values -= broadcast_param(x_zero_point, x, self.axis, self.block_size).astype(ct)
        y = values * scale.astype(ct)
        return (y.astype(scale.dtype, copy=False),)


@register("DynamicQuantizeLinear", since=11)
class DynamicQuantizeLinear(OpKernel):
    """uint8 quantization of x with a scale and zero point taken from its range (including 0)."""

    def _run(self, x):
        x = x.astype(F32, copy=False)
        lo = min(float(x.min()), 0.0) if x.size else 0.0
        hi = max(float(x.max()), 0.0) if x.size else 0.0
        scale = np.float32((np.float32(hi) - np.float32(lo)) / np.float32(255))
        if scale == 0:
            scale = np.float32(1)  # an all-zero tensor: any scale maps it to the zero point
        zp = np.clip(np.rint(np.float32(0) - np.float32(lo) / scale), 0, 255)
        y = saturate_round(x / scale, np.float32(zp), np.dtype(np.uint8))
        return (y, np.array(scale, dtype=F32), np.array(zp, dtype=np.uint8))


def exact_float(k: int, a_dtype: np.dtype, b_dtype: np.dtype) -> np.dtype:
    """The float type in which a length-k dot product of centered a and b values is exact: float32 when
    k * span(a) * span(b) < 2**24 (every partial sum is then an integer float32 holds), else float64."""
    spans = [hi - lo for lo, hi in (int_range(np.dtype(a_dtype)), int_range(np.dtype(b_dtype)))]
    return F32 if k * spans[0] * spans[1] < 2 ** 24 else F64


def centered(x: np.ndarray, zero_point, dtype: np.dtype = F64) -> np.ndarray:
    """x minus its zero point, as float64 (exact for every 8/16-bit value) or `dtype`."""
    out = x.astype(dtype)
    if zero_point is not None:
        out -= np.asarray(zero_point).astype(dtype)
    return out


def matrix_zero_point(zp, n_rows_axis: int, x: np.ndarray):
    """A zero point of MatMulInteger: a scalar, or a per-row (A) / per-column (B) vector."""
    if zp is None or np.asarray(zp).size == 1:
        return None if zp is None else np.asarray(zp).reshape(())
    zp = np.asarray(zp)
    if n_rows_axis == -2:  # A: one zero point per row
        return zp.reshape(*zp.shape[:-1], -1, 1) if zp.ndim > 1 else zp.reshape(-1, 1)
    return zp.reshape(*zp.shape[:-2], 1, -1) if zp.ndim > 1 else zp.reshape(1, -1)


def int_matmul(a, b, a_zero_point=None, b_zero_point=None) -> np.ndarray:
    """(a - a_zero_point) @ (b - b_zero_point) as an exact float32 or float64 array (exact_float)."""
    ct = exact_float(a.shape[-1], a.dtype, b.dtype)
    a_c = centered(a, matrix_zero_point(a_zero_point, -2, a), ct)
    b_c = centered(b, matrix_zero_point(b_zero_point, -1, b), ct)
    return np.matmul(a_c, b_c)


def requantize(acc: np.ndarray, multiplier, zero_point, dtype: np.dtype) -> np.ndarray:
    """MLAS's requantization of an int32 accumulator: float32(acc) * multiplier (float32), rounded
    half to even, plus the zero point, saturated."""
    values = acc.astype(F32) * np.asarray(multiplier, dtype=F32)
    return saturate_round(values, 0 if zero_point is None else np.asarray(zero_point).astype(F32), dtype)


def output_multiplier(a_scale, b_scale, y_scale) -> np.ndarray:
    """a_scale * b_scale / y_scale in float32, as onnxruntime computes it."""
    return (np.asarray(a_scale, F32) * np.asarray(b_scale, F32) / np.asarray(y_scale, F32)).astype(F32)


@register("MatMulInteger", since=10)
class MatMulInteger(OpKernel):
    def _run(self, a, b, a_zero_point=None, b_zero_point=None):
        return (int_matmul(a, b, a_zero_point, b_zero_point).astype(np.int32),)


@register("QLinearMatMul", since=10)
class QLinearMatMul(OpKernel):
    def _run(self, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
        acc = int_matmul(a, b, a_zp, b_zp)
        b_scale = np.asarray(b_scale)
        mult = output_multiplier(a_scale, b_scale.reshape(1, -1) if b_scale.size > 1 else b_scale, y_scale)
        return (requantize(acc, mult, y_zp, np.asarray(y_zp).dtype),)


def _channel(v, ndim: int) -> np.ndarray:
    """A per-output-channel vector shaped (1, C, 1, ...) for an N-C-spatial tensor."""
    v = np.asarray(v)
    return v.reshape(()) if v.size == 1 else v.reshape(1, -1, *[1] * (ndim - 2))


def _weights_centered(w, w_zero_point, dtype: np.dtype) -> np.ndarray:
    out = w.astype(dtype)
    if w_zero_point is not None:
        zp = np.asarray(w_zero_point).astype(dtype)
        out -= zp.reshape(-1, *[1] * (w.ndim - 1)) if zp.size > 1 else zp.reshape(())
    return out


class _IntConv(OpKernel):
    """An exact integer convolution: the float Conv kernel on float64 operands minus their zero
    points (zero padding of centered values is padding with the zero point)."""

    weight_position = 1

    def __init__(self, node):
        super().__init__(node)
        self.conv = Conv(node)
        self._bound_w = None
        self._centered_w: tuple | None = None  # (w, w_zero_point, centered w) of the bound weights

    def bind_constants(self, constants):
        self._bound_w = constants.get(self.weight_position)

    def accumulate(self, x, x_zp, w, w_zp) -> np.ndarray:
        ct = exact_float(math.prod(w.shape[1:]), x.dtype, w.dtype)  # a window's reduction length
        cached = self._centered_w
        if cached is not None and cached[0] is w and cached[1] is w_zp and cached[2].dtype == ct:
            wc = cached[2]
        else:
            wc = _weights_centered(w, w_zp, ct)
            if w is self._bound_w:
                self._centered_w = (w, w_zp, wc)
        return self.conv._run(centered(x, x_zp, ct), wc)[0]


@register("ConvInteger", since=10)
class ConvInteger(_IntConv):
    weight_position = 1

    def _run(self, x, w, x_zero_point=None, w_zero_point=None):
        return (self.accumulate(x, x_zero_point, w, w_zero_point).astype(np.int32),)


@register("QLinearConv", since=10)
class QLinearConv(_IntConv):
    weight_position = 3

    def _run(self, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias=None):
        acc = self.accumulate(x, x_zp, w, w_zp)
        if bias is not None:
            acc += _channel(bias, acc.ndim).astype(F64)
        mult = output_multiplier(x_scale, _channel(w_scale, acc.ndim), y_scale)
        return (requantize(acc, mult, y_zp, np.asarray(y_zp).dtype),)
