"""LayerNorm decomposition -> LayerNormalization (opset 17), from onnxscript's rules.

onnxscript 0.7's LayerNormFusion and LayerNormBiasFusion accept any scale / bias the final
Mul / Add happens to broadcast with. LayerNormalization's Scale and B must have the normalized
shape (the last dim here), so a per-element scale [B, S, D] or a bias that raises the rank was
fused into a wrong op. The subclasses below add that check (tests pin the onnxscript bug).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.fusion import _layer_norm as onnxscript_ln

from host.optimizer.rules.base import Family, last_dim, rank


def per_channel(value, x) -> bool:
    """Whether `value` is 1-D with x's (known) last dim, the shape LayerNormalization wants."""
    n = last_dim(x)
    return rank(value) == 1 and isinstance(n, int) and last_dim(value) == n


class LayerNormFusion(onnxscript_ln.LayerNormFusion):
    def check(self, context, x, epsilon, scale=None, **kwargs):
        result = super().check(context, x, epsilon, **kwargs)
        if result and not per_channel(scale, x):
            return result.fail("scale is not 1-D of x's last dim", scale)
        return result


class LayerNormBiasFusion(onnxscript_ln.LayerNormBiasFusion):
    def check(self, context, x, bias, **_):
        result = pattern.MatchResult()
        if not per_channel(bias, x):
            return result.fail("bias is not 1-D of x's last dim", bias)
        return result


def layer_norm_rules(present=frozenset({"ReduceMean", "LayerNormalization"})) -> list:
    """The decomposition's rules when a ReduceMean is present (it is in their pattern), then the bias
    rules (an Add after a LayerNormalization, exported or just fused), each with its commuted forms."""
    rules = [LayerNormFusion.rule()] if "ReduceMean" in present else []
    return pattern.RewriteRuleSet([*rules, LayerNormBiasFusion.rule()], commute=True).rules


# The decomposition's ReduceMean takes axes as an input (opset 18 form): convert to 18+ first.
LAYER_NORM = Family("LayerNormalization", layer_norm_rules, min_opset=18,
                    triggers=frozenset({"ReduceMean", "LayerNormalization"}), emits=(("", "LayerNormalization"),),
                    by_trigger=True)
