"""plugin_cuda/plan/symint.py: sizes that carry the C expression they were computed by."""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugin_cuda.plan.symint import SymInt, dim, symbols_of
from plugin_cuda.semantics import shapes

S0, S1 = SymInt(8, "S0"), SymInt(128, "S1")


def c_eval(expr: str, **symbols) -> int:
    """Evaluate a C integer expression of + - * / % over non-negative ints, as C does."""
    return eval(expr.replace("/", "//"), {}, symbols)  # noqa: S307 - our own generated text


def test_arithmetic_keeps_the_value_and_writes_the_expression():
    n = S0 * S1 * 768
    assert n == 8 * 128 * 768 and f"{n}" == "((S0*S1)*768)"
    assert f"{(n + 255) // 256}" == "((((S0*S1)*768)+255)/256)"
    assert f"{7 - S0}" == "(7-S0)" and f"{-S0}" == "(-S0)"


def test_identities_keep_the_source_short():
    assert (S0 * 1) is S0 and (1 * S0) is S0 and (S0 + 0) is S0 and (S0 // 1) is S0


def test_what_c_would_compute_differently_becomes_a_plain_int():
    neg = S0 - 20
    assert type(neg // 3) is int and neg // 3 == (8 - 20) // 3
    assert type(neg % 5) is int
    assert type(S0 ** 2) is int and type(S0 << 1) is int and type(abs(S0)) in (int, SymInt)
    assert isinstance(S0 * 0.5, float)


def test_format_specs_and_dim():
    assert f"{S0:d}" == "8" and f"{S0:>3}" == "  8" and str(S0) == "S0" and int(S0) == 8
    assert dim(S0) is S0 and type(dim(5)) is int
    assert pickle.loads(pickle.dumps(S0)).expr == "S0"


def test_symbols_of_lists_the_bare_names_in_order():
    assert symbols_of([(SymInt(2, "S2"), 3), (S0, S0 * 2), None]) == [S0, SymInt(2, "S2")]


def test_broadcast_keeps_the_symbolic_dims():
    out = shapes.broadcast("t", (S0, 1, S1), (1, 12, S1))
    assert out == (8, 12, 128) and out[0] is S0 and out[2] is S1 and type(out[1]) is int


@given(st.integers(0, 300), st.integers(1, 300), st.lists(st.sampled_from("+-*/%"), min_size=1, max_size=6),
       st.lists(st.integers(0, 50), min_size=6, max_size=6))
def test_the_expression_evaluates_to_the_value_for_the_symbols_it_was_made_from(a, b, ops, consts):
    x = SymInt(a, "S0")
    for op, c in zip(ops, consts):
        y = SymInt(b, "S1") if c % 3 == 0 else c
        if op in "/%" and (int(x) < 0 or int(y) <= 0):
            continue
        x = {"+": x + y, "-": x - y, "*": x * y, "/": x // y, "%": x % y}[op]
    if isinstance(x, SymInt):
        assert c_eval(x.expr, S0=a, S1=b) == int(x)
    assert math.prod([x, 1]) == int(x)


@pytest.mark.parametrize("expr", ["S0", "(S0*3)"])
def test_a_symint_is_an_int_for_everything_else(expr):
    x = SymInt(6, expr)
    assert list(range(x)) == list(range(6)) and [0] * x == [0] * 6 and hash(x) == hash(6) and {x: 1}[6] == 1
