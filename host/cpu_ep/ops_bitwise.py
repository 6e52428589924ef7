"""Bit-level ops: BitShift, BitwiseAnd/Or/Xor/Not, BitCast.

BitShift is defined for unsigned integers only; a shift by the type's width or more gives 0 (C would
be undefined; ONNX's reference and onnxruntime give 0). The Bitwise ops take any integer type
(two's complement for signed). BitCast reinterprets the bytes of a tensor as another type of the
same width (little endian, as NumPy holds them on every platform ephost runs on).
"""

from __future__ import annotations

import numpy as np
import onnx

from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register


def _onnx_type(dtype: np.dtype) -> str:
    """'tensor(uint8)' for a NumPy dtype, as ONNX names types in its schemas."""
    try:
        name = onnx.TensorProto.DataType.Name(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    except (KeyError, ValueError, TypeError):
        return str(dtype)
    return f"tensor({name.lower()})"


@register("BitShift", since=11)
class BitShift(OpKernel):
    """Unsigned types up to opset 27; opset 28 adds signed ones (arithmetic right shift). A shift that is
    negative or at least the type's width gives what the sign extension alone gives: -1 for a right
    shift of a negative value, else 0."""

    def __init__(self, node):
        super().__init__(node)
        self.left = self.attr_str("direction", choices=("LEFT", "RIGHT")) == "LEFT"
        self.kinds = "iu" if self.opset >= 28 else "u"

    def _run(self, x, y):
        if x.dtype.kind not in self.kinds or y.dtype != x.dtype:
            allowed = "uint8, uint16, uint32, uint64" + (", int8, int16, int32, int64" if self.opset >= 28 else "")
            raise TypeError(f"BitShift-{self.opset} takes two tensors of one integer type; got "
                            f"{_onnx_type(x.dtype)} and {_onnx_type(y.dtype)} (allowed: {allowed})")
        bits = x.dtype.itemsize * 8
        out_of_range = (y < 0) | (y >= bits)
        shift = np.where(out_of_range, 0, y).astype(x.dtype)
        out = np.left_shift(x, shift) if self.left else np.right_shift(x, shift)
        fill = np.where(x < 0, x.dtype.type(-1), x.dtype.type(0)) if not self.left and x.dtype.kind == "i" else 0
        return (np.where(out_of_range, fill, out).astype(x.dtype, copy=False),)


class _Bitwise(OpKernel):
    fn = None

    def _run(self, *inputs):
        for t in inputs:
            if t.dtype.kind not in "iu" or t.dtype != inputs[0].dtype:
                raise TypeError(f"{self.op_type} takes tensors of one integer type; got "
                                + ", ".join(_onnx_type(i.dtype) for i in inputs))
        return (type(self).fn(*inputs),)


@register("BitwiseAnd", since=18)
class BitwiseAnd(_Bitwise):
    fn = staticmethod(np.bitwise_and)


@register("BitwiseOr", since=18)
class BitwiseOr(_Bitwise):
    fn = staticmethod(np.bitwise_or)


@register("BitwiseXor", since=18)
class BitwiseXor(_Bitwise):
    fn = staticmethod(np.bitwise_xor)


@register("BitwiseNot", since=18)
class BitwiseNot(_Bitwise):
    fn = staticmethod(np.invert)


@register("BitCast", since=26)
class BitCast(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        to = self.attr_int("to")
        try:
            self.dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
        except (KeyError, ValueError, TypeError) as exc:
            raise self.bad_attr("to", to, "an onnx.TensorProto data type") from exc
        if self.dtype == object:
            raise self.bad_attr("to", to, "a numeric or bool type (not tensor(string))")

    def _run(self, x):
        if x.dtype.itemsize != self.dtype.itemsize or x.dtype == object:
            raise TypeError(f"BitCast from {_onnx_type(x.dtype)} to {_onnx_type(self.dtype)}: the types must have "
                            f"the same bit width ({x.dtype.itemsize * 8} and {self.dtype.itemsize * 8} bits)")
        return ((x if x.flags.c_contiguous else x.copy()).view(self.dtype),)
