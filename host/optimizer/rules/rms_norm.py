"""RMSNorm decomposition -> RMSNormalization (opset 23), from onnxscript's rules.

Same gap as its LayerNorm rules: the scale must be 1-D of x's last dim for the fused op,
which onnxscript 0.7 does not check.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern
from onnxscript.rewriter.rules.fusion import _rms_normalization as onnxscript_rms

from host.optimizer.rules.base import Family
from host.optimizer.rules.layer_norm import per_channel

_HALF_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class RmsNormFusion(onnxscript_rms.RmsNormFusion):
    """onnxscript's rule, plus half-precision graphs without a Cast to float32 around the statistics
    (converted models): onnxscript refuses a half `stash_type`; the fused op then keeps its statistics
    in float32 (stash_type FLOAT), as the exporters' Casts and the kernels do."""

    def check(self, op, x, scale, epsilon, compute_dtype, target_dtype, **kwargs):
        result = super().check(op, x, scale, epsilon, compute_dtype, target_dtype, **kwargs)
        self.half_stash = False
        if not result and compute_dtype is None and x.dtype in _HALF_TYPES and scale.dtype in _HALF_TYPES \
                and isinstance(_ir_utils.get_singleton_value(epsilon), float):
            self.half_stash, result = True, pattern.MatchResult()
        if result and not per_channel(scale, x):
            return result.fail("scale is not 1-D of x's last dim", scale)
        return result

    def rewrite(self, op, x, scale, epsilon, **kwargs):
        if not self.half_stash:
            return super().rewrite(op, x, scale, epsilon, **kwargs)
        return op.RMSNormalization(x, scale, axis=-1, epsilon=_ir_utils.get_singleton_value(epsilon),
                                   stash_type=ir.DataType.FLOAT)


class OneOverToReciprocal(pattern.RewriteRuleClassBase):
    """Div(1, x) -> Reciprocal(x): the TorchScript exporter writes rsqrt as 1 / Sqrt, the rules want
    Reciprocal (the same IEEE operation)."""

    def pattern(self, op, one, x):
        return op.Div(one, x)

    def check(self, context, one, x, **_):
        result = pattern.MatchResult()
        if _ir_utils.get_singleton_value(one) != 1.0 or one.dtype != x.dtype:
            return result.fail("numerator is not the constant 1 of x's type", one)
        return result

    def rewrite(self, op, one, x):
        return op.Reciprocal(x)


def prepare_rules() -> list:
    return [OneOverToReciprocal.rule()]


def rms_norm_rules() -> list:
    return [RmsNormFusion.rule("RmsNormFusion1", mul_order=True), RmsNormFusion.rule("RmsNormFusion2", mul_order=False)]


RMS_NORM = Family("RMSNormalization", rms_norm_rules, min_opset=23, triggers=frozenset({"Pow", "ReduceMean"}),
                  emits=(("", "RMSNormalization"),), prepare=prepare_rules)
