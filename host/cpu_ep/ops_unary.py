"""Element-wise ops of one input the transformer and CNN paths did not need: inverse and hyperbolic
trigonometry, Round, Softsign, Celu, Shrink, ThresholdedRelu. Results keep the input's dtype."""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel
from host.cpu_ep.ops_elementwise import Unary
from host.cpu_ep.registry import register


@register("Tan", since=7)
class Tan(Unary):
    fn = staticmethod(np.tan)


@register("Asin", since=7)
class Asin(Unary):
    fn = staticmethod(np.arcsin)


@register("Acos", since=7)
class Acos(Unary):
    fn = staticmethod(np.arccos)


@register("Atan", since=7)
class Atan(Unary):
    fn = staticmethod(np.arctan)


@register("Sinh", since=9)
class Sinh(Unary):
    fn = staticmethod(np.sinh)


@register("Cosh", since=9)
class Cosh(Unary):
    fn = staticmethod(np.cosh)


@register("Asinh", since=9)
class Asinh(Unary):
    fn = staticmethod(np.arcsinh)


@register("Acosh", since=9)
class Acosh(Unary):
    fn = staticmethod(np.arccosh)


@register("Atanh", since=9)
class Atanh(Unary):
    fn = staticmethod(np.arctanh)


@register("Round", since=11)
class Round(Unary):
    """Halves to even, as ONNX specifies (np.round's rule)."""

    fn = staticmethod(np.round)


@register("Softsign", since=1)
class Softsign(Unary):
    fn = staticmethod(lambda x: x / (1 + np.abs(x)))


@register("Celu", since=12)
class Celu(OpKernel):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""

    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 1.0)
        if self.alpha == 0:
            raise self.bad_attr("alpha", self.alpha, "a non-zero float")

    def _run(self, x):
        xf = x.astype(np.float32) if x.dtype == np.float16 else x
        y = np.maximum(xf, 0) + np.minimum(0, self.alpha * np.expm1(xf / self.alpha))
        return (y.astype(x.dtype, copy=False),)


@register("Shrink", since=9)
class Shrink(OpKernel):
    """x + bias where x < -lambd, x - bias where x > lambd, else 0."""

    def __init__(self, node):
        super().__init__(node)
        self.bias = self.attr_float("bias", 0.0)
        self.lambd = self.attr_float("lambd", 0.5)

    def _run(self, x):
        y = np.where(x < -self.lambd, x + self.bias, np.where(x > self.lambd, x - self.bias, 0))
        return (y.astype(x.dtype, copy=False),)


@register("ThresholdedRelu", since=10)
class ThresholdedRelu(OpKernel):
    """x where x > alpha, else 0."""

    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 1.0)

    def _run(self, x):
        return (np.where(x > self.alpha, x, 0).astype(x.dtype, copy=False),)
