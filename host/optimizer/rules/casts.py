"""A Cast round trip through a wider type is a no-op (BASIC level).

onnxscript's CastCast rule only shortens float -> float16 chains; a value cast to a type that holds
every value of its own type exactly and back (float -> double -> float, int32 -> int64 -> int32)
is the value itself.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

T = ir.DataType
# type -> the wider types that represent each of its values exactly
EXACT_WIDENINGS = {
    T.FLOAT16: {T.FLOAT, T.DOUBLE}, T.BFLOAT16: {T.FLOAT, T.DOUBLE}, T.FLOAT: {T.DOUBLE},
    T.INT8: {T.INT16, T.INT32, T.INT64}, T.INT16: {T.INT32, T.INT64}, T.INT32: {T.INT64},
    T.UINT8: {T.UINT16, T.UINT32, T.UINT64, T.INT16, T.INT32, T.INT64},
    T.UINT16: {T.UINT32, T.UINT64, T.INT32, T.INT64}, T.UINT32: {T.UINT64, T.INT64},
    T.BOOL: {T.INT8, T.INT16, T.INT32, T.INT64, T.UINT8, T.FLOAT, T.DOUBLE},
}


class CastRoundTrip(pattern.RewriteRuleClassBase):
    """Cast(Cast(x, to=wider), to=type(x)) -> x."""

    def pattern(self, op, x, to_wide, to_back):
        return op.Cast(op.Cast(x, to=to_wide), to=to_back)

    def check(self, context, x, to_wide, to_back, **_):
        result = pattern.MatchResult()
        if x.dtype is None or to_back.as_int() != x.dtype.value:
            return result.fail("the second Cast does not return to x's type", x)
        if T(to_wide.as_int()) not in EXACT_WIDENINGS.get(x.dtype, ()):
            return result.fail("the intermediate type does not hold every value of x's type", x)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


def cast_rules() -> list:
    return [CastRoundTrip.rule()]
