"""Elementwise ONNX ops: arithmetic, comparisons, activations, Where, Cast, Clip, Max/Min.

CuPy ufuncs write straight into the output (`out=`) and broadcast; the few ops without a ufunc
are ElementwiseKernels, built on first use and compiled by CuPy once per device and dtype.
float16 math runs in float32 registers and is stored back as float16.
"""

from __future__ import annotations

import numpy as np

from .base import BOOL, FLOAT, INDEX, ONNX_DTYPES, CudaKernel, broadcast_shape, kernel_table, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

# Kernel sources (in_params, out_params, body) are plain data so that they can be read, and
# syntax-checked, as text.
SOURCES = {
    "sigmoid": ("T x", "T y", "y = T(1.0f / (1.0f + expf(-float(x))));"),
    "erf": ("T x", "T y", "y = T(erff(float(x)));"),
    "gelu": (
        "T x", "T y",
        "float v = float(x); y = T(0.5f * v * (1.0f + erff(v * 0.70710678118654752f)));",
    ),
    "gelu_tanh": (
        "T x", "T y",
        "float v = float(x);"
        " y = T(0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v))));",
    ),
    "leaky_relu": ("T x, float32 alpha", "T y", "float v = float(x); y = T(v >= 0.0f ? v : v * alpha);"),
    "where": ("bool c, T a, T b", "T y", "y = c ? a : b;"),
}


elementwise = kernel_table(SOURCES)


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
    ufunc = "negative"


@register("Abs", 6)
class Abs(_Unary):
    ufunc = "absolute"


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
    def _compute(self, ctx):
        x = ctx.inputs[0]
        cupy.maximum(x, 0, out=ctx.output(0, x.shape, x.dtype))


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
    ufunc = "add"


@register("Sub", 1)
class Sub(_Binary):
    ufunc = "subtract"


@register("Mul", 1)
class Mul(_Binary):
    ufunc = "multiply"


@register("Div", 1)
class Div(_Binary):
    ufunc = "divide"


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
    ufunc = "equal"
    out_dtype = np.dtype(np.bool_)


@register("Less", 1)
class Less(_Binary):
    ufunc = "less"
    out_dtype = np.dtype(np.bool_)


@register("Greater", 1)
class Greater(_Binary):
    ufunc = "greater"
    out_dtype = np.dtype(np.bool_)


class _Variadic(CudaKernel):
    """Max / Min over any number of broadcasting inputs."""

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


@register("Where", 9)
class Where(CudaKernel):
    input_types = (BOOL, FLOAT, FLOAT)
    same_type = (1, 2)

    def _compute(self, ctx):
        c, a, b = ctx.inputs
        elementwise("where")(c, a, b, ctx.output(0, broadcast_shape(c.shape, a.shape, b.shape), a.dtype))


CAST_TYPES = FLOAT | INDEX | BOOL


@register("Cast", 6)
class Cast(CudaKernel):
    """Cast where at least one side is a float type (integer-only casts are shape work for the CPU)."""

    input_types = (CAST_TYPES,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        to = self.attr_int("to")
        name = ONNX_DTYPES.get(to) if to is not None else None
        if name not in CAST_TYPES:
            raise self.bad_attr("to", to, "1 (float), 10 (float16), 6 (int32), 7 (int64), 9 (bool)")
        self.to = np.dtype(name)

    @classmethod
    def claims(cls, attrs, dtypes, opset):
        if not super().claims(attrs, dtypes, opset):
            return False
        return bool(dtypes) and (dtypes[0] in FLOAT or ONNX_DTYPES.get(attrs.get("to")) in FLOAT)

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
