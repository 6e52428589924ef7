"""GELU decompositions -> Gelu (opset 20); Add(x, bias) + Gelu -> ai.ephost BiasGelu.

Exporters write GELU as arithmetic before opset 20:
  erf:  0.5 * x * (1 + erf(x / sqrt(2)))          (the 0.5 in any of three places; x * 1/sqrt(2) too)
  tanh: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))   (x^3 as Pow(x, 3) or x * (x * x))
Mul and Add commute, and letting onnxscript commute every node of these patterns makes about a
thousand variants. So a first rule moves constants to the right of Mul / Add (exact: IEEE
multiplication and addition are commutative), and the GELU patterns only spell out the orders
of operands that are both computed values.
"""

from __future__ import annotations

import itertools

import onnx_ir as ir
from onnxscript.rewriter import pattern

from abi.gelu import GELU_TANH_COEFF, SQRT_2, SQRT_2_OVER_PI
from host.optimizer.rules.base import EPHOST_DOMAIN, Family, constant_array, has_float_type, rank

_SQRT2 = SQRT_2
_SQRT_2_OVER_PI = SQRT_2_OVER_PI


class ConstantOnTheRight(pattern.RewriteRuleClassBase):
    """Mul(c, x) -> Mul(x, c) and Add(c, x) -> Add(x, c) for a constant c and a computed x."""

    def __init__(self, op_type: str):
        super().__init__(name=f"ConstantRight{op_type}")
        self.op_type = op_type

    def pattern(self, op, c, x):
        return getattr(op, self.op_type)(c, x)

    def check(self, context, c, x, **_):
        result = pattern.MatchResult()
        if constant_array(c) is None or constant_array(x) is not None:
            return result.fail("not constant-first", c)
        return result

    def rewrite(self, op, c, x):
        return getattr(op, self.op_type)(x, c)


def _binary(op, op_type: str, a, b, swap: bool):
    return getattr(op, op_type)(b, a) if swap else getattr(op, op_type)(a, b)


# The irrational constants of a float16/bfloat16 graph are rounded to its type: bfloat16 keeps 8
# significant bits, so they are off by up to 2**-9 relative. Rules for half-precision inputs match them
# within that (and only those rules: a float32 constant that far off is another function).
_HALF_REL_TOL = 2.5e-3
_HALF_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class GeluFusion(pattern.RewriteRuleClassBase):
    """One GELU spelling -> Gelu(x, approximate); `half` rules match half-precision inputs only."""

    def __init__(self, approximate: str, variant: bool, where: str, swaps: tuple[bool, ...], half: bool = False):
        super().__init__(name=f"Gelu_{approximate}{'_half' if half else ''}")
        self.approximate, self.variant, self.where, self.swaps, self.half = approximate, variant, where, swaps, half

    def _const(self, value: float):
        return pattern.Constant(value, rel_tol=_HALF_REL_TOL) if self.half else value

    def _term(self, op, x):
        c = self._const
        if self.approximate == "none":
            arg = op.Div(x, c(_SQRT2)) if self.variant else op.Mul(x, c(1.0 / _SQRT2))
            return op.Add(op.Erf(arg), 1.0)
        cube = op.Pow(x, 3.0) if self.variant else _binary(op, "Mul", x, op.Mul(x, x), self.swaps[2])
        inner = _binary(op, "Add", x, op.Mul(cube, c(GELU_TANH_COEFF)), self.swaps[1])
        return op.Add(op.Tanh(op.Mul(inner, c(_SQRT_2_OVER_PI))), 1.0)

    def pattern(self, op, x):
        term = self._term(op, x)
        swap = self.swaps[0]
        if self.where == "x":  # (x * 0.5) * term
            return _binary(op, "Mul", op.Mul(x, 0.5), term, swap)
        if self.where == "term":  # x * (term * 0.5)
            return _binary(op, "Mul", x, op.Mul(term, 0.5), swap)
        return op.Mul(_binary(op, "Mul", x, term, swap), 0.5)  # (x * term) * 0.5

    def check(self, context, x, **_):
        result = pattern.MatchResult()
        if not has_float_type(x):
            return result.fail("Gelu takes float inputs", x)
        if self.half and x.dtype not in _HALF_TYPES:
            return result.fail("constants matched at half precision need a half-precision input", x)
        return result

    def rewrite(self, op, x):
        return op.Gelu(x, approximate=self.approximate)


class BiasGeluFusion(pattern.RewriteRuleClassBase):
    """Gelu(Add(x, bias)) with a 1-D bias of x's last dim -> BiasGelu(x, bias)."""

    def pattern(self, op, x, bias):
        return op.Gelu(op.Add(x, bias), _allow_other_attributes=True, _outputs=["gelu"])

    def check(self, context, x, bias, gelu, **_):
        result = pattern.MatchResult()
        if rank(bias) != 1 or rank(x) is None or rank(x) < 1:
            return result.fail("bias is not 1-D", bias)
        if not isinstance(bias.shape[0], int) or x.shape[-1] != bias.shape[0]:
            return result.fail("bias size differs from x's last dim", bias)
        if not has_float_type(x):
            return result.fail("not a float input", x)
        return result

    def rewrite(self, op, x, bias, gelu):
        approximate = gelu.producer().attributes.get_string("approximate", "none")
        return op.BiasGelu(x, bias, approximate=approximate, _domain=EPHOST_DOMAIN)


def gelu_rules(present=frozenset({"Erf", "Tanh"})) -> list:
    """The Gelu patterns of the forms whose op (`Erf` for the exact one, `Tanh`) is in `present`."""
    rules = []
    for approximate in [a for a, op in (("none", "Erf"), ("tanh", "Tanh")) if op in present]:
        for variant in (True, False):
            # Swaps that matter: the outer Mul; for tanh also the Add(x, ...) and the x * (x * x) cube.
            n_swaps = 1 if approximate == "none" else (2 if variant else 3)
            for where in ("x", "term", "product"):
                for swaps in itertools.product((False, True), repeat=n_swaps):
                    padded = swaps + (False,) * (3 - len(swaps))
                    rules.append(GeluFusion.rule(approximate, variant, where, padded))
                    rules.append(GeluFusion.rule(approximate, variant, where, padded, half=True))
    return rules


def canonical_rules() -> list:
    return [ConstantOnTheRight.rule("Mul"), ConstantOnTheRight.rule("Add")]


def bias_gelu_rules() -> list:
    return BiasGeluFusion.rule().commute()


GELU = Family("Gelu", gelu_rules, min_opset=20, triggers=frozenset({"Erf", "Tanh"}), emits=(("", "Gelu"),),
              prepare=canonical_rules, by_trigger=True)
BIAS_GELU = Family("BiasGelu", bias_gelu_rules, min_opset=20, triggers=frozenset({"Gelu"}),
                   emits=((EPHOST_DOMAIN, "BiasGelu"),))
