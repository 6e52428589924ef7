"""Blocked weight-only QDQ -> com.microsoft MatMulNBits, as onnxruntime's DQMatMulToMatMulNBits does.

`matmul_nbits_quantizer` with QuantFormat.QDQ (and other weight-only tools) writes a quantized MatMul as
DequantizeLinear(block_size, axis 0) of a constant 4-bit (K, N) weight -> MatMul. This rule rewrites
it to MatMulNBits on the same codes, repacked in its layout (one row of K codes per output column,
blocks of block_size, two codes a byte, low nibble first; scales and zero points (N, k_blocks)), so the
CPU EP dequantizes the weight once and runs one float GEMM (host/cpu_ep/ops_quant_nbits.py) instead of
a DequantizeLinear every run.

Conditions (otherwise the pair stays as written): a DQ with block_size (a power of 2, >= 16) along
axis 0 of a constant 2-D int4/uint4/int8/uint8 weight, constant scales of the MatMul's float type
shaped (ceil(K / block_size), N), a constant zero point of the weight's type or none.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from abi.nbits import pack_codes
from host.optimizer.rules.base import Family, constant_array

MS_DOMAIN = "com.microsoft"
_BITS = {ir.DataType.INT4: 4, ir.DataType.UINT4: 4, ir.DataType.INT8: 8, ir.DataType.UINT8: 8}
_SIGNED = frozenset({ir.DataType.INT4, ir.DataType.INT8})


class _BlockedWeight:
    """A checked blocked DQ of a constant weight, and its MatMulNBits inputs."""

    def __init__(self, node: ir.Node, weight: np.ndarray, scales: np.ndarray, zero_point: np.ndarray | None):
        self.bits = _BITS[node.inputs[0].dtype]
        self.block_size = node.attributes.get_int("block_size", 0)
        self.k, self.n = weight.shape
        # signed codes shift by 2**(bits-1) into MatMulNBits' unsigned codes (its default zero point)
        offset = (1 << (self.bits - 1)) if node.inputs[0].dtype in _SIGNED else 0
        self.codes = (weight.astype(np.int32) + offset).astype(np.uint8)
        self.scales = scales
        self.zero_point = None if zero_point is None else (zero_point.astype(np.int32) + offset).astype(np.uint8)
        if self.zero_point is None and not offset:
            self.zero_point = np.zeros(scales.shape, np.uint8)  # uint4 without zero point: 0, not the default

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """B (N, k_blocks, blob), scales (N, k_blocks), zero points (N, ceil(k_blocks * bits / 8))."""
        k_blocks = self.scales.shape[0]
        codes = np.zeros((self.n, k_blocks * self.block_size), np.uint8)
        codes[:, :self.k] = self.codes.T
        b = pack_codes(codes.reshape(self.n, k_blocks, self.block_size), self.bits)
        zp = None if self.zero_point is None else pack_codes(self.zero_point.T, self.bits)
        return b, np.ascontiguousarray(self.scales.T), zp


def blocked_weight(value: ir.Value, float_type: ir.DataType) -> _BlockedWeight | None:
    """The blocked weight-only DQ producing `value`, when it meets the conditions above."""
    node = value.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    block_size = node.attributes.get_int("block_size", 0)
    if block_size < 16 or block_size & (block_size - 1) or node.inputs[0].dtype not in _BITS:
        return None
    weight, scales = constant_array(node.inputs[0]), constant_array(node.inputs[1])
    zp_value = node.inputs[2] if len(node.inputs) > 2 else None
    zero_point = constant_array(zp_value) if zp_value is not None else None
    if weight is None or scales is None or weight.ndim != 2 or node.attributes.get_int("axis", 1) % 2 != 0:
        return None
    if node.inputs[1].dtype != float_type or scales.shape != (-(-weight.shape[0] // block_size), weight.shape[1]):
        return None
    if zp_value is not None and (zero_point is None or zero_point.shape != scales.shape):
        return None
    return _BlockedWeight(node, weight, scales, zero_point)


class DqMatMulToNBits(pattern.RewriteRuleClassBase):
    """MatMul(a, DQ(blocked constant weight)) -> MatMulNBits(a, B, scales[, zero points])."""

    def pattern(self, op, a, b):
        return op.MatMul(a, b)

    def check(self, context, a, b, **_):
        result = pattern.MatchResult()
        if a.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16) or blocked_weight(b, a.dtype) is None:
            return result.fail("B is not a blocked weight-only DequantizeLinear of a constant", b)
        return result

    def rewrite(self, op, a, b, **_):
        w = blocked_weight(b, a.dtype)
        packed, scales, zp = w.packed()
        inputs = [a, op.Constant(value=ir.tensor(packed)), op.Constant(value=ir.tensor(scales))]
        if zp is not None:
            inputs.append(op.Constant(value=ir.tensor(zp)))
        return op.MatMulNBits(*inputs, K=w.k, N=w.n, bits=w.bits, block_size=w.block_size, _domain=MS_DOMAIN)


QDQ_NBITS = Family("QdqToMatMulNBits", lambda: [DqMatMulToNBits.rule()], min_opset=10,
                   triggers=frozenset({"DequantizeLinear"}), requires=frozenset({"MatMul"}),
                   emits=((MS_DOMAIN, "MatMulNBits"),))
