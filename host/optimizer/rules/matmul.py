"""MatMul + Add -> Gemm (2-D) or ai.ephost FusedMatMul (N-D); FusedMatMul + activation.

The 2-D rules are onnxscript's MatMulAddToGemm family with a stricter check: onnxscript 0.7
fuses without looking at the bias, so an Add that broadcasts the product to a higher rank
(bias [K, M, N] on a [M, N] product) became an invalid Gemm. Here the bias must be
unidirectionally broadcastable to [M, N], as Gemm's C input requires.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _matmul_add_to_gemm as onnxscript_gemm

from host.optimizer.rules.base import EPHOST_DOMAIN, Family, has_float_type, last_dim, rank


def gemm_bias_ok(m, n, c) -> bool:
    """Whether `c` can be Gemm's C for a [m, n] product: rank <= 2, each dim 1 or equal to m / n."""
    if c is None or c.shape is None or c.shape.rank() > 2:
        return False
    for want, got in zip((n, m), reversed(list(c.shape))):
        if got != 1 and got != want:
            return False
    return True


class _StrictGemm:
    """Mixin: onnxscript's check (2-D operands) plus the bias check it lacks (listed first in the bases,
    so its check runs; trans_a / trans_b come from the onnxscript class)."""

    def check(self, context, input_a, input_b, input_c=None, **kwargs):
        result = super().check(context, input_a, input_b, **kwargs)
        if not result:
            return result
        m = input_a.shape[1 if self.trans_a else 0]
        n = input_b.shape[0 if self.trans_b else 1]
        if not gemm_bias_ok(m, n, input_c):
            return result.fail("bias is not unidirectionally broadcastable to [M, N]", input_c)
        return result


class MatMulAddToGemm(_StrictGemm, onnxscript_gemm.MatMulAddToGemm):
    pass


class TransAMatMulAddToGemm(_StrictGemm, onnxscript_gemm.TransAMatMulAddToGemm):
    pass


class TransBMatMulAddToGemm(_StrictGemm, onnxscript_gemm.TransBMatMulAddToGemm):
    pass


class TransABMatMulAddToGemm(_StrictGemm, onnxscript_gemm.TransABMatMulAddToGemm):
    pass


class MatMulAddToFusedMatMul(pattern.RewriteRuleClassBase):
    """Add(MatMul(A, B), bias) with a 1-D bias of the product's last dim -> FusedMatMul(A, B, bias)."""

    def pattern(self, op, a, b, bias):
        return op.Add(op.MatMul(a, b), bias)

    def check(self, context, a, b, bias, **_):
        result = pattern.MatchResult()
        if rank(a) is None or rank(b) is None:
            return result.fail("MatMul operand ranks unknown", a)
        if rank(a) == 2 and rank(b) == 2:
            return result.fail("2-D MatMul: left to the Gemm rules", a)
        if rank(a) < 2 or rank(b) < 2:
            return result.fail("1-D MatMul operand: the product drops a dim", a)
        if not (has_float_type(a) and has_float_type(bias)):
            return result.fail("not a float MatMul", a)
        n = last_dim(b)
        if rank(bias) != 1 or not isinstance(n, int) or last_dim(bias) != n:
            return result.fail("bias is not 1-D of the product's last dim", bias)
        return result

    def rewrite(self, op, a, b, bias):
        return op.FusedMatMul(a, b, bias, activation="", _domain=EPHOST_DOMAIN)


class FusedMatMulActivation(pattern.RewriteRuleClassBase):
    """act(FusedMatMul(A, B, bias)) -> FusedMatMul(A, B, bias, activation=act) for Relu and Gelu."""

    def __init__(self, activation: str):
        super().__init__(name=f"FusedMatMul{activation}")
        self.activation = activation

    def pattern(self, op, a, b, bias):
        mm = op.FusedMatMul(a, b, bias, _domain=EPHOST_DOMAIN, _allow_other_attributes=True, _outputs=["mm"])
        if self.activation == "Relu":
            return op.Relu(mm)
        return op.Gelu(mm, _allow_other_attributes=True, _outputs=["act"])

    def check(self, context, mm, act=None, **_):
        result = pattern.MatchResult()
        if mm.producer().attributes.get_string("activation", "") != "":
            return result.fail("FusedMatMul already has an activation", mm)
        if act is not None:
            approximate = act.producer().attributes.get_string("approximate", "none")
            want = "tanh" if self.activation == "GeluTanh" else "none"
            if approximate != want:
                return result.fail(f"Gelu approximate={approximate!r}, rule wants {want!r}", act)
        return result

    def rewrite(self, op, a, b, bias, **_):
        return op.FusedMatMul(a, b, bias, activation=self.activation, _domain=EPHOST_DOMAIN)


class FlattenedGemm(pattern.RewriteRuleClassBase):
    """Reshape(Gemm(Reshape(x, [-1, K]), W, b), [..., N]) -> FusedMatMul(x, W, b) (or MatMul without b).

    GPT-2's Conv1D and other `addmm` exports flatten the batch and sequence dims around a 2-D Gemm;
    MatMul broadcasts over them, so the two Reshapes go.
    """

    def pattern(self, op, x, flat_shape, w, out_shape):
        flat = op.Reshape(x, flat_shape, _outputs=["flat"])
        y = op.Gemm(flat, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["gemm"])
        return op.Reshape(y, out_shape, _outputs=["y"])

    def check(self, context, x, w, flat, gemm, y, **_):
        result = pattern.MatchResult()
        node = gemm.producer()
        attrs = {name: node.attributes.get_int(name, 0) for name in ("transA", "transB")}
        if any(attrs.values()) or node.attributes.get_float("alpha", 1.0) != 1.0:
            return result.fail("Gemm transposes or scales", node)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and (node.attributes.get_float("beta", 1.0) != 1.0 or rank(bias) != 1):
            return result.fail("bias is not a plain 1-D bias", bias)
        if not has_float_type(x) or x.shape is None or y.shape is None or rank(x) < 3 or rank(flat) != 2:
            return result.fail("not a flattened N-D input", x)
        dims_x, dims_y, n = list(x.shape), list(y.shape), last_dim(w)
        if not isinstance(n, int) or dims_y != dims_x[:-1] + [n] or flat.shape[-1] != dims_x[-1]:
            return result.fail("the Reshapes do not just flatten and restore the leading dims", y)
        return result

    def rewrite(self, op, x, w, gemm, **_):
        node = gemm.producer()
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            return op.FusedMatMul(x, w, node.inputs[2], activation="", _domain=EPHOST_DOMAIN)
        return op.MatMul(x, w)


def gemm_rules() -> list:
    rules = []
    for cls in (TransABMatMulAddToGemm, TransAMatMulAddToGemm, TransBMatMulAddToGemm, MatMulAddToGemm):
        rules += cls.rule().commute()  # Add(bias, MatMul) as well as Add(MatMul, bias)
    return rules


def fused_matmul_rules() -> list:
    rules = MatMulAddToFusedMatMul.rule().commute() + [FlattenedGemm.rule()]
    rules += [FusedMatMulActivation.rule(act) for act in ("Relu", "Gelu", "GeluTanh")]
    return rules


GEMM = Family("Gemm", gemm_rules, min_opset=7, triggers=frozenset({"MatMul"}), emits=(("", "Gemm"),))
FUSED_MATMUL = Family("FusedMatMul", fused_matmul_rules, min_opset=7, triggers=frozenset({"MatMul", "Gemm"}),
                      emits=((EPHOST_DOMAIN, "FusedMatMul"),))
