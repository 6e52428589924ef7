"""Symbolic dims of a model: which dims are the inputs' symbols, and arithmetic expressions over them.

ONNX shape inference names a dynamic dim by a string: the exporter's symbol on a graph input
("batch", "s0"), an expression the dynamo exporter writes into value_info ("2*s0", "s1 + 1"), or a
fresh "unk__N" it could not relate to anything. Only the first two can be computed from the shapes
fed to a run: `compile_dim` turns such a string into a function of the input symbols' sizes (Python's
`ast`: + - * // % and exact /, sympy's floor, ceiling, Max, Min), and returns None for anything else.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction

# `/` is exact (a Fraction) so that sympy's floor(s0/2) and ceiling(s0/2) round what they should.
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: Fraction}
# Functions torch's exporter prints in dims (sympy names).
_CALLS = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min}

DimFn = Callable[[dict[str, int]], int]


def compile_dim(dim, symbols: set[str]) -> tuple[DimFn, frozenset[str]] | None:
    """(function of the symbols' sizes, the symbols it reads) for an int dim or a dim string over
    `symbols`; None for an unknown dim (None, 'unk__3', an expression naming another symbol)."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        if dim < 0:
            return None
        return (lambda _sizes, d=dim: d), frozenset()
    if not isinstance(dim, str) or not dim.strip():
        return None
    try:
        tree = ast.parse(dim.strip(), mode="eval").body
    except SyntaxError:
        return None
    names: set[str] = set()
    fn = _compile(tree, symbols, names)
    return None if fn is None else (_whole(fn, dim), frozenset(names))


def _whole(fn: DimFn, text: str) -> DimFn:
    """fn, checked to give a whole number (a dim like 's0/2' is one only for even sizes) and to divide by
    no zero (a dim like 's0 // (s1 - 1)' has no value at s1 = 1): ValueError naming the dim otherwise."""
    def dim(sizes):
        try:
            value = fn(sizes)
        except ZeroDivisionError:
            raise ValueError(f"dim {text!r} divides by zero for sizes {sizes}") from None
        if value != int(value):
            raise ValueError(f"dim {text!r} is {value} for sizes {sizes}, not a whole number")
        return int(value)
    return dim


def _compile(node, symbols: set[str], names: set[str]) -> DimFn | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
        return lambda _sizes: value
    if isinstance(node, ast.Name):
        if node.id not in symbols:
            return None
        names.add(node.id)
        key = node.id
        return lambda sizes: sizes[key]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _compile(node.operand, symbols, names)
        return None if inner is None else (lambda sizes: -inner(sizes))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS \
            and node.args and not node.keywords:
        args = [_compile(a, symbols, names) for a in node.args]
        if any(a is None for a in args):
            return None
        call = _CALLS[node.func.id]
        return lambda sizes: call(*(a(sizes) for a in args))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _compile(node.left, symbols, names), _compile(node.right, symbols, names)
        if left is None or right is None:
            return None
        op = _BINARY[type(node.op)]
        return lambda sizes: op(left(sizes), right(sizes))
    return None


def input_symbols(inputs) -> dict[str, list[tuple[str, int]]]:
    """symbol -> every (input name, axis) that declares it, from graph inputs' ValueMeta shapes; only
    plain identifiers count (an expression on an input binds nothing)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for meta in inputs:
        for axis, dim in enumerate(meta.shape or ()):
            if isinstance(dim, str) and dim.isidentifier():
                out.setdefault(dim, []).append((meta.name, axis))
    return out


def term_add(a, b):
    """a + b for dim terms (ints, or expression strings): ints fold, 0 vanishes."""
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if b == 0:
        return a
    if a == 0:
        return b
    return f"({a} + {b})"


def term_sub(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a - b
    if a == b:  # GPT-2's key_length - query_length: 0 for any size
        return 0
    if b == 0:
        return a
    return f"({a} - {b})"


def term_mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if b == 1:
        return a
    if a == 1:
        return b
    return f"({a} * {b})"
