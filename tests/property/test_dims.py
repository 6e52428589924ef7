"""Symbolic dims (host/runtime/dims.py), against sympy as the independent reference.

Random dim expressions in the forms exporters print (torch's dynamo exporter writes sympy: `2*s0`,
`floor(s0/2)`, `Max(s0, s1)`, `s1 + 1`, `s0//2`, `Mod(s0, 3)` as `s0 % 3`) over the input symbols and
random sizes: `compile_dim` gives a function equal to sympy's value wherever sympy's is a whole
number, a ValueError naming the dim where it is not, and the set of symbols the text names. Dims it
cannot compute (another symbol, `unk__N`, a negative or non-int value, text that is not an
expression) are None. The term helpers the symbolic rules use build texts that compile to the
operation's value.
"""

from __future__ import annotations

import math
import re

import pytest
import sympy
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from host.runtime import dims
from tests.property import strategies as s

SYMBOLS = ("s0", "s1", "batch")


def _leaf():
    return st.one_of(st.integers(0, 9).map(str), st.sampled_from(SYMBOLS))


def _expr(children):
    binary = st.tuples(children, st.sampled_from(["+", "-", "*", "//", "%", "/"]), children).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})")
    calls = st.one_of(
        st.tuples(st.sampled_from(["floor", "ceiling"]), children).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(["Max", "Min"]), children, children).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
    )
    return st.one_of(binary, calls, children.map(lambda c: f"(-{c})"))


EXPRESSIONS = st.recursive(_leaf(), _expr, max_leaves=6)
SIZES = st.fixed_dictionaries({name: st.integers(1, 40) for name in SYMBOLS})


def reference(text: str, sizes: dict[str, int]):
    """sympy's value of `text` (Python syntax: // is floor division, / exact), or None where undefined."""
    syms = {name: sympy.Symbol(name, integer=True, positive=True) for name in SYMBOLS}
    local = {**syms, "floor": sympy.floor, "ceiling": sympy.ceiling, "Max": sympy.Max, "Min": sympy.Min}
    try:
        value = sympy.sympify(text, locals=local, rational=True).subs({syms[k]: v for k, v in sizes.items()})
    except (ZeroDivisionError, ValueError):  # ValueError: Max/Min of an undefined value ('zoo is not comparable')
        return None
    if value.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo) or not value.is_number:
        return None
    return sympy.Rational(value)


SIZES_4 = {"s0": 4, "s1": 3, "batch": 2}


def _divides_by_zero(text: str, sizes: dict[str, int]) -> bool:
    """Whether Python's own evaluation of `text` (float /, sympy's function names) divides by zero."""
    env = {"floor": math.floor, "ceiling": math.ceil, "Max": max, "Min": min, **sizes}
    try:
        eval(compile(text, "<dim>", "eval"), {"__builtins__": {}}, env)
    except ZeroDivisionError:
        return True
    except (OverflowError, ValueError):
        return False
    return False


@given(text=EXPRESSIONS, sizes=SIZES)
@example(text="(s0 / 3)", sizes=SIZES_4)  # not whole: the error names the dim
@example(text="(-(s0 // 3))", sizes=SIZES_4)
@example(text="ceiling((s1 / 2))", sizes=SIZES_4)
@example(text="(0 // (1 - s0))", sizes={"s0": 1, "s1": 1, "batch": 1})  # found by the thorough profile
@example(text="(0 // (1 / 0))", sizes=SIZES_4)
@settings(deadline=None, max_examples=s.budget(300))
def test_a_dim_expression_computes_what_sympy_computes(text, sizes):
    compiled = dims.compile_dim(text, set(SYMBOLS))
    assert compiled is not None, text
    fn, names = compiled
    if _divides_by_zero(text, sizes):  # sympy may simplify the zero divisor away first: 0 // (1 - s0) is 0
        with pytest.raises(ValueError, match=r"^dim '.*' divides by zero for sizes .*$"):
            fn(sizes)
        return
    want = reference(text, sizes)
    assume(want is not None)
    assert names == frozenset(re.findall(r"\b(s0|s1|batch)\b", text))
    if want.q == 1:
        assert fn(sizes) == int(want)
        assert type(fn(sizes)) is int
    else:
        with pytest.raises(ValueError, match=r"^dim '.*' is .* for sizes .*, not a whole number$"):
            fn(sizes)


