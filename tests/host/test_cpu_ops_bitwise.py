"""CPU EP bit operators (host/cpu_ep/ops_bitwise.py) where onnx's backend suite has no case: BitShift on
signed types (opset 28) and BitCast between widths; tests/host/test_backend.py is their main coverage."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from host.errors import KernelError
from host.runtime.session import InferenceSession


def _model(node, inputs, outputs, opset):
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def test_bitshift_on_signed_types_needs_opset_28():
    node = helper.make_node("BitShift", ["x", "y"], ["z"], name="n", direction="RIGHT")
    io = [_vi("x", TensorProto.INT32, [3]), _vi("y", TensorProto.INT32, [3])], [_vi("z", TensorProto.INT32, [3])]
    x, y = np.array([-8, 8, -1], np.int32), np.array([1, 40, -2], np.int32)
    with pytest.raises(KernelError, match=r"^node 'n' \(BitShift\) on CPUExecutionProvider failed: BitShift-18 "
                                          r"takes two tensors of one integer type; got tensor\(int32\) and "
                                          r"tensor\(int32\) \(allowed: uint8, uint16, uint32, uint64\)$"):
        InferenceSession(_model(node, *io, 18).SerializeToString()).run(None, {"x": x, "y": y})
    (z,) = InferenceSession(_model(node, *io, 28).SerializeToString()).run(None, {"x": x, "y": y})
    # Arithmetic shift; a shift past the width or negative leaves only the sign extension.
    np.testing.assert_array_equal(z, [-4, 0, -1])


def test_bitcast_needs_equal_widths():
    node = helper.make_node("BitCast", ["x"], ["y"], name="bc", to=TensorProto.INT64)
    model = _model(node, [_vi("x", TensorProto.FLOAT, [2])], [_vi("y", TensorProto.INT64, [2])], 26)
    with pytest.raises(KernelError, match=r"^node 'bc' \(BitCast\) on CPUExecutionProvider failed: BitCast from "
                                          r"tensor\(float\) to tensor\(int64\): the types must have the same bit "
                                          r"width \(32 and 64 bits\)$"):
        InferenceSession(model.SerializeToString()).run(None, {"x": np.ones(2, np.float32)})
