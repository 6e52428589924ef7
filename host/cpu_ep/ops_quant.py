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
import operator

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel, normalize_axis
from host.cpu_ep.ops_nn import Conv
from host.cpu_ep.registry import register

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


try:  # the clip ufunc itself: np.clip's Python wrapper costs more than the clipping on small tensors
    from numpy._core.umath import clip as _clip  # numpy >= 2
except ImportError:  # pragma: no cover - numpy 1.26
    from numpy.core.umath import clip as _clip


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
    return Saturate(zero_point, dtype)(np.rint(values))


# The types ep_quantize writes (kernels_quant.c's `kind`): their bounds are exact float32 values.
_NATIVE_KINDS = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int16): 2, np.dtype(np.uint16): 3}
_DIVIDE, _MULTIPLY = 2, 1  # ep_quantize's `op`


class Saturate:
    """The end of every quantizing kernel: round half to even, add the zero point, saturate to the
    integer type, convert. Built once per set of constant parameters (the zero point as the float
    type of the values, the bounds as float32 scalars). A run is one compiled call (ep_quantize) for
    float32 values, a scalar zero point and an 8- or 16-bit type, else five ufunc calls in place
    (np.clip's Python wrapper alone costs more than a ufunc on these small tensors)."""

    __slots__ = ("zero_point", "lo", "hi", "dtype", "kind")

    def __init__(self, zero_point, dtype: np.dtype):
        zp = np.asarray(0 if zero_point is None else zero_point)
        self.zero_point = None if not zp.any() else (zp.reshape(()) if zp.size == 1 else zp).astype(F32)
        lo, hi = int_range(np.dtype(dtype))
        self.lo, self.hi, self.dtype = np.float32(lo), np.float32(hi), np.dtype(dtype)
        self.kind = _NATIVE_KINDS.get(self.dtype)

    def __call__(self, values: np.ndarray, zero_point: np.ndarray | None = None) -> np.ndarray:
        """`values` (float, owned by the caller: overwritten) quantized; `zero_point` (0-d float32)
        instead of the built one where the run computes it (DynamicQuantizeLinear)."""
        out = self.scaled(values, None, 0, zero_point)
        if out is not None:
            return out
        np.rint(values, out=values)
        zp = self.zero_point if zero_point is None else zero_point
        if zp is not None and zp.ndim == 0:
            np.add(values, zp, out=values, casting="unsafe")
        elif zp is not None:  # per axis or blocked: may broadcast values to a larger shape
            values = values + zp
        _clip(values, self.lo, self.hi, out=values, casting="unsafe")
        return values.astype(self.dtype)

    def scaled(self, values: np.ndarray, scale, op: int, zero_point: np.ndarray | None = None):
        """saturate(rint(values op scale) + zero point) by ep_quantize (op 0: values as they are, _MULTIPLY,
        _DIVIDE by a float32 scalar `scale`), without touching `values`; None where it does not serve."""
        lib = native.LIB
        zp = self.zero_point if zero_point is None else zero_point
        if (lib is None or self.kind is None or values.dtype != F32 or not values.flags.c_contiguous
                or not values.size or (zp is not None and zp.ndim)):
            return None
        out = np.empty(values.shape, dtype=self.dtype)
        lib.ep_quantize(native.ptr(values), native.ptr(out), values.size, op, 1.0 if scale is None else scale,
                        0.0 if zp is None else zp, self.lo, self.hi, self.kind)
        return out