@given(text=EXPRESSIONS, other=st.sampled_from(["seq", "unk__3", "s2"]))
@settings(deadline=None, max_examples=s.budget(60))
def test_a_dim_naming_another_symbol_is_unknown(text, other):
    assert dims.compile_dim(f"({text}) + {other}", set(SYMBOLS)) is None
    assert dims.compile_dim(f"Max({other}, {text})", set(SYMBOLS)) is None
    assert dims.compile_dim(f"-({other})", set(SYMBOLS)) is None


@pytest.mark.parametrize("dim", [None, -1, True, 2.5, "", "  ", "s0 +", "s0 ** 2", "abs(s0)", "s0 if s1 else 2",
                                 "floor(s0, k=1)", "floor()", "'s0'", "1.5"])
def test_what_is_not_a_dim_expression_is_unknown(dim):
    assert dims.compile_dim(dim, set(SYMBOLS)) is None


@pytest.mark.parametrize("dim, sizes, want", [(7, {}, 7), (0, {}, 0), (" s0 ", {"s0": 4}, 4)])
def test_ints_and_bare_symbols(dim, sizes, want):
    fn, names = dims.compile_dim(dim, set(SYMBOLS))
    assert fn(sizes) == want and names == frozenset(sizes)


TERMS = st.one_of(st.integers(0, 9), st.sampled_from(SYMBOLS), EXPRESSIONS)


@given(a=TERMS, b=TERMS, sizes=SIZES, op=st.sampled_from(["add", "sub", "mul"]))
@example(a=2, b="s0", sizes=SIZES_4, op="mul")
@example(a="s1", b=2, sizes=SIZES_4, op="mul")
@example(a=1, b="s1", sizes=SIZES_4, op="mul")
@example(a=0, b="s0", sizes=SIZES_4, op="add")
@example(a=1, b="s0", sizes=SIZES_4, op="add")
@example(a="s0", b=0, sizes=SIZES_4, op="add")
@example(a="s0", b=2, sizes=SIZES_4, op="add")
@example(a="s0", b="s0", sizes=SIZES_4, op="sub")
@example(a="s0", b="s1", sizes=SIZES_4, op="sub")
@example(a="s1", b=0, sizes=SIZES_4, op="sub")
@example(a=3, b=5, sizes=SIZES_4, op="sub")
@settings(deadline=None, max_examples=s.budget(200))
def test_term_helpers_build_texts_of_the_operation(a, b, sizes, op):
    assume(not _divides_by_zero(str(a), sizes) and not _divides_by_zero(str(b), sizes))  # the main test's case
    ra, rb = reference(str(a), sizes), reference(str(b), sizes)
    assume(ra is not None and rb is not None and ra.q == 1 and rb.q == 1)
    term = {"add": dims.term_add, "sub": dims.term_sub, "mul": dims.term_mul}[op](a, b)
    want = {"add": ra + rb, "sub": ra - rb, "mul": ra * rb}[op]
    if isinstance(term, int):
        assert term == want
        return
    fn, _ = dims.compile_dim(term, set(SYMBOLS))
    assert fn(sizes) == want


def test_input_symbols_are_plain_identifiers_of_graph_inputs():
    class Meta:
        def __init__(self, name, shape):
            self.name, self.shape = name, shape

    metas = [Meta("ids", ("batch", "seq")), Meta("mask", ("batch", "seq + 1", 4)), Meta("x", None)]
    assert dims.input_symbols(metas) == {"batch": [("ids", 0), ("mask", 0)], "seq": [("ids", 1)]}
