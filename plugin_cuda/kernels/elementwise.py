"""Elementwise ONNX ops: arithmetic, comparisons, logic, activations, Where, Cast, Clip, Max/Min/Sum.

CuPy ufuncs write straight into the output (`out=`) and broadcast; the few ops without a ufunc
are ElementwiseKernels, built on first use and compiled by CuPy once per device and dtype.
float16 and bfloat16 math runs in float32 registers and is stored back in the half type (CuPy 14
takes ml_dtypes' bfloat16 as `__nv_bfloat16`).
"""

from __future__ import annotations

import numpy as np

from ..device.nvrtc import elementwise_table
from ..semantics import GELU_CUDA
from ..semantics.shapes import broadcast_shape
from .base import ALL, BOOL, FLOAT, INDEX, NUMERIC, ONNX_DTYPES, CudaKernel, numpy_dtype, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

# Kernel sources (in_params, out_params, body) are plain data so that they can be read, and
# syntax-checked, as text.
SOURCES = {
    "sigmoid": ("T x", "T y", "y = T(1.0f / (1.0f + expf(-float(x))));"),
    "erf": ("T x", "T y", "y = T(erff(float(x)));"),
    "gelu": ("T x", "T y", "y = T(ep_gelu(float(x)));"),  # ep_gelu*: GELU_CUDA, the preamble
    "gelu_tanh": ("T x", "T y", "y = T(ep_gelu_tanh(float(x)));"),
    "leaky_relu": ("T x, float32 alpha", "T y", "float v = float(x); y = T(v >= 0.0f ? v : v * alpha);"),
    "where": ("bool c, T a, T b", "T y", "y = c ? a : b;"),
    "is_nan": ("T x", "bool y", "y = isnan(float(x));"),
    "is_inf": (
        "T x, int32 neg, int32 pos", "bool y",
        "float v = float(x); y = isinf(v) && ((v > 0.0f && pos) || (v < 0.0f && neg));",
    ),
    "softplus": ("T x", "T y", "float v = float(x); y = T(v > 20.0f ? v : log1pf(expf(v)));"),
    "mish": (
        "T x", "T y",
        "float v = float(x); float sp = v > 20.0f ? v : log1pf(expf(v)); y = T(v * tanhf(sp));",
    ),
    "hard_sigmoid": (
        "T x, float32 alpha, float32 beta", "T y",
        "y = T(fminf(1.0f, fmaxf(0.0f, alpha * float(x) + beta)));",
    ),
    "hard_swish": (
        "T x", "T y",
        "float v = float(x); y = T(v * fminf(1.0f, fmaxf(0.0f, v * (1.0f / 6.0f) + 0.5f)));",
    ),
    # ONNX integer Div truncates toward zero, as C does (numpy's floor_divide rounds down).
    "div_int": ("T a, T b", "T y", "y = b == 0 ? T(0) : T(a / b);"),
    "sign": ("T x", "T y", "y = x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));"),
}


elementwise = elementwise_table(SOURCES, preamble=GELU_CUDA)


def _ufunc(name: str):
    # Resolved at construction so that compute pays no lookup; None where CuPy is absent (then no
    # session can be created on this plugin anyway, but claimable() still works).
    return getattr(cupy, name) if cupy is not None else None


class _Unary(CudaKernel):
    ufunc = ""

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self._fn = _ufunc(self.ufunc)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        self._fn(x, out=ctx.output(0, x.shape, x.dtype))


@register("Neg", 6)
class Neg(_Unary):
    input_types = (NUMERIC,)
    ufunc = "negative"


@register("Abs", 6)
class Abs(_Unary):
    input_types = (NUMERIC,)
    ufunc = "absolute"


@register("Cos", 7)
class Cos(_Unary):
    ufunc = "cos"


@register("Sin", 7)
class Sin(_Unary):
    ufunc = "sin"


@register("Floor", 6)
class Floor(_Unary):
    ufunc = "floor"


@register("Ceil", 6)
class Ceil(_Unary):
    ufunc = "ceil"


@register("Round", 11)
class Round(_Unary):
    ufunc = "rint"  # ONNX Round rounds half to even, as rint does


@register("Sqrt", 6)
class Sqrt(_Unary):
    ufunc = "sqrt"


@register("Exp", 6)
class Exp(_Unary):
    ufunc = "exp"


@register("Log", 6)
class Log(_Unary):
    ufunc = "log"


@register("Reciprocal", 6)
class Reciprocal(_Unary):
    ufunc = "reciprocal"


@register("Tanh", 6)
class Tanh(_Unary):
    ufunc = "tanh"


