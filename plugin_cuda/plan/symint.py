"""Sizes that remember how they were computed from a partition's symbolic dims.

A plan per input-shape signature (plan/signatures.py) would compile its CUDA module again for each
new shape if sizes were baked into the source as literals. Instead, the dims that are symbolic in
the model enter lowering as `SymInt`s: ints (every comparison, decision, grid size and byte count
uses the signature's value, so the planner runs unchanged) that also carry a C expression over the
kernel parameters S0, S1, ... Codegen formats sizes into the source with f-strings, which print
a SymInt as its expression; so the source of a plan is the same for every signature whose
decisions are the same (tile sizes, GEMV or tiled GEMM, which broadcasts are trivial), and the
NVRTC cache (keyed by source) compiles it once. The values of S0.. are kernel arguments.

Only + - * and, on non-negative operands, // and % keep the expression; any other operation gives a
plain int, which codegen then writes as a literal: the source then differs per signature (one more
compile), never wrong for it.
"""

from __future__ import annotations

import operator

__all__ = ["SymInt", "dim", "symbols_of"]


class SymInt(int):
    """An int with `expr`, a C expression of the same value over the symbols S0, S1, ..."""

    def __new__(cls, value: int, expr: str):
        self = int.__new__(cls, value)
        self.expr = expr
        return self

    def __format__(self, spec: str) -> str:
        return self.expr if not spec else format(int(self), spec)

    def __str__(self) -> str:
        return self.expr

    def __repr__(self) -> str:
        return repr(int(self))  # messages print shapes with repr: the value, as for any int

    def __reduce__(self):
        return (SymInt, (int(self), self.expr))

    def __neg__(self):
        return SymInt(-int(self), f"(-{self.expr})")

    def __pos__(self):
        return self


def _expr(x) -> str:
    return x.expr if isinstance(x, SymInt) else str(int(x))


def _binary(op, c_op: str, needs_non_negative: bool, reflected: bool = False):
    def method(self, other):
        if not isinstance(other, int) or isinstance(other, bool):
            return op(int(self), other) if not reflected else op(other, int(self))
        a, b = (other, self) if reflected else (self, other)
        value = op(int(a), int(b))
        if needs_non_negative and (int(a) < 0 or int(b) <= 0):
            return value  # C's / and % truncate toward zero: only non-negative operands agree
        identity = _identity(c_op, a, b)
        if identity is not None:
            return identity
        return SymInt(value, f"({_expr(a)}{c_op}{_expr(b)})")

    return method


def _identity(c_op: str, a, b):
    """x*1, 1*x, x+0, 0+x, x-0, x/1: the symbolic operand itself (shorter source)."""
    if c_op == "*" and type(b) is int and b == 1 or c_op in "+-/" and type(b) is int and b == (1 if c_op == "/" else 0):
        return a if isinstance(a, SymInt) else None
    if c_op in "*+" and type(a) is int and a == (1 if c_op == "*" else 0):
        return b if isinstance(b, SymInt) else None
    return None


for _name, _op, _c, _nn in (("add", operator.add, "+", False), ("sub", operator.sub, "-", False),
                            ("mul", operator.mul, "*", False), ("floordiv", operator.floordiv, "/", True),
                            ("mod", operator.mod, "%", True)):
    setattr(SymInt, f"__{_name}__", _binary(_op, _c, _nn))
    setattr(SymInt, f"__r{_name}__", _binary(_op, _c, _nn, reflected=True))


def dim(d):
    """A shape entry as lowering keeps it: a SymInt as is, anything else as a plain int."""
    return d if isinstance(d, SymInt) else int(d)


def symbols_of(shapes) -> list:
    """The symbols (SymInts whose expression is a bare name S<k>) in `shapes`, ordered by k."""
    found = {}
    for shape in shapes:
        for d in shape or ():
            if isinstance(d, SymInt) and d.expr.startswith("S") and d.expr[1:].isdigit():
                found[int(d.expr[1:])] = d
    return [found[k] for k in sorted(found)]
