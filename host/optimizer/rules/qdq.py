"""QDQ groups -> integer kernels, as onnxruntime's QDQ transformer does at the EXTENDED level.

A QDQ model (onnxruntime.quantization's QuantFormat.QDQ) writes every quantized op as
DequantizeLinear -> float op -> QuantizeLinear. These rules match the float op and the Q after it,
find the DequantizeLinear nodes that feed the op (they are looked up in check(), not matched, so a DQ
shared with other consumers stays for them; an unused one is dropped by the dead-node pass), and
replace the group with the integer kernel on the quantized tensors:

| group | becomes |
|---|---|
| DQ -> Conv (int32 bias DQ) -> Q | QLinearConv (per-tensor or per-channel weights) |
| DQ -> MatMul -> Q | QLinearMatMul (per-tensor or per-column weights) |
| DQ -> MatMul (float result) | com.microsoft MatMulIntegerToFloat |
| DQ -> Gemm (int32 bias DQ) -> Q | com.microsoft QGemm |
| the three above with a Relu before the Q whose zero point is its type's minimum | the same (Relu is redundant) |
| DQ -> Add / Mul -> Q | com.microsoft QLinearAdd / QLinearMul |
| DQ -> GlobalAveragePool -> Q | com.microsoft QLinearGlobalAveragePool |
| DQ -> Softmax -> Q | com.microsoft QLinearSoftmax |
| DQ -> MaxPool / Reshape / Flatten / Transpose / Squeeze / Unsqueeze -> Q, same scale and zero point | the op on the quantized tensor |

Only 8-bit groups with constant scales and zero points are fused (onnxruntime's conditions); a
blocked DQ, a 16-bit or 4-bit type, or a bias whose scale is not input scale x weight scale stays as
written (it runs in float; a blocked weight-only DQ -> MatMul becomes MatMulNBits: rules/qdq_nbits.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from host.optimizer.rules.base import Family, constant_array

MS_DOMAIN = "com.microsoft"
INT8_TYPES = frozenset({ir.DataType.UINT8, ir.DataType.INT8})


class _Quant:
    """A DequantizeLinear's inputs, once checked: the quantized value, its scale and zero point."""

    def __init__(self, node: ir.Node):
        self.value, self.scale, self.zero_point = node.inputs[0], node.inputs[1], node.inputs[2]
        self.scale_array = constant_array(self.scale)
        self.zp_array = constant_array(self.zero_point)
        self.axis = node.attributes.get_int("axis", 1)


