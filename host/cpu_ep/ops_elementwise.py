"""Elementwise ops: arithmetic, activations, comparisons, logic, Where, Cast, Clip.

Results keep the input dtype: numpy (NEP 50) keeps float32 with python scalars, and
where a temporary is promoted (float64, int64) we cast back explicitly.
"""

from __future__ import annotations

import math
from functools import cache, reduce

import numpy as np
import onnx
from onnx import numpy_helper

from abi.gelu import GELU_TANH_COEFF, SQRT_2_OVER_PI
from host.cpu_ep import native
from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register


@cache
def _scipy_special():
    """scipy.special (its erf and expit are fast ufuncs numpy lacks), or None. Imported on first
    use: importing it takes 0.2-0.5 s, which every session and CLI command used to pay."""
    try:
        import scipy.special
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return scipy.special


_math_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """erf(x) in x's dtype (float inputs)."""
    special = _scipy_special()
    if special is not None:
        return np.asarray(special.erf(x)).astype(x.dtype, copy=False)
    return erf_fallback(x)


def erf_fallback(x: np.ndarray) -> np.ndarray:
    """erf through math.erf, one python call per element: exact, slower than scipy."""
    return np.asarray(_math_erf(x), dtype=np.float64).astype(x.dtype, copy=False)


# -- unary ------------------------------------------------------------------------------


class Unary(OpKernel):
    """y = fn(x), cast back to x's dtype when `keep_dtype`."""

    fn = None
    keep_dtype = True

    def _run(self, x):
        y = self.fn(x)
        return (y.astype(x.dtype, copy=False) if self.keep_dtype else y,)


_WIDE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def native_act(x: np.ndarray, step: int, alpha: float = 0.0, beta: float = 0.0) -> np.ndarray | None:
    """One compiled epilogue step over a float32 C-contiguous x into a new array, or None (library off,
    another dtype or layout, empty)."""
    lib = native.LIB
    if lib is None or x.dtype != native.F32 or not x.flags.c_contiguous or not x.size:
        return None
    y = np.empty(x.shape, dtype=native.F32)
    lib.ep_bias_act(native.ptr(x), native.NULL, native.ptr(y), 1, x.size, step, native.NULL, alpha, beta)
    return y


