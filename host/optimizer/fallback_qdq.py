"""Expansions of the integer kernels the QDQ fusion (rules/qdq.py) emits, back to the
DequantizeLinear -> float op -> QuantizeLinear group they replaced (for an EP that claims the group's
float ops but not the integer kernel); of MatMulNBits (rules/qdq_nbits.py) to a MatMul by its
dequantized float weight; of DynamicQuantizeMatMul (rules/qdq_dynamic.py) to quantize_dynamic's chain."""

from __future__ import annotations

import onnx_ir as ir

from abi.nbits import NBitsLayout
from host.optimizer.fallback import _attr, _Builder, _input, _unsupported, expansion
from host.optimizer.rules.base import constant_array
from host.optimizer.rules.qdq import MS_DOMAIN

_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _dq(b: _Builder, x, scale, zero_point, axis: int = 1):
    return b.op("DequantizeLinear", x, scale, zero_point, axis=axis)


def _q(b: _Builder, y, scale, zero_point):
    return b.op("QuantizeLinear", y, scale, zero_point)


def _copied(node: ir.Node, names) -> dict:
    return {k: v.value for k, v in node.attributes.items() if k in names}


def _int32_bias(b: _Builder, bias, x_scale, w_scale):
    """The int32 bias as float: bias * x_scale * w_scale (per output channel when w_scale is)."""
    return b.op("DequantizeLinear", bias, b.op("Mul", x_scale, w_scale), axis=0)


@expansion("", "QLinearConv")
def _qlinear_conv(b: _Builder, node: ir.Node) -> list:
    x, xs, xz, w, ws, wz, ys, yz = node.inputs[:8]
    args = [_dq(b, x, xs, xz), _dq(b, w, ws, wz, axis=0)]
    if _input(node, 8) is not None:
        args.append(_int32_bias(b, node.inputs[8], xs, ws))
    return [_q(b, b.op("Conv", *args, **_copied(node, _CONV_ATTRS)), ys, yz)]


@expansion("", "QLinearMatMul")
def _qlinear_matmul(b: _Builder, node: ir.Node) -> list:
    a, a_s, az, w, ws, wz, ys, yz = node.inputs[:8]
    return [_q(b, b.op("MatMul", _dq(b, a, a_s, az), _dq(b, w, ws, wz, axis=-1)), ys, yz)]


@expansion(MS_DOMAIN, "QGemm")
def _qgemm(b: _Builder, node: ir.Node) -> list:
    a, a_s, az, w, ws, wz = node.inputs[:6]
    trans_b = _attr(node, "transB", 0)
    args = [_dq(b, a, a_s, az), _dq(b, w, ws, wz, axis=0 if trans_b else 1)]
    if _input(node, 6) is not None:
        args.append(_int32_bias(b, node.inputs[6], a_s, ws))
    y = b.op("Gemm", *args, **_copied(node, ("alpha", "transA", "transB")))
    return [y if _input(node, 7) is None else _q(b, y, node.inputs[7], _input(node, 8))]


def _binary(op_type: str):
    def expand(b: _Builder, node: ir.Node) -> list:
        a, a_s, az, c, cs, cz, ys = node.inputs[:7]
        return [_q(b, b.op(op_type, _dq(b, a, a_s, az), _dq(b, c, cs, cz)), ys, _input(node, 7))]
    return expand


expansion(MS_DOMAIN, "QLinearAdd")(_binary("Add"))
expansion(MS_DOMAIN, "QLinearMul")(_binary("Mul"))


@expansion(MS_DOMAIN, "QLinearGlobalAveragePool")
def _qlinear_gap(b: _Builder, node: ir.Node) -> list:
    x, xs, xz, ys = node.inputs[:4]
    return [_q(b, b.op("GlobalAveragePool", _dq(b, x, xs, xz)), ys, _input(node, 4))]


@expansion(MS_DOMAIN, "QLinearSoftmax")
def _qlinear_softmax(b: _Builder, node: ir.Node) -> list:
    x, xs, xz, ys = node.inputs[:4]
    y = b.op("Softmax", _dq(b, x, xs, xz), axis=_attr(node, "axis", -1))
    return [_q(b, y, ys, _input(node, 4))]


@expansion(MS_DOMAIN, "MatMulIntegerToFloat")
def _matmul_integer_to_float(b: _Builder, node: ir.Node) -> list:
    a, w, a_s, ws = node.inputs[:4]
    y = b.op("MatMul", _dq(b, a, a_s, _input(node, 4)), _dq(b, w, ws, _input(node, 5), axis=-1))
    return [y if _input(node, 6) is None else b.op("Add", y, node.inputs[6])]


@expansion(MS_DOMAIN, "MatMulNBits")
def _matmul_nbits(b: _Builder, node: ir.Node) -> list:
    """MatMul by the weight dequantized here (any bits, zero points, g_idx), plus the bias."""
    layout = NBitsLayout(_attr(node, "K", 0), _attr(node, "N", 0), _attr(node, "bits", 4), _attr(node, "block_size", 0))
    weights = [None if _input(node, i) is None else constant_array(node.inputs[i]) for i in (1, 2, 3, 4)]
    if weights[0] is None or weights[1] is None or any(w is None and _input(node, i + 1) is not None
                                                       for i, w in enumerate(weights)):
        raise _unsupported(node, "weights, scales, zero points or g_idx that are not constants")
    w = layout.dequantize(*weights)
    y = b.op("MatMul", node.inputs[0], b.const(w.astype(node.inputs[2].dtype.numpy())))
    return [y if _input(node, 5) is None else b.op("Add", y, node.inputs[5])]


@expansion(MS_DOMAIN, "DynamicQuantizeMatMul")
def _dynamic_quantize_matmul(b: _Builder, node: ir.Node) -> list:
    x, w, w_scale = node.inputs[:3]
    x_q, x_scale, x_zp = b.tape.op_multi_out("DynamicQuantizeLinear", [x], num_outputs=3,
                                             name=f"{b.prefix}/DynamicQuantizeLinear")
    product = b.op("MatMulInteger", x_q, w, x_zp, _input(node, 3))
    y = b.op("Mul", b.op("Cast", product, to=ir.DataType.FLOAT), b.op("Mul", x_scale, w_scale))
    return [y if _input(node, 4) is None else b.op("Add", y, node.inputs[4])]