class BoundParams:
    """Mixin of the quantized kernels: what they derive from their scale, zero-point and weight inputs
    (multipliers, a Saturate, centered weights) is made once when those inputs are the initializers
    the run loop bound (bind_constants), and at every call otherwise (a feed may override an
    initializer)."""

    def __init__(self, node):
        super().__init__(node)
        self._bound: dict = {}
        self._memos: dict = {}

    def bind_constants(self, constants):
        self._bound = dict(constants)
        self._memos = {}

    def derived(self, positions: tuple, args: tuple, make):
        """make(*args), remembered (per `positions`) while `args` are the bound inputs at `positions`."""
        memo = self._memos.get(positions)
        if memo is not None and all(map(operator.is_, args, memo[0])):
            return memo[1]
        value = make(*args)
        bound = self._bound
        if all(bound.get(p) is a for p, a in zip(positions, args)):
            self._memos[positions] = (args, value)
        return value


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
class QuantizeLinear(BoundParams, OpKernel):
    """y = saturate(round(x / y_scale) + y_zero_point); per tensor, per axis (13) or blocked (21)."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 1)
        self.block_size = self.attr_int("block_size", 0, lo=0)
        self.saturate = self.attr_bool("saturate", 1)
        out_dtype = self.attr_int("output_dtype", 0, lo=0)
        self.out_dtype = _onnx_dtype(out_dtype) if out_dtype else None

    def _per_tensor(self, y_scale, y_zero_point) -> tuple | None:
        """(float32 scale, Saturate) for a per-tensor integer quantization, else None."""
        dtype = self._dtype(y_zero_point)
        if y_scale.size != 1 or (y_zero_point is not None and y_zero_point.size != 1) or not _is_integer(dtype):
            return None
        return y_scale.astype(F32).reshape(()), Saturate(y_zero_point, dtype)

    def _dtype(self, y_zero_point) -> np.dtype:
        return (y_zero_point.dtype if y_zero_point is not None else self.out_dtype) or np.dtype(np.uint8)

    def _run(self, x, y_scale, y_zero_point=None):
        fast = self.derived((1, 2), (y_scale, y_zero_point), self._per_tensor) if x.dtype == F32 else None
        if fast is not None and y_scale.dtype == F32:
            y = fast[1].scaled(x, fast[0], _DIVIDE)
            return (fast[1](np.divide(x, fast[0])) if y is None else y,)
        dtype = self._dtype(y_zero_point)
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
class DequantizeLinear(BoundParams, OpKernel):
    """y = (x - x_zero_point) * x_scale, in the scale's type; per tensor, per axis or blocked."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 1)
        self.block_size = self.attr_int("block_size", 0, lo=0)

    @staticmethod
    def _per_tensor(x_scale, x_zero_point) -> tuple | None:
        """(float32 zero point, float32 scale) of a per-tensor float32 dequantization, else None."""
        if x_scale.size != 1 or x_scale.dtype != F32 or (x_zero_point is not None and x_zero_point.size != 1):
            return None
        zp = np.float32(0) if x_zero_point is None else x_zero_point.astype(F32).reshape(())
        return zp, x_scale.reshape(())

    def _run(self, x, x_scale, x_zero_point=None):
        fast = self.derived((1, 2), (x_scale, x_zero_point), self._per_tensor) if x.dtype.kind in "iu" else None
        if fast is not None:
            y = minus(x, fast[0], F32)  # exact: 8/16-bit integers in float32
            return (np.multiply(y, fast[1], out=y),)
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
        lo = min(float(np.minimum.reduce(x, axis=None)), 0.0) if x.size else 0.0
        hi = max(float(np.maximum.reduce(x, axis=None)), 0.0) if x.size else 0.0
        scale, zp = dynamic_params(lo, hi)
        y = _TO_UINT8(np.divide(x, scale), zp)
        return (y, np.array(scale, dtype=F32), np.array(zp, dtype=np.uint8))


def dynamic_params(lo: float, hi: float) -> tuple[np.float32, np.float32]:
    """The float32 scale (hi - lo) / 255 and zero point clip(rint(0 - lo / scale), 0, 255) that onnxruntime
    computes in float32. In Python floats: they hold the float32 inputs exactly, and one double operation
    rounded to float32 is the float32 operation (53 >= 2 * 24 + 2 bits), at a tenth of the cost of
    NumPy scalar arithmetic."""
    f32 = np.float32
    if not math.isfinite(hi - lo):  # NaN or inf in x: NumPy's float32 arithmetic, whatever it gives
        scale = f32((f32(hi) - f32(lo)) / f32(255))
        zp = np.clip(np.rint(f32(0) - f32(lo) / (scale or f32(1))), 0, 255)
        return (scale or f32(1)), f32(zp)
    scale = f32(float(f32(hi - lo)) / 255.0)
    if scale == 0:
        return f32(1), f32(0)  # an all-zero tensor: any scale maps it to the zero point
    return scale, f32(min(max(round(-float(f32(lo / float(scale)))), 0), 255))


