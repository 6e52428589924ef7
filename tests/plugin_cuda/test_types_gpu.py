"""Sequence, optional and string values in a session with the CUDA EP (issue 26 item 4): the plugin
runs the float nodes, the CPU EP the ones over sequences, optionals and strings, and the values cross
between them. Reference: onnxruntime's CPU provider on the same model."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, opset=18):
    model = helper.make_model(helper.make_graph(nodes, "types", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10  # what the onnxruntime of every machine reads
    return model


def sequence_model():
    """a = x + y on the device; [a, x] as a sequence on the CPU; its first element back to the device."""
    nodes = [helper.make_node("Add", ["x", "y"], ["a"]),
             helper.make_node("SequenceConstruct", ["a", "x"], ["s"]),
             helper.make_node("SequenceAt", ["s", "zero"], ["first"]),
             helper.make_node("SequenceLength", ["s"], ["n"]),
             helper.make_node("Relu", ["first"], ["r"]),
             helper.make_node("Mul", ["r", "y"], ["out"])]
    inputs = [helper.make_tensor_value_info("x", F, [2, 3]), helper.make_tensor_value_info("y", F, [2, 3]),
              helper.make_tensor_value_info("zero", TensorProto.INT64, [])]
    outputs = [helper.make_tensor_value_info("out", F, [2, 3]), helper.make_tensor_value_info("n", TensorProto.INT64, [])]
    return _model(nodes, inputs, outputs)


def optional_model():
    """Optional(x + y) -> OptionalHasElement and OptionalGetElement -> Sigmoid on the device."""
    nodes = [helper.make_node("Add", ["x", "y"], ["a"]),
             helper.make_node("Optional", ["a"], ["o"]),
             helper.make_node("OptionalHasElement", ["o"], ["has"]),
             helper.make_node("OptionalGetElement", ["o"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["out"])]
    inputs = [helper.make_tensor_value_info("x", F, [2, 3]), helper.make_tensor_value_info("y", F, [2, 3])]
    outputs = [helper.make_tensor_value_info("out", F, [2, 3]), helper.make_tensor_value_info("has", TensorProto.BOOL, [])]
    return _model(nodes, inputs, outputs)


def string_model():
    """A string tensor passed through (CPU EP) beside a float path on the device."""
    nodes = [helper.make_node("Identity", ["names"], ["names_out"]),
             helper.make_node("Add", ["x", "y"], ["a"]),
             helper.make_node("Tanh", ["a"], ["out"])]
    inputs = [helper.make_tensor_value_info("names", TensorProto.STRING, [3]),
              helper.make_tensor_value_info("x", F, [2, 3]), helper.make_tensor_value_info("y", F, [2, 3])]
    outputs = [helper.make_tensor_value_info("names_out", TensorProto.STRING, [3]),
               helper.make_tensor_value_info("out", F, [2, 3])]
    return _model(nodes, inputs, outputs)


def feeds(model):
    rng = np.random.default_rng(0)
    out = {}
    for vi in model.graph.input:
        t = vi.type.tensor_type.elem_type
        if t == F:
            out[vi.name] = rng.standard_normal((2, 3)).astype(np.float32)
        elif t == TensorProto.INT64:
            out[vi.name] = np.array(0, np.int64)
        else:
            out[vi.name] = np.array(["a", "bé", ""], dtype=object)
    return out


@pytest.mark.parametrize("make", [sequence_model, optional_model, string_model])
def test_values_of_other_types_cross_between_the_cuda_and_cpu_eps(genv, make):
    ort = pytest.importorskip("onnxruntime")
    from host.runtime.session import InferenceSession

    model = make()
    sess = InferenceSession(model.SerializeToString(), providers=[(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"],
                            env=genv)
    assert CUDA in set(sess.node_assignment().values())  # the float nodes are the plugin's
    f = feeds(model)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)
    got = sess.run(None, f)
    for g, w in zip(got, want):
        if np.asarray(w).dtype == object:
            assert list(np.asarray(g)) == list(np.asarray(w))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
            assert np.asarray(g).dtype == np.asarray(w).dtype
