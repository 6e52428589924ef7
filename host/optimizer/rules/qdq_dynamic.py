"""quantize_dynamic's MatMul chain -> com.microsoft DynamicQuantizeMatMul, as onnxruntime's
MatMulIntegerToFloat and DynamicQuantizeMatMul fusions do.

`onnxruntime.quantization.quantize_dynamic` writes each MatMul by a constant weight as

    x_q, x_scale, x_zp = DynamicQuantizeLinear(x)
    y = Mul(Cast(MatMulInteger(x_q, w_q, x_zp, w_zp), to=FLOAT), Mul(x_scale, w_scale))  [+ bias]

six nodes for one product. DynamicQuantizeMatMul(x, w_q, w_scale, w_zp[, bias]) computes the same values
in one kernel: float32(int32 product) times the same float32 scale product, plus the bias (the kernel
does these operations in this order, so the results are bit-exact with the chain). The fusion needs
the chain's intermediate values to have no other reader (a DynamicQuantizeLinear shared by several
MatMuls stays), and a bias of one value per output column.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from host.optimizer.rules.base import Family, static_dims

MS_DOMAIN = "com.microsoft"


def _single_use(*values: ir.Value) -> bool:
    return all(len(v.uses()) == 1 and not v.is_graph_output() for v in values)


class DynamicMatMulChain(pattern.RewriteRuleClassBase):
    """The six-node chain above (with_bias: and the Add after it)."""

    def __init__(self, with_bias: bool):
        self.with_bias = with_bias
        super().__init__(name="DynamicMatMulBias" if with_bias else "DynamicMatMul")

    def pattern(self, op, x, w, w_zp, w_scale, bias):
        x_q, x_scale, x_zp = op.DynamicQuantizeLinear(x, _outputs=["x_q", "x_scale", "x_zp"])
        product = op.MatMulInteger(x_q, w, x_zp, w_zp, _outputs=["product"])
        scaled = op.Mul(op.Cast(product, to=ir.DataType.FLOAT, _outputs=["as_float"]),
                        op.Mul(x_scale, w_scale, _outputs=["scale"]), _outputs=["scaled"])
        return op.Add(scaled, bias) if self.with_bias else scaled

    def check(self, context, x, w, w_scale, x_q, x_scale, x_zp, product, as_float, scale, scaled, bias=None, **_):
        result = pattern.MatchResult()
        inner = [x_q, x_scale, x_zp, product, as_float, scale] + ([scaled] if self.with_bias else [])
        if not _single_use(*inner):
            return result.fail("a value inside the chain has another reader", x_q)
        if self.with_bias and not self._bias_ok(w, bias):
            return result.fail("the Add is not a bias of one value per output column", bias)
        if not self.with_bias and self._bias_after(w, scaled):
            # the rewriter may reach the Mul before the Add: the longer form must take the chain
            return result.fail("a bias Add follows: left to the bias form", scaled)
        return result

    @classmethod
    def _bias_after(cls, w: ir.Value, scaled: ir.Value) -> bool:
        uses = scaled.uses()
        if len(uses) != 1 or scaled.is_graph_output() or uses[0].node.op_type != "Add":
            return False
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        return other is not None and cls._bias_ok(w, other)

    @staticmethod
    def _bias_ok(w: ir.Value, bias: ir.Value) -> bool:
        dims, w_dims = static_dims(bias), static_dims(w)
        return (bias.dtype == ir.DataType.FLOAT and dims is not None and w_dims is not None and len(w_dims) == 2
                and dims == [w_dims[1]])

    def rewrite(self, op, x, w, w_zp, w_scale, bias=None, **_):
        extra = [bias] if self.with_bias else []
        return op.DynamicQuantizeMatMul(x, w, w_scale, w_zp, *extra, _domain=MS_DOMAIN)


def dynamic_rules() -> list:
    rules = []
    for with_bias in (True, False):  # the longer chain first: it takes the Add when there is one
        rules += DynamicMatMulChain.rule(with_bias=with_bias).commute()
    return rules


QDQ_DYNAMIC = Family("DynamicQuantMatMul", dynamic_rules, min_opset=10,
                     triggers=frozenset({"DynamicQuantizeLinear"}), requires=frozenset({"MatMulInteger"}),
                     emits=((MS_DOMAIN, "DynamicQuantizeMatMul"),))