_TO_UINT8 = Saturate(None, np.dtype(np.uint8))


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


def minus(x: np.ndarray, zero_point, dtype: np.dtype) -> np.ndarray:
    """x - zero_point as a new `dtype` array: a cast, then the subtraction in place (a ufunc that casts
    on the fly costs about twice as much on small tensors). `zero_point` must not broadcast x larger."""
    out = x.astype(dtype)
    if zero_point is not None:
        np.subtract(out, zero_point, out=out)
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


class Requantize:
    """requantize() with its multiplier and Saturate made once: scales the accumulator in place."""

    __slots__ = ("multiplier", "saturate")

    def __init__(self, multiplier, zero_point, dtype: np.dtype):
        mult = np.asarray(multiplier, dtype=F32)
        self.multiplier = mult.reshape(()) if mult.size == 1 else mult
        self.saturate = Saturate(zero_point, dtype)

    def __call__(self, acc: np.ndarray) -> np.ndarray:
        """`acc` (a float accumulator the caller owns) requantized."""
        values = acc if acc.dtype == F32 else acc.astype(F32)
        if self.multiplier.ndim == 0:
            out = self.saturate.scaled(values, self.multiplier, _MULTIPLY)
            if out is not None:
                return out
        if self.multiplier.ndim == 0 or values.ndim >= self.multiplier.ndim:
            np.multiply(values, self.multiplier, out=values)
        else:
            values = values * self.multiplier
        return self.saturate(values)


def output_multiplier(a_scale, b_scale, y_scale) -> np.ndarray:
    """a_scale * b_scale / y_scale in float32, as onnxruntime computes it."""
    return (np.asarray(a_scale, F32) * np.asarray(b_scale, F32) / np.asarray(y_scale, F32)).astype(F32)


class CenteredB:
    """The B operand of an integer GEMM minus its zero point, in the float type in which the product
    is exact (exact_float); built once per constant B (BoundParams)."""

    __slots__ = ("a_dtype", "ct", "values")

    def __init__(self, b, b_zero_point, a_dtype: np.dtype):
        self.a_dtype = np.dtype(a_dtype)
        k = b.shape[-2] if b.ndim > 1 else b.shape[0]
        self.ct = exact_float(k, self.a_dtype, b.dtype)
        self.values = centered(b, matrix_zero_point(b_zero_point, -1, b), self.ct)

    def times(self, a, a_zero_point) -> np.ndarray:
        """(a - a_zero_point) @ B, exact."""
        zp = matrix_zero_point(a_zero_point, -2, a)
        ac = minus(a, zp, self.ct)
        return np.matmul(ac, self.values)


class IntGemm(BoundParams, OpKernel):
    """Integer GEMMs: B centered once per constant B (input positions b_pos, b_zp_pos)."""

    b_pos, b_zp_pos = 1, 3

    def int_product(self, a, b, a_zp, b_zp) -> np.ndarray:
        side = self.derived((self.b_pos, self.b_zp_pos), (b, b_zp), lambda b_, z: CenteredB(b_, z, a.dtype))
        if side.a_dtype != a.dtype:
            return int_matmul(a, b, a_zp, b_zp)
        return side.times(a, a_zp)


@register("MatMulInteger", since=10)
class MatMulInteger(IntGemm):
    def _run(self, a, b, a_zero_point=None, b_zero_point=None):
        return (self.int_product(a, b, a_zero_point, b_zero_point).astype(np.int32),)