def dequantized(value: ir.Value | None) -> _Quant | None:
    """The DQ producing `value` when it is an 8-bit, unblocked DQ with constant scale and zero point."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.inputs) < 3 or node.inputs[2] is None or node.attributes.get_int("block_size", 0):
        return None
    q = _Quant(node)
    # the integer kernels take float32 scales (a float16 scale makes a float16 group: left as written)
    if q.value.dtype not in INT8_TYPES or q.scale.dtype != ir.DataType.FLOAT or q.scale_array is None \
            or q.zp_array is None:
        return None
    return q


def per_tensor(q: _Quant | None) -> bool:
    return q is not None and q.scale_array.size == 1 and q.zp_array.size == 1


def per_axis(q: _Quant | None, axis: int, rank_: int) -> bool:
    """Per tensor, or one scale per slice of `axis` (normalized against rank_)."""
    if per_tensor(q):
        return True
    return (q is not None and q.scale_array.ndim == 1 and q.zp_array.shape == q.scale_array.shape
            and q.axis % rank_ == axis % rank_)


def _output(y_scale: ir.Value, y_zero_point: ir.Value | None) -> bool:
    """The Q after the op: constant per-tensor scale and an 8-bit zero point."""
    if y_zero_point is None or y_zero_point.dtype not in INT8_TYPES or y_scale.dtype != ir.DataType.FLOAT:
        return False
    s, z = constant_array(y_scale), constant_array(y_zero_point)
    return s is not None and z is not None and s.size == 1 and z.size == 1


def _clamps_at_zero(y_zero_point: ir.Value) -> bool:
    """Whether Q saturates every negative value to its zero point (zero point = the type's minimum)."""
    zp = constant_array(y_zero_point)
    return int(zp.reshape(-1)[0]) == int(np.iinfo(zp.dtype).min)


def int32_bias(value: ir.Value | None, x: _Quant, w: _Quant) -> ir.Value | None | bool:
    """The int32 input of the bias DQ (None when there is no bias), or False when the bias is not
    an int32 DQ with zero point 0 and scale x_scale * w_scale (the integer kernel adds it unscaled)."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.inputs[0].dtype != ir.DataType.INT32:
        return False
    scale = constant_array(node.inputs[1])
    zp = constant_array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else np.zeros(1)
    if scale is None or zp is None or np.any(zp != 0):
        return False
    want = (x.scale_array.astype(np.float32) * w.scale_array.astype(np.float32)).reshape(-1)
    if not np.allclose(scale.reshape(-1), want, rtol=1e-5, atol=0):
        return False
    return node.inputs[0]


def _onnx_opset(graph: ir.Graph) -> int:
    return graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1))


def _attrs(node: ir.Node, names) -> dict:
    return {k: v for k, v in node.attributes.items() if k in names}


class _QdqRule(pattern.RewriteRuleClassBase):
    """Q(op(...)) where the op's inputs come from DQs; subclasses name the op and check its DQs."""

    op_type = ""

    def __init__(self, name: str | None = None, through_relu: bool = False):
        # through_relu: Q(Relu(op)) where the Q's zero point is its type's minimum, so the Q already
        # clamps what Relu would (onnxruntime's "redundant clip" of a QDQ group)
        self.through_relu = through_relu
        name = name or type(self).__name__
        super().__init__(name=f"{name}Relu" if through_relu else name)

    def pattern(self, op, x, y_scale, y_zero_point):
        out = getattr(op, self.op_type)(x, _allow_other_inputs=True, _allow_other_attributes=True,
                                        _outputs=["float_out"])
        if self.through_relu:
            out = op.Relu(out)
        return op.QuantizeLinear(out, y_scale, y_zero_point, _allow_other_attributes=True)

    def check(self, context, float_out, y_scale, y_zero_point, **_):
        result = pattern.MatchResult()
        node = float_out.producer()
        if not _output(y_scale, y_zero_point):
            return result.fail("the Q after the op is not 8-bit per tensor with constant parameters", y_scale)
        if self.through_relu and not _clamps_at_zero(y_zero_point):
            return result.fail("the Q's zero point is not its type's minimum: Relu is not redundant", y_zero_point)
        if len(node.outputs) != 1 or not self.group_ok(node, y_scale, y_zero_point):
            return result.fail(f"{self.op_type}'s inputs are not a fusable QDQ group", float_out)
        return result

    def rewrite(self, op, float_out, y_scale, y_zero_point, **_):
        return self.fused(op, float_out.producer(), y_scale, y_zero_point)


class QdqConv(_QdqRule):
    op_type = "Conv"

    def group_ok(self, node, y_scale, y_zp):
        x, w = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        if not per_tensor(x) or w is None or x.value.dtype != y_zp.dtype or w.value.shape is None:
            return False
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        return per_axis(w, 0, w.value.shape.rank()) and int32_bias(bias, x, w) is not False

    def fused(self, op, node, y_scale, y_zp):
        x, w = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        bias = int32_bias(node.inputs[2] if len(node.inputs) > 2 else None, x, w)
        extra = [bias] if bias is not None else []
        attrs = _attrs(node, ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
        return op.QLinearConv(x.value, x.scale, x.zero_point, w.value, w.scale, w.zero_point, y_scale, y_zp,
                              *extra, **attrs)


def matmul_group_ok(node: ir.Node) -> bool:
    """MatMul of a per-tensor DQ and a per-tensor (or, for a 2-D B, per-column) DQ."""
    a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
    if not per_tensor(a) or b is None or b.value.shape is None:
        return False
    # per-column weights only for a 2-D B (QLinearMatMul's b_scale is 1-D of N there)
    return per_tensor(b) or (b.value.shape.rank() == 2 and per_axis(b, 1, 2))


class QdqMatMul(_QdqRule):
    op_type = "MatMul"

    def group_ok(self, node, y_scale, y_zp):
        return matmul_group_ok(node)

    def fused(self, op, node, y_scale, y_zp):
        a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        return op.QLinearMatMul(a.value, a.scale, a.zero_point, b.value, b.scale, b.zero_point, y_scale, y_zp)


class QdqGemm(_QdqRule):
    op_type = "Gemm"

    def group_ok(self, node, y_scale, y_zp):
        a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        if not per_tensor(a) or b is None or node.attributes.get_float("beta", 1.0) != 1.0:
            return False
        b_axis = 0 if node.attributes.get_int("transB", 0) else 1
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        return per_axis(b, b_axis, 2) and int32_bias(bias, a, b) is not False

    def fused(self, op, node, y_scale, y_zp):
        a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        bias = int32_bias(node.inputs[2] if len(node.inputs) > 2 else None, a, b)
        return op.QGemm(a.value, a.scale, a.zero_point, b.value, b.scale, b.zero_point, bias, y_scale, y_zp,
                        _domain=MS_DOMAIN, **_attrs(node, ("alpha", "transA", "transB")))


class QdqBinary(_QdqRule):
    """Add / Mul of two per-tensor DQs of the Q's type -> com.microsoft QLinearAdd / QLinearMul."""

    def __init__(self, op_type: str):
        self.op_type = op_type
        super().__init__(name=f"Qdq{op_type}")

    def group_ok(self, node, y_scale, y_zp):
        a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        return per_tensor(a) and per_tensor(b) and a.value.dtype == b.value.dtype == y_zp.dtype

    def fused(self, op, node, y_scale, y_zp):
        a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        return getattr(op, f"QLinear{self.op_type}")(a.value, a.scale, a.zero_point, b.value, b.scale, b.zero_point,
                                                     y_scale, y_zp, _domain=MS_DOMAIN)


class QdqGlobalAveragePool(_QdqRule):
    op_type = "GlobalAveragePool"

    def group_ok(self, node, y_scale, y_zp):
        x = dequantized(node.inputs[0])
        return per_tensor(x) and x.value.dtype == y_zp.dtype

    def fused(self, op, node, y_scale, y_zp):
        x = dequantized(node.inputs[0])
        return op.QLinearGlobalAveragePool(x.value, x.scale, x.zero_point, y_scale, y_zp, channels_last=0,
                                           _domain=MS_DOMAIN)


class QdqSoftmax(_QdqRule):
    op_type = "Softmax"

    def group_ok(self, node, y_scale, y_zp):
        x = dequantized(node.inputs[0])
        return per_tensor(x) and x.value.dtype == y_zp.dtype and node.graph is not None

    def fused(self, op, node, y_scale, y_zp):
        x = dequantized(node.inputs[0])
        opset = _onnx_opset(node.graph)
        # the `opset` attribute keeps Softmax-1/11's coerce-to-2-D semantics where the model has them
        axis = node.attributes.get_int("axis", -1 if opset >= 13 else 1)
        return op.QLinearSoftmax(x.value, x.scale, x.zero_point, y_scale, y_zp, axis=axis, opset=opset,
                                 _domain=MS_DOMAIN)


class DropQdq(_QdqRule):
    """DQ -> data movement / max -> Q with the same scale and zero point: the op on the quantized tensor
    gives the same integers (these ops only move or select values)."""


    def __init__(self, op_type: str):
        self.op_type = op_type
        super().__init__(name=f"DropQdq{op_type}")

    def group_ok(self, node, y_scale, y_zp):
        x = dequantized(node.inputs[0])
        ys, yz = constant_array(y_scale), constant_array(y_zp)
        if self.op_type == "MaxPool" and (node.graph is None or _onnx_opset(node.graph) < 12):
            return False  # MaxPool takes 8-bit integers from opset 12
        return (per_tensor(x) and x.value.dtype == y_zp.dtype and ys.dtype == x.scale_array.dtype
                and ys.reshape(-1)[0] == x.scale_array.reshape(-1)[0] and yz.reshape(-1)[0] == x.zp_array.reshape(-1)[0])

    def fused(self, op, node, y_scale, y_zp):
        x = dequantized(node.inputs[0])
        return getattr(op, self.op_type)(x.value, *node.inputs[1:], **dict(node.attributes.items()))


def _feeds_q(value: ir.Value) -> bool:
    """Whether a Q (directly or through a Relu) reads the value: a QdqMatMul group, not a float result."""
    for use in value.uses():
        node = use.node
        if node.op_type == "QuantizeLinear" or (node.op_type == "Relu" and _feeds_q(node.outputs[0])):
            return True
    return False


class QdqMatMulToFloat(pattern.RewriteRuleClassBase):
    """DQ(a), DQ(b) -> MatMul with a float result (no Q after it) -> com.microsoft MatMulIntegerToFloat,
    as onnxruntime does: the product on integers, scaled to float once."""

    def pattern(self, op, a, b):
        return op.MatMul(a, b, _outputs=["float_out"])

    def check(self, context, a, b, float_out, **_):
        result = pattern.MatchResult()
        if _feeds_q(float_out):
            return result.fail("a Q follows: left to QdqMatMul", float_out)
        if not matmul_group_ok(float_out.producer()):
            return result.fail("MatMul's inputs are not a fusable QDQ group", float_out)
        return result

    def rewrite(self, op, a, b, float_out, **_):
        qa, qb = dequantized(a), dequantized(b)
        return op.MatMulIntegerToFloat(qa.value, qb.value, qa.scale, qb.scale, qa.zero_point, qb.zero_point,
                                       _domain=MS_DOMAIN)


DROP_OPS = ("MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze")


def qdq_rules() -> list:
    groups = (QdqConv, QdqMatMul, QdqGemm)
    rules = [cls.rule(through_relu=relu) for cls in groups for relu in (False, True)]
    rules += [QdqMatMulToFloat.rule(), QdqGlobalAveragePool.rule(), QdqSoftmax.rule()]
    rules += [QdqBinary.rule(op) for op in ("Add", "Mul")]
    return rules + [DropQdq.rule(op) for op in DROP_OPS]


QDQ = Family("QdqToInteger", qdq_rules, min_opset=10, triggers=frozenset({"DequantizeLinear"}),
             requires=frozenset({"QuantizeLinear"}),
             emits=(("", "QLinearConv"), ("", "QLinearMatMul"), (MS_DOMAIN, "QGemm"), (MS_DOMAIN, "QLinearAdd"),
                    (MS_DOMAIN, "QLinearMul"), (MS_DOMAIN, "QLinearGlobalAveragePool"),
                    (MS_DOMAIN, "QLinearSoftmax"), (MS_DOMAIN, "MatMulIntegerToFloat")))