@register("Not", 1)
class Not(_Unary):
    input_types = (BOOL,)
    ufunc = "logical_not"


@register("Relu", 6)
class Relu(CudaKernel):
    input_types = (NUMERIC,)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        cupy.maximum(x, x.dtype.type(0), out=ctx.output(0, x.shape, x.dtype))


class _Custom(CudaKernel):
    """Unary op through one of this module's ElementwiseKernels."""

    kernel = ""

    def _compute(self, ctx):
        x = ctx.inputs[0]
        elementwise(self.kernel)(x, ctx.output(0, x.shape, x.dtype))


@register("Sigmoid", 6)
class Sigmoid(_Custom):
    kernel = "sigmoid"


@register("Erf", 9)
class Erf(_Custom):
    kernel = "erf"


@register("Softplus", 1)
class Softplus(_Custom):
    kernel = "softplus"


@register("Mish", 18)
class Mish(_Custom):
    kernel = "mish"


@register("HardSwish", 14)
class HardSwish(_Custom):
    kernel = "hard_swish"


@register("Sign", 9)
class Sign(_Custom):
    input_types = (NUMERIC,)
    kernel = "sign"


@register("HardSigmoid", 6)
class HardSigmoid(CudaKernel):
    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.alpha = self.attr_float("alpha", 0.2)
        self.beta = self.attr_float("beta", 0.5)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        elementwise("hard_sigmoid")(x, self.alpha, self.beta, ctx.output(0, x.shape, x.dtype))


_BOOL_DTYPE = np.dtype(np.bool_)


@register("IsNaN", 9)
class IsNaN(CudaKernel):
    def _compute(self, ctx):
        x = ctx.inputs[0]
        elementwise("is_nan")(x, ctx.output(0, x.shape, _BOOL_DTYPE))


@register("IsInf", 10)
class IsInf(CudaKernel):
    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.neg = self.attr_int("detect_negative", 1, (0, 1))
        self.pos = self.attr_int("detect_positive", 1, (0, 1))

    def _compute(self, ctx):
        x = ctx.inputs[0]
        elementwise("is_inf")(x, self.neg, self.pos, ctx.output(0, x.shape, _BOOL_DTYPE))


@register("Gelu", 20)
class Gelu(_Custom):
    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        approximate = self.attr_str("approximate", "none", ("none", "tanh"))
        self.kernel = "gelu_tanh" if approximate == "tanh" else "gelu"


@register("LeakyRelu", 6)
class LeakyRelu(CudaKernel):
    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.alpha = self.attr_float("alpha", 0.01)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        elementwise("leaky_relu")(x, self.alpha, ctx.output(0, x.shape, x.dtype))


class _Binary(CudaKernel):
    input_types = (FLOAT, FLOAT)
    ufunc = ""
    out_dtype = None  # None: the dtype of input 0

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self._fn = _ufunc(self.ufunc)
        # Opset < 7 broadcasting was opt-in with axis; numpy-style broadcasting covers only axis-less.
        if self.opset < 7 and self.attrs.get("axis") is not None:
            raise self.bad_attr("axis", self.attrs["axis"], "absent (legacy axis broadcasting is unsupported)")

    def _compute(self, ctx):
        a, b = ctx.inputs
        dtype = self.out_dtype or a.dtype
        self._fn(a, b, out=ctx.output(0, broadcast_shape(a.shape, b.shape), dtype))