@register("QLinearMatMul", since=10)
class QLinearMatMul(IntGemm):
    b_pos, b_zp_pos = 3, 5

    @staticmethod
    def _output(a_scale, b_scale, y_scale, y_zp) -> Requantize:
        b_scale = np.asarray(b_scale)
        mult = output_multiplier(a_scale, b_scale.reshape(1, -1) if b_scale.size > 1 else b_scale, y_scale)
        return Requantize(mult, y_zp, np.asarray(y_zp).dtype)

    def _run(self, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
        y = self._compiled(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp)
        if y is not None:
            return (y,)
        acc = self.int_product(a, b, a_zp, b_zp)
        return (self.derived((1, 4, 6, 7), (a_scale, b_scale, y_scale, y_zp), self._output)(acc),)

    def _compiled(self, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> np.ndarray | None:
        """The whole op as one compiled call (ep_qlinear_matmul: the exact integer product and the NumPy path's
        requantization) for a small product of a contiguous 8-bit A with a per-tensor zero point and a 2-D
        8-bit B; None where it does not serve."""
        lib = native.LIB
        kind = _NATIVE_KINDS.get(a.dtype)
        if lib is None or kind is None or kind > 1 or not a.ndim or not a.flags.c_contiguous or b.ndim != 2:
            return None
        k, n = b.shape
        m = a.size // k if k else 0
        if a.shape[-1] != k or not m or m * k * n > COMPILED_MAX_MACS:
            return None
        out = self.derived((3, 5, 1, 2, 4, 6, 7), (b, b_zp, a_scale, a_zp, b_scale, y_scale, y_zp), compiled_requant)
        if out is None:
            return None
        centered, a_zp_value, mult, y_zp_value, sat = out
        y = np.empty((*a.shape[:-1], n), sat.dtype)
        if lib.ep_qlinear_matmul(native.ptr(a), kind, m, k, a_zp_value, centered, n, mult,
                                 y_zp_value, sat.lo, sat.hi, sat.kind, native.ptr(y)):
            return None
        return y


# Products (M * K * N) up to which the small integer GEMMs (QLinearMatMul here, DynamicQuantizeMatMul in
# ops_quant_ms.py) are one compiled call: its loops are plain, and a larger product is faster through the
# NumPy path's exact float GEMM (BLAS).
COMPILED_MAX_MACS = 1 << 18


def centered_int16(b: np.ndarray, zero_point) -> np.ndarray | None:
    """A 2-D 8-bit B minus its per-tensor or per-column zero point, as contiguous int16 (exact), or None."""
    n = b.shape[1]
    if b.dtype not in (np.int8, np.uint8):
        return None
    zp = np.zeros(1, np.int16) if zero_point is None else np.asarray(zero_point)
    if zp.size not in (1, n):
        return None
    return np.ascontiguousarray(b.astype(np.int16) - zp.reshape(1, -1).astype(np.int16))


def columns(v, n: int) -> np.ndarray:
    """A per-tensor (one value) or per-column (n values) parameter as n contiguous float32 values."""
    return np.ascontiguousarray(np.broadcast_to(np.asarray(v, F32).reshape(-1), (n,)))


def compiled_requant(b, b_zp, a_scale, a_zp, b_scale, y_scale, y_zp):
    """(centered B, A's zero point as an int, the N float32 multipliers, the output zero point as a float, the
    output's Saturate) for ep_qlinear_matmul, B and the multipliers as C pointers; None where A's zero point
    is not per tensor or the parameters are neither per tensor nor per column."""
    n = b.shape[1]
    centered = centered_int16(b, b_zp)
    b_scale = np.asarray(b_scale)
    if centered is None or b_scale.size not in (1, n) or np.size(y_zp) != 1 or np.size(a_zp) > 1:
        return None
    sat = Saturate(y_zp, np.asarray(y_zp).dtype)
    if sat.kind is None or sat.kind > 1:
        return None
    a_zp_value = 0 if a_zp is None else int(np.asarray(a_zp).reshape(()))
    y_zp_value = 0.0 if sat.zero_point is None else float(sat.zero_point)
    mult = output_multiplier(a_scale, b_scale.reshape(-1), y_scale)
    return native.ptr(centered), a_zp_value, native.ptr(columns(mult, n)), y_zp_value, sat  # pointers keep their arrays


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


class _IntConv(BoundParams, OpKernel):
    """An exact integer convolution: the float Conv kernel on operands minus their zero points (zero
    padding of centered values is padding with the zero point), in float32 where exact_float allows.
    Constant weights are centered once and bound to the inner Conv, which then takes its prepared path."""

    weight_position = 1

    def __init__(self, node):
        super().__init__(node)
        self.conv = Conv(node)

    def bind_constants(self, constants):
        super().bind_constants(constants)
        pos = self.weight_position
        inputs = self.node.inputs
        has_zp = len(inputs) > pos + 2 and bool(inputs[pos + 2])
        if constants.get(pos) is not None and (not has_zp or pos + 2 in constants):
            _, wc = self.derived((pos, pos + 2), (constants[pos], constants.get(pos + 2)), _centered_weights)
            self.conv.bind_constants({1: wc})  # the Conv's own per-shape preparation of these weights

    def accumulate(self, x, x_zp, w, w_zp) -> np.ndarray:
        pos = self.weight_position
        ct, wc = self.derived((pos, pos + 2), (w, w_zp), _centered_weights)
        xc = minus(x, None if x_zp is None else np.asarray(x_zp).reshape(()), ct)
        return self.conv._run(xc, wc)[0]


def _centered_weights(w, w_zp) -> tuple:
    """(float type, w - w_zp in it) for an 8-bit input (int8 and uint8 have the same span)."""
    ct = exact_float(math.prod(w.shape[1:]), np.dtype(np.uint8), w.dtype)  # a window's reduction length
    return ct, _weights_centered(w, w_zp, ct)


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
        channel_bias, requant = self.output_params(x_scale, w_scale, y_scale, y_zp, bias, acc.ndim)
        if channel_bias is not None:
            channel_bias.add_to(acc)
        return (requant(acc),)

    def output_params(self, x_scale, w_scale, y_scale, y_zp, bias, ndim: int) -> tuple:
        """(the ChannelBias or None, the Requantize), made once per bound parameters (a quantized chain,
        quant_chain.py, reads the same)."""
        return self.derived((1, 4, 6, 7, 8), (x_scale, w_scale, y_scale, y_zp, bias),
                            lambda xs, ws, ys, yz, b: self._requantizer(xs, ws, ys, yz, b, ndim))

    @staticmethod
    def _requantizer(x_scale, w_scale, y_scale, y_zp, bias, ndim: int) -> tuple:
        mult = output_multiplier(x_scale, _channel(w_scale, ndim), y_scale)
        return (None if bias is None else ChannelBias(bias, ndim)), Requantize(mult, y_zp, np.asarray(y_zp).dtype)


class ChannelBias:
    """QLinearConv's int32 bias, added to the exact accumulator so that the sum is rounded once to float32 (MLAS's
    int32 sum). An IEEE add rounds the exact sum of its operands once, so a float32 accumulator (exact integers)
    takes the bias in float32 wherever every bias value is a float32 too; otherwise the add is in float64 (NumPy's
    mixed-type add: 41 against 9 us over the 64x64 CNN's first layer)."""

    __slots__ = ("wide", "narrow")

    def __init__(self, bias, ndim: int):
        values = np.asarray(bias)
        self.wide = _channel(values.astype(F64), ndim)
        narrow = values.astype(F32)
        exact = np.array_equal(narrow.astype(F64), values.astype(F64))
        self.narrow = _channel(narrow, ndim) if exact else None

    def add_to(self, acc: np.ndarray) -> None:
        """acc += bias in place."""
        if acc.dtype == F32 and self.narrow is not None:
            acc += self.narrow
        else:
            acc += self.wide
