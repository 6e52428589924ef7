"""RMSNorm decomposition -> RMSNormalization (opset 23), from onnxscript's rules.

Same gap as its LayerNorm rules: the scale must be 1-D of x's last dim for the fused op,
which onnxscript 0.7 does not check.
"""

from __future__ import annotations

from onnxscript.rewriter.rules.fusion import _rms_normalization as onnxscript_rms

from host.optimizer.rules.base import Family
from host.optimizer.rules.layer_norm import per_channel


class RmsNormFusion(onnxscript_rms.RmsNormFusion):
    def check(self, op, x, scale, *args, **kwargs):
        result = super().check(op, x, scale, *args, **kwargs)
        if result and not per_channel(scale, x):
            return result.fail("scale is not 1-D of x's last dim", scale)
        return result


def rms_norm_rules() -> list:
    return [RmsNormFusion.rule("RmsNormFusion1", mul_order=True), RmsNormFusion.rule("RmsNormFusion2", mul_order=False)]


RMS_NORM = Family("RMSNormalization", rms_norm_rules, min_opset=23, triggers=frozenset({"Pow", "ReduceMean"}),
                  emits=(("", "RMSNormalization"),))