def sigmoid_inplace(y: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-y)) in place on a float32/float64 array: four SIMD ufuncs, twice as fast as scipy's
    expit on small tensors, within 2 ulp of it. exp(-y) overflowing to inf gives 0, the limit."""
    np.negative(y, out=y)
    np.exp(y, out=y)
    y += 1
    return np.reciprocal(y, out=y)


def _sigmoid(x):
    y = native_act(x, native.SIGMOID)
    if y is not None:
        return y
    if x.dtype in _WIDE_FLOATS:
        return sigmoid_inplace(x.copy())
    special = _scipy_special() if x.dtype.kind == "f" else None
    if special is not None:
        return special.expit(x)  # one ufunc, overflow-free
    # exp(-|x|) never overflows; both branches share it.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


@register("Neg")
class Neg(Unary):
    fn = staticmethod(np.negative)


@register("Abs")
class Abs(Unary):
    fn = staticmethod(np.abs)


@register("Sqrt")
class Sqrt(Unary):
    fn = staticmethod(np.sqrt)


@register("Exp")
class Exp(Unary):
    fn = staticmethod(np.exp)


@register("Log")
class Log(Unary):
    fn = staticmethod(np.log)


@register("Reciprocal")
class Reciprocal(Unary):
    fn = staticmethod(np.reciprocal)


@register("Floor")
class Floor(Unary):
    fn = staticmethod(np.floor)


@register("Ceil")
class Ceil(Unary):
    fn = staticmethod(np.ceil)


@register("Tanh")
class Tanh(Unary):
    fn = staticmethod(np.tanh)


@register("Sin", since=7)
class Sin(Unary):
    fn = staticmethod(np.sin)


@register("Cos", since=7)
class Cos(Unary):
    fn = staticmethod(np.cos)


@register("Sigmoid")
class Sigmoid(Unary):
    fn = staticmethod(_sigmoid)


@register("Relu")
class Relu(Unary):
    fn = staticmethod(lambda x: np.maximum(x, 0))


@register("Erf", since=9)
class Erf(Unary):
    fn = staticmethod(erf)


@register("Sign", since=9)
class Sign(Unary):
    fn = staticmethod(np.sign)


@register("IsNaN", since=9)
class IsNaN(Unary):
    fn = staticmethod(np.isnan)
    keep_dtype = False


@register("Not")
class Not(Unary):
    fn = staticmethod(np.logical_not)
    keep_dtype = False


@register("Softplus")
class Softplus(Unary):
    """log(1 + exp(x)), computed without overflow."""

    fn = staticmethod(lambda x: np.logaddexp(x, 0))


@register("Mish", since=18)
class Mish(Unary):
    """x * tanh(softplus(x))."""

    fn = staticmethod(lambda x: x * np.tanh(np.logaddexp(x, 0)))


@register("IsInf", since=10)
class IsInf(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.negative = self.attr_bool("detect_negative", 1)
        self.positive = self.attr_bool("detect_positive", 1)

    def _run(self, x):
        if self.negative and self.positive:
            return (np.isinf(x),)
        if self.negative:
            return (np.isneginf(x),)
        if self.positive:
            return (np.isposinf(x),)
        return (np.zeros(x.shape, dtype=bool),)


# -- unary with attributes --------------------------------------------------------------


@register("LeakyRelu", since=6)
class LeakyRelu(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 0.01)

    def _run(self, x):
        return (np.where(x < 0, x * self.alpha, x).astype(x.dtype, copy=False),)


@register("Elu", since=6)
class Elu(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 1.0)

    def _run(self, x):
        return (np.where(x < 0, self.alpha * np.expm1(x), x).astype(x.dtype, copy=False),)


@register("Selu", since=6)
class Selu(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 1.67326319217681884765625)
        self.gamma = self.attr_float("gamma", 1.05070102214813232421875)

    def _run(self, x):
        y = self.gamma * np.where(x <= 0, self.alpha * np.expm1(x), x)
        return (y.astype(x.dtype, copy=False),)


@register("HardSigmoid", since=6)
class HardSigmoid(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 0.2)
        self.beta = self.attr_float("beta", 0.5)

    def _run(self, x):
        y = native_act(x, native.HARD_SIGMOID, self.alpha, self.beta)
        if y is not None:
            return (y,)
        y = x * self.alpha
        y += self.beta
        np.maximum(y, 0, out=y)
        np.minimum(y, 1, out=y)
        return (y.astype(x.dtype, copy=False),)


@register("HardSwish", since=14)
class HardSwish(OpKernel):
    """x * HardSigmoid(x) with alpha 1/6, beta 0.5."""

    def _run(self, x):
        y = native_act(x, native.HARD_SWISH)
        if y is not None:
            return (y,)
        gate = x * x.dtype.type(1 / 6) if x.dtype.kind == "f" else x * (1 / 6)
        gate += 0.5
        np.maximum(gate, 0, out=gate)
        np.minimum(gate, 1, out=gate)
        gate *= x
        return (gate.astype(x.dtype, copy=False),)


@register("Gelu", since=20)
class Gelu(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.tanh = self.attr_str("approximate", "none", choices=("none", "tanh")) == "tanh"

    def _run(self, x):
        y = native_act(x, native.GELU_TANH if self.tanh else native.GELU)
        return (gelu(x, self.tanh) if y is None else y,)


def gelu(x: np.ndarray, tanh: bool) -> np.ndarray:
    """GELU of a float tensor in its dtype: 0.5 x (1 + erf(x / sqrt 2)), or the tanh approximation
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). One temporary, updated in place."""
    if tanh and x.dtype in _WIDE_FLOATS:
        # 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)): seven ufuncs instead of nine, and no cancellation
        # in 1 + tanh(u) for negative x; exp(-2u) overflowing to inf gives -0, the limit.
        t = x * x
        t *= -2 * SQRT_2_OVER_PI * GELU_TANH_COEFF
        t += -2 * SQRT_2_OVER_PI
        t *= x
        np.exp(t, out=t)
        t += 1
        return np.divide(x, t, out=t)
    if tanh:
        t = x * x
        t *= GELU_TANH_COEFF
        t += 1
        t *= x
        t *= SQRT_2_OVER_PI
        np.tanh(t, out=t)
    else:
        t = erf(x * (1 / math.sqrt(2)))
    t += 1
    t *= x
    t *= 0.5
    return t.astype(x.dtype, copy=False)


@register("PRelu", since=7)
class PRelu(OpKernel):
    """slope broadcasts onto x (unidirectional)."""

    def _run(self, x, slope):
        y = np.where(x < 0, x * slope, x)
        if y.shape != x.shape:
            raise ValueError(f"slope of shape {slope.shape} does not broadcast to x of shape {x.shape}")
        return (y.astype(x.dtype, copy=False),)


@register("Clip", since=6)
class Clip(OpKernel):
    """min/max are attributes before opset 11 and optional inputs since."""

    def __init__(self, node):
        super().__init__(node)
        big = float(np.finfo(np.float32).max)
        self.lo_attr = self.attr_float("min", -big) if self.opset < 11 else None
        self.hi_attr = self.attr_float("max", big) if self.opset < 11 else None

    def _run(self, x, lo=None, hi=None):
        lo = self.lo_attr if lo is None else lo
        hi = self.hi_attr if hi is None else hi
        y = x
        # max then min: when min > max every value becomes max, as ONNX says.
        if lo is not None:
            y = np.maximum(y, lo)
        if hi is not None:
            y = np.minimum(y, hi)
        return (np.asarray(y).astype(x.dtype, copy=False),)


# -- binary -----------------------------------------------------------------------------


class Binary(OpKernel):
    """y = fn(a, b) with multidirectional broadcasting; both inputs share one dtype."""

    fn = None

    def _run(self, a, b):
        return (self.fn(a, b),)


@register("Add", since=7)
class Add(Binary):
    fn = staticmethod(np.add)


@register("Sub", since=7)
class Sub(Binary):
    fn = staticmethod(np.subtract)


@register("Mul", since=7)
class Mul(Binary):
    fn = staticmethod(np.multiply)


@register("Div", since=7)
class Div(OpKernel):
    """Integer division truncates toward zero like C (numpy's // floors)."""

    def _run(self, a, b):
        if a.dtype.kind == "i":
            # a - fmod(a, b) is an exact multiple of b, so // is exact there.
            return (((a - np.fmod(a, b)) // b).astype(a.dtype, copy=False),)
        if a.dtype.kind == "u":
            return (a // b,)
        return (np.divide(a, b).astype(a.dtype, copy=False),)


@register("Mod", since=10)
class Mod(OpKernel):
    """fmod=0: the result takes the divisor's sign (Python's %); fmod=1: the dividend's (C fmod).
    Floats require fmod=1 before opset 28, which defines fmod=0 for them too."""

    def __init__(self, node):
        super().__init__(node)
        self.fmod = self.attr_bool("fmod", 0)

    def _run(self, a, b):
        if a.dtype.kind == "f" and not self.fmod and self.opset < 28:
            raise ValueError(f"Mod-{self.opset} of floating-point tensors requires fmod=1 (fmod=0 on floats: opset 28)")
        y = np.fmod(a, b) if self.fmod else np.mod(a, b)
        return (y.astype(a.dtype, copy=False),)


@register("Pow", since=7)
class Pow(OpKernel):
    """The result has the base's dtype whatever the exponent's dtype."""

    def _run(self, a, b):
        if b.size == 1 and a.dtype.kind == "f" and b.ndim <= a.ndim:
            # Exporters write x^2, x^3 and x^0.5 (GELU-tanh, norms): products and sqrt are exact where
            # pow is exact and many times faster than a float pow per element.
            e = float(b.reshape(-1)[0])
            if e == 2.0:
                return (a * a,)
            if e == 3.0:
                return (a * a * a,)
            if e == 0.5:
                return (np.sqrt(a),)
            if e == 1.0:
                return (a.copy(),)
        if a.dtype.kind in "iu" and b.dtype.kind in "iu" and np.any(b < 0):
            # numpy refuses negative integer powers of integers; C casts pow(double) back.
            y = np.power(a.astype(np.float64), b)
        else:
            y = np.power(a, b)
        return (y.astype(a.dtype, copy=False),)


@register("Equal", since=7)
class Equal(OpKernel):
    def _run(self, a, b):
        return (np.asarray(np.equal(a, b), dtype=bool),)


@register("Less", since=7)
class Less(Binary):
    fn = staticmethod(np.less)


@register("Greater", since=7)
class Greater(Binary):
    fn = staticmethod(np.greater)


@register("LessOrEqual", since=12)
class LessOrEqual(Binary):
    fn = staticmethod(np.less_equal)


@register("GreaterOrEqual", since=12)
class GreaterOrEqual(Binary):
    fn = staticmethod(np.greater_equal)


@register("And", since=7)
class And(Binary):
    fn = staticmethod(np.logical_and)


@register("Or", since=7)
class Or(Binary):
    fn = staticmethod(np.logical_or)


@register("Xor", since=7)
class Xor(Binary):
    fn = staticmethod(np.logical_xor)


# -- variadic ---------------------------------------------------------------------------


class Variadic(OpKernel):
    """Folds `fn` over any number of broadcast inputs."""

    fn = None

    def _run(self, *xs):
        if not xs:
            raise ValueError("expects at least one input")
        return (reduce(self.fn, xs).astype(xs[0].dtype, copy=False),)


@register("Max", since=6)
class Max(Variadic):
    fn = staticmethod(np.maximum)


@register("Min", since=6)
class Min(Variadic):
    fn = staticmethod(np.minimum)


@register("Sum", since=6)
class Sum(Variadic):
    fn = staticmethod(np.add)


@register("Mean", since=6)
class Mean(Variadic):
    fn = staticmethod(np.add)

    def _run(self, *xs):
        (total,) = super()._run(*xs)
        return ((total / len(xs)).astype(xs[0].dtype, copy=False),)


# -- selection and types ----------------------------------------------------------------


@register("Where", since=9)
class Where(OpKernel):
    def _run(self, cond, x, y):
        if x.dtype == y.dtype and cond.size < x.size and x.size >= 4096:
            # A mask broadcast over a larger operand (a causal mask over attention scores): two copies
            # (fill, then copy where true) cost half of np.where's broadcasting loop.
            out = np.empty(np.broadcast_shapes(cond.shape, x.shape, y.shape), dtype=x.dtype)
            np.copyto(out, y)
            np.copyto(out, x, where=cond)
            return (out,)
        return (np.where(cond, x, y),)


_FLOAT8 = {
    onnx.TensorProto.FLOAT8E4M3FN,
    onnx.TensorProto.FLOAT8E4M3FNUZ,
    onnx.TensorProto.FLOAT8E5M2,
    onnx.TensorProto.FLOAT8E5M2FNUZ,
}


_E8M0 = getattr(onnx.TensorProto, "FLOAT8E8M0", None)  # opset 24


def _cast(x: np.ndarray, to: int, dtype: np.dtype, saturate: bool, round_mode: str = "up") -> np.ndarray:
    if to == onnx.TensorProto.STRING:
        from host.cpu_ep.ops_string import to_strings  # the number formats live with the string ops

        return to_strings(x)
    if x.dtype == object:
        # Strings parse through python (float("INF"), int("3")...).
        return x.astype(np.float64 if dtype.kind == "f" or dtype.kind == "V" else dtype).astype(dtype)
    if to in _FLOAT8 and saturate:
        return numpy_helper.saturate_cast(x, dtype)
    if to == _E8M0 and _E8M0 is not None:
        return numpy_helper.to_float8e8m0(x, saturate, round_mode).astype(dtype)
    return x.astype(dtype)


class _CastBase(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.saturate = self.attr_bool("saturate", 1)
        self.round_mode = self.attr_str("round_mode", "up", choices=("up", "down", "nearest"))


@register("Cast", since=6)
class Cast(_CastBase):
    def __init__(self, node):
        super().__init__(node)
        self.to = self.attr_int("to")
        if self.to == onnx.TensorProto.STRING:
            self.dtype = np.dtype(object)
        else:
            try:
                self.dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.to))
            except (KeyError, ValueError, TypeError) as exc:
                raise self.bad_attr("to", self.to, "an onnx.TensorProto data type") from exc

    def _run(self, x):
        return (_cast(x, self.to, self.dtype, self.saturate, self.round_mode),)


@register("CastLike", since=15)
class CastLike(_CastBase):
    def _run(self, x, like):
        if like.dtype == object:
            return (_cast(x, onnx.TensorProto.STRING, like.dtype, self.saturate, self.round_mode),)
        to = onnx.helper.np_dtype_to_tensor_dtype(like.dtype)
        return (_cast(x, to, like.dtype, self.saturate, self.round_mode),)
