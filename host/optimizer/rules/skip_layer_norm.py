"""LayerNormalization(x + skip) -> ai.ephost SkipLayerNormalization (residual add fused with the norm).

Outputs: Y, and X + Skip as the optional second output when the sum is used elsewhere
(the next residual connection), so the Add disappears either way.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from host.optimizer.rules.base import EPHOST_DOMAIN, Family, has_float_type, rank


def _same_shape(a, b) -> bool:
    if a.shape is None or b.shape is None or a.shape.rank() != b.shape.rank():
        return False
    return all(x == y and x is not None for x, y in zip(a.shape, b.shape))


class SkipLayerNormFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, skip, scale):
        total = op.Add(x, skip, _outputs=["total"])
        y = op.LayerNormalization(total, scale, _allow_other_inputs=True, _allow_other_attributes=True,
                                  _outputs=["y"])
        return y, total

    def check(self, context, x, skip, y, total, **_):
        result = pattern.MatchResult()
        node = y.producer()
        if len(node.outputs) > 1 and any(o.uses() for o in node.outputs[1:]):
            return result.fail("Mean / InvStdDev outputs are used", node)
        axis = node.attributes.get_int("axis", -1)
        if rank(x) is None or axis not in (-1, rank(x) - 1):
            return result.fail("LayerNormalization is not over the last axis", node)
        if not (has_float_type(x) and _same_shape(x, skip)):
            return result.fail("x and skip differ in shape (the Add broadcasts) or are not float", skip)
        return result

    def rewrite(self, op, x, skip, scale, y, **_):
        node = y.producer()
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        args = [x, skip, scale] + ([bias] if bias is not None else [])
        return op.SkipLayerNormalization(*args, epsilon=epsilon, axis=-1, _domain=EPHOST_DOMAIN,
                                         _outputs=2)


def skip_layer_norm_rules() -> list:
    return SkipLayerNormFusion.rule().commute()


SKIP_LAYER_NORM = Family("SkipLayerNormalization", skip_layer_norm_rules, min_opset=17,
                         triggers=frozenset({"LayerNormalization"}),
                         emits=((EPHOST_DOMAIN, "SkipLayerNormalization"),))
