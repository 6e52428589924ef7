"""The partitioner's two graph-changing paths with a plugin EP in the session (host/runtime/partition).

The mutation run (tests/property/mutation.py) runs only this directory; these two paths were not
reached by the properties: fallback expansion of an optimizer-fused node nobody can run (the graph and
its view are replaced before claims), and shape arithmetic leaving the plan for the host's shape
program (built over the final view's value ids).
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from host import cpu_ep
from host.cpu_ep import registry
from host.runtime.session import InferenceSession
from tests.property import harness as h

V = 6
RNG = np.random.default_rng(7)


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@contextlib.contextmanager
def _example_session(model, ops: str, optimize: bool):
    """A session with the example plugin claiming `ops`; `optimize`: the optimizer at its default level
    (the harness turns it off, as the properties count the model's own nodes)."""
    with h.example_env(V, (V,)) as env:
        options = None if optimize else h.session_options()
        with InferenceSession(model, options, providers=[(h.EXAMPLE_EP, {"ops": ops})], env=env) as sess:
            yield sess


@pytest.fixture
def cpu_ep_without_fused_matmul(monkeypatch):
    monkeypatch.delitem(registry.CPU_KERNELS, ("ai.ephost", "FusedMatMul"), raising=False)
    assert cpu_ep.lookup("ai.ephost", "FusedMatMul", 1) is None


def test_an_unrunnable_fused_node_is_expanded_before_claims(cpu_ep_without_fused_matmul):
    """MatMul + Add fuse into FusedMatMul, which no EP here runs: the partitioner plans the expansion
    (the CPU EP's MatMul and Add) and the plugin still gets its Relu."""
    w, b = RNG.standard_normal((5, 6)).astype(np.float32), RNG.standard_normal(6).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="fc/MatMul"),
             helper.make_node("Add", ["mm", "b"], ["z"], name="fc/Add"),
             helper.make_node("Relu", ["z"], ["y"], name="fc/Relu")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 6])], [("w", w), ("b", b)])
    x = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    with _example_session(model, "Relu", optimize=True) as sess:
        assert "FusedMatMul" in str(sess.optimization.report)  # the optimizer fused, the partitioner expanded
        got = sess.run(None, {"x": x})[0]
        assignment = {n.op_type: n.provider for n in sess.plan.nodes}
        assert all(n.op_type != "FusedMatMul" for n in sess.graph.nodes)
        assert sess._partitioner.view.value_names == sess.plan.value_names  # the view of the expanded graph
    assert assignment == {"MatMul": "CPUExecutionProvider", "Add": "CPUExecutionProvider", "Relu": "ExampleEP"}
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_shape_arithmetic_leaves_the_plan_and_follows_each_shape():
    """y = Relu(Reshape(x, concat(shape(x)[0], -1))): Shape/Gather/Unsqueeze/Concat are the host's shape
    program, evaluated once per input shape; the Relu runs on the plugin."""
    idx = numpy_helper.from_array(np.array(0, np.int64), "zero")
    minus = numpy_helper.from_array(np.array([-1], np.int64), "minus_one")
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", None])],
                              [idx, minus, numpy_helper.from_array(np.array([0], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with _example_session(model, "Relu", optimize=False) as sess:
        assert len(sess.shape_program.nodes) >= 3  # Shape, Gather, Unsqueeze (Concat) left the plan
        assert all(n.op_type not in ("Shape", "Gather") for n in sess.plan.nodes)
        for shape in [(2, 3, 4), (5, 1, 2), (2, 3, 4)]:
            x = RNG.standard_normal(shape).astype(np.float32)
            got = sess.run(None, {"x": x})[0]
            np.testing.assert_array_equal(got, _ort(model, {"x": x})[0])
        assert [n.provider for n in sess.plan.nodes if n.op_type == "Relu"] == ["ExampleEP"]


def test_a_sequence_output_beside_plugin_outputs_comes_back_as_a_list():
    """run() hands non-tensor outputs (a sequence) back as lists of arrays, tensors as arrays, in one
    plan where the plugin computes the tensor."""
    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "xyz")
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Add", ["x", "y"], ["z"], name="add"),
             helper.make_node("SequenceConstruct", ["x", "z"], ["s"], name="seq")]
    model = _model(nodes, [x, y], [z, seq])
    feeds = {"x": RNG.standard_normal((2, 3)).astype(np.float32), "y": RNG.standard_normal((2, 3)).astype(np.float32)}
    with _example_session(model, "Add", optimize=False) as sess:
        assert [n.provider for n in sess.plan.nodes if n.op_type == "Add"] == ["ExampleEP"]
        got_z, got_s = sess.run(None, feeds)
    want_z, want_s = _ort(model, feeds)
    np.testing.assert_allclose(got_z, want_z, rtol=1e-6)
    assert isinstance(got_s, list) and len(got_s) == len(want_s) == 2
    for got, want in zip(got_s, want_s):
        np.testing.assert_allclose(got, want, rtol=1e-6)
