"""Consecutive GEMM layers run as one compiled call (host/cpu_ep/fusion_stack.py).

Each stacked layer is the compiled GEMM call its own chain makes, so a stacked run gives the bits of the
chains run one by one (a session made with the stacking off), and for Gemm + Relu layers those of the
node-by-node run (a profiled session: a profiler's nodes are never joined; the compiled Sigmoid epilogue
rounds unlike NumPy's). onnxruntime's CPU provider is the independent reference. What must not be stacked (an intermediate read elsewhere, a residual, products
the small GEMM does not take) runs as before.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.cli import zoo
from host.cpu_ep import native
from host.cpu_ep.fusion import FusedNode
from host.optimizer.levels import GraphOptimizationLevel
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from host.runtime.steps import CpuSegment

pytestmark = pytest.mark.skipif(native.LIB is None and native.load() is None,
                                reason="the compiled CPU kernels are not built (python build.py)")


def fused_steps(session) -> list[tuple[str, tuple]]:
    return [(type(e[0].kernel).__name__, e[0].names) for step, _ in session.executor.steps
            if isinstance(step, CpuSegment) for e in step.steps if isinstance(e[0], FusedNode)]


def node_by_node(model: bytes, feeds: dict, folder) -> list:
    options = SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / "profile")
    session = InferenceSession(model, options, providers=["CPUExecutionProvider"])
    try:
        return session.run(None, feeds)
    finally:
        session.end_profiling()


def chains_only(model: bytes, feeds: dict, monkeypatch) -> list:
    from host.cpu_ep import fusion_stack

    with monkeypatch.context() as patch:
        patch.setattr(fusion_stack, "stack_layers", lambda steps, consumers, keep: steps)
        session = InferenceSession(model, providers=["CPUExecutionProvider"])
    assert "LayerStack" not in [kind for kind, _ in fused_steps(session)]
    return session.run(None, feeds)


def reference(model: bytes, feeds: dict) -> list:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def layers_model(kinds: list[str], width: int = 32, extra_outputs=()) -> onnx.ModelProto:
    """x -> layer -> activation -> ... with layers 'gemm' (transB=1, bias), 'gemm_nt' (transB=0, no bias)
    and 'matmul'; activations after each: Relu, then Sigmoid, then Relu..."""
    rng = np.random.default_rng(7)
    nodes, inits, y = [], [], "x"
    for i, kind in enumerate(kinds):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        if kind == "gemm":
            inits.append(numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Gemm", [y, f"w{i}", f"b{i}"], [f"p{i}"], transB=1))
        elif kind == "gemm_nt":
            nodes.append(helper.make_node("Gemm", [y, f"w{i}"], [f"p{i}"]))
        else:
            nodes.append(helper.make_node("MatMul", [y, f"w{i}"], [f"p{i}"]))
        nodes.append(helper.make_node("Relu" if i % 2 == 0 else "Sigmoid", [f"p{i}"], [f"a{i}"]))
        y = f"a{i}"
    outputs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["rows", width])]
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", width]) for name in extra_outputs]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", width])]
    graph = helper.make_graph(nodes, "layers", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_the_zoo_mlp_runs_as_one_stack_with_the_node_by_node_bits(tmp_path):
    model = zoo.mlp().SerializeToString()
    session = InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [f"layer{i}/{op}" for i in range(8) for op in ("Gemm", "Relu")]
    assert fused_steps(session) == [("LayerStack", tuple(names))]
    feeds = {"input": np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)}
    got = session.run(None, feeds)[0]
    np.testing.assert_array_equal(got, node_by_node(model, feeds, tmp_path)[0])
    np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_gemm_and_matmul_layers_of_every_form_stack(rows, monkeypatch):
    model = layers_model(["gemm", "matmul", "gemm_nt", "gemm"]).SerializeToString()
    session = InferenceSession(model, providers=["CPUExecutionProvider"])
    assert [kind for kind, _ in fused_steps(session)] == ["LayerStack"]
    feeds = {"x": np.random.default_rng(rows).standard_normal((rows, 32)).astype(np.float32)}
    got = session.run(None, feeds)[0]
    np.testing.assert_array_equal(got, chains_only(model, feeds, monkeypatch)[0])
    np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_an_intermediate_the_graph_outputs_splits_the_stack():
    model = layers_model(["gemm", "gemm", "gemm", "gemm"], extra_outputs=["a1"]).SerializeToString()
    session = InferenceSession(model, providers=["CPUExecutionProvider"])
    assert [len(names) for kind, names in fused_steps(session) if kind == "LayerStack"] == [4, 4]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)}
    for got, want in zip(session.run(None, feeds), reference(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_layer_with_a_residual_add_is_left_out_of_the_stack(tmp_path):
    """The compiled epilogue's residual operand is read from outside the chain: such a layer keeps its own
    step, and the layers after it stack."""
    rng = np.random.default_rng(3)
    w = [numpy_helper.from_array((rng.standard_normal((32, 32)) / 6).astype(np.float32), f"w{i}") for i in range(4)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["p0"]), helper.make_node("Relu", ["p0"], ["a0"]),
             helper.make_node("MatMul", ["a0", "w1"], ["p1"]), helper.make_node("Add", ["p1", "x"], ["a1"]),
             helper.make_node("MatMul", ["a1", "w2"], ["p2"]), helper.make_node("Relu", ["p2"], ["a2"]),
             helper.make_node("MatMul", ["a2", "w3"], ["p3"]), helper.make_node("Relu", ["p3"], ["y"])]
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])], w)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()
    options = SessionOptions()  # the optimizer would make MatMul + Add(x) a Gemm over x: keep the Add
    options.graph_optimization_level = GraphOptimizationLevel.ORT_DISABLE_ALL
    session = InferenceSession(model, options, providers=["CPUExecutionProvider"])
    kinds = [(kind, len(names)) for kind, names in fused_steps(session)]
    assert kinds == [("_EpilogueChain", 2), ("_EpilogueChain", 2), ("LayerStack", 4)]
    feeds = {"x": rng.standard_normal((4, 32)).astype(np.float32)}
    got = session.run(None, feeds)[0]
    np.testing.assert_array_equal(got, node_by_node(model, feeds, tmp_path)[0])  # Relu and Add epilogues: same bits
    np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_rows_beyond_the_small_gemm_run_the_chains_with_the_same_results(monkeypatch):
    model = layers_model(["gemm", "matmul", "gemm"]).SerializeToString()
    session = InferenceSession(model, providers=["CPUExecutionProvider"])
    monkeypatch.setattr(native, "GEMM_MAX_MACS", 32 * 32 * 4)  # 5 rows do not fit: the chains take them
    for rows in (4, 5):
        feeds = {"x": np.random.default_rng(rows).standard_normal((rows, 32)).astype(np.float32)}
        np.testing.assert_array_equal(session.run(None, feeds)[0], chains_only(model, feeds, monkeypatch)[0])