@register("Add", 1)
class Add(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "add"


@register("Sub", 1)
class Sub(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "subtract"


@register("Mul", 1)
class Mul(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "multiply"


@register("Div", 1)
class Div(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "divide"

    def _compute(self, ctx):
        a, b = ctx.inputs
        out = ctx.output(0, broadcast_shape(a.shape, b.shape), a.dtype)
        if a.dtype.kind in "iu":
            elementwise("div_int")(a, b, out)
        else:
            self._fn(a, b, out=out)


@register("Mod", 10)
class Mod(_Binary):
    """Mod with fmod=0 on integers (the sign of the divisor, as numpy's remainder); fmod=1 on floats."""

    input_types = (NUMERIC, NUMERIC)
    ufunc = "remainder"

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.fmod = self.attr_int("fmod", 0, (0, 1))
        self._fn = _ufunc("fmod" if self.fmod else "remainder")

    @classmethod
    def claims(cls, attrs, dtypes, opset):
        # fmod=0 on floats is refused by the spec; fmod=1 on integers is C's %, which remainder is not.
        if not super().claims(attrs, dtypes, opset):
            return False
        fmod = attrs.get("fmod", 0)
        return all(d is None or (d in FLOAT) == bool(fmod) for d in dtypes)


@register("Pow", 1)
class Pow(_Binary):
    input_types = (FLOAT, FLOAT | INDEX)
    same_type = ()
    ufunc = "power"

    def _compute(self, ctx):
        a, b = ctx.inputs
        if b.dtype.kind in "iu":
            # An integer exponent would promote the whole computation to float64.
            b = b.astype(a.dtype)
        self._fn(a, b, out=ctx.output(0, broadcast_shape(a.shape, b.shape), a.dtype))


@register("Equal", 1)
class Equal(_Binary):
    input_types = (ALL, ALL)
    ufunc = "equal"
    out_dtype = np.dtype(np.bool_)


@register("Less", 1)
class Less(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "less"
    out_dtype = np.dtype(np.bool_)


@register("Greater", 1)
class Greater(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "greater"
    out_dtype = np.dtype(np.bool_)


@register("LessOrEqual", 12)
class LessOrEqual(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "less_equal"
    out_dtype = np.dtype(np.bool_)


@register("GreaterOrEqual", 12)
class GreaterOrEqual(_Binary):
    input_types = (NUMERIC, NUMERIC)
    ufunc = "greater_equal"
    out_dtype = np.dtype(np.bool_)


@register("And", 7)
class And(_Binary):
    input_types = (BOOL, BOOL)
    ufunc = "logical_and"


@register("Or", 7)
class Or(_Binary):
    input_types = (BOOL, BOOL)
    ufunc = "logical_or"


@register("Xor", 7)
class Xor(_Binary):
    input_types = (BOOL, BOOL)
    ufunc = "logical_xor"


class _Variadic(CudaKernel):
    """Max / Min / Sum over any number of broadcasting inputs."""

    input_types = (NUMERIC,)
    variadic = True
    ufunc = ""

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self._fn = _ufunc(self.ufunc)

    def _compute(self, ctx):
        xs = ctx.inputs
        out = ctx.output(0, broadcast_shape(*(x.shape for x in xs)), xs[0].dtype)
        if len(xs) == 1:
            cupy.copyto(out, xs[0])
            return
        fn = self._fn
        fn(xs[0], xs[1], out=out)
        for x in xs[2:]:
            fn(out, x, out=out)


@register("Max", 6)
class Max(_Variadic):
    ufunc = "maximum"


@register("Min", 6)
class Min(_Variadic):
    ufunc = "minimum"


@register("Sum", 6)
class Sum(_Variadic):
    ufunc = "add"


@register("Where", 9)
class Where(CudaKernel):
    input_types = (BOOL, ALL, ALL)
    same_type = (1, 2)

    def _compute(self, ctx):
        c, a, b = ctx.inputs
        elementwise("where")(c, a, b, ctx.output(0, broadcast_shape(c.shape, a.shape, b.shape), a.dtype))


CAST_TYPES = FLOAT | INDEX | BOOL


@register("Cast", 6)
class Cast(CudaKernel):
    """Cast between float32/float16/bfloat16/int32/int64/bool (the plugin's claim() leaves casts of shape
    values, which are computed on the host, to the CPU)."""

    input_types = (CAST_TYPES,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        to = self.attr_int("to")
        name = ONNX_DTYPES.get(to) if to is not None else None
        if name not in CAST_TYPES:
            raise self.bad_attr("to", to, "1 (float), 10 (float16), 16 (bfloat16), 6 (int32), 7 (int64), 9 (bool)")
        self.to = numpy_dtype(name)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        # C casts truncate float -> int like numpy's astype; float -> bool is "non-zero".
        cupy.copyto(ctx.output(0, x.shape, self.to), x, casting="unsafe")


@register("Clip", 6)
class Clip(CudaKernel):
    """Clip: bounds are attributes before opset 11, optional scalar inputs from 11 on."""

    input_types = (FLOAT, FLOAT, FLOAT)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        # Before opset 11 the defaults are +-FLT_MAX, which clips nothing for float32/float16.
        self.lo = self.attr_float("min") if self.opset < 11 else None
        self.hi = self.attr_float("max") if self.opset < 11 else None

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = inputs[0]
        if self.opset < 11:
            lo, hi = self.lo, self.hi
        else:
            lo = inputs[1] if len(inputs) > 1 else None
            hi = inputs[2] if len(inputs) > 2 else None
        out = ctx.output(0, x.shape, x.dtype)
        if lo is not None and hi is not None:
            cupy.minimum(cupy.maximum(x, lo, out=out), hi, out=out)
        elif lo is not None:
            cupy.maximum(x, lo, out=out)
        elif hi is not None:
            cupy.minimum(x, hi, out=out)
        else:
            cupy.copyto(out, x)
