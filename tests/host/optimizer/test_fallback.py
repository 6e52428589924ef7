"""Fused nodes no EP claims go back to their unfused subgraphs: expand_unclaimed and the session hook."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from onnx import helper

from host import cpu_ep
from host.cpu_ep import registry
from host.errors import InvalidArgument, ModelError
from host.optimizer import can_expand, expand_unclaimed, optimize
from host.optimizer.fallback import EXPANSIONS
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.host.optimizer.common import float_arrays, make_model, ops

RNG = np.random.default_rng(3)


def _single(op_type, inputs, attrs=None, domain="", opset=23, out_shape=None, extra_inits=None):
    """A model of one node with float inputs (name, shape) and initializers; the output has the first
    input's shape unless `out_shape`."""
    names = [n for n, _ in inputs] + list(extra_inits or {})
    node = helper.make_node(op_type, names, ["y"], domain=domain, **(attrs or {}))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, 1, s) for n, s in inputs],
                              [helper.make_tensor_value_info("y", 1, out_shape or inputs[0][1])],
                              [onnx.numpy_helper.from_array(v, k) for k, v in (extra_inits or {}).items()])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=imports, ir_version=10)


# Standard ops: the expansion must compute what onnxruntime's own kernel computes.
STANDARD = {
    "gelu": lambda: _single("Gelu", [("x", [3, 8])], {"approximate": "none"}),
    "gelu_tanh": lambda: _single("Gelu", [("x", [3, 8])], {"approximate": "tanh"}),
    "layer_norm": lambda: _single("LayerNormalization", [("x", [2, 3, 8])], {"epsilon": 1e-3},
                                  extra_inits={"g": RNG.standard_normal(8).astype(np.float32),
                                               "b": RNG.standard_normal(8).astype(np.float32)}),
    "rms_norm": lambda: _single("RMSNormalization", [("x", [2, 3, 8])], {"epsilon": 1e-5},
                                extra_inits={"g": RNG.standard_normal(8).astype(np.float32)}),
    "hard_swish": lambda: _single("HardSwish", [("x", [3, 8])]),
    "hard_sigmoid": lambda: _single("HardSigmoid", [("x", [3, 8])], {"alpha": 0.3, "beta": 0.4}),
    "gemm": lambda: _single("Gemm", [("x", [4, 3])], {"transB": 1, "alpha": 0.5, "beta": 2.0}, out_shape=[4, 5],
                            extra_inits={"w": RNG.standard_normal((5, 3)).astype(np.float32),
                                         "c": RNG.standard_normal(5).astype(np.float32)}),
    "attention_3d": lambda: _single("Attention", [("q", [2, 4, 8]), ("k", [2, 4, 8]), ("v", [2, 4, 8]),
                                                  ("m", [2, 1, 4, 4])], {"q_num_heads": 2, "kv_num_heads": 2}),
    "attention_4d": lambda: _single("Attention", [("q", [2, 2, 4, 4]), ("k", [2, 2, 4, 4]), ("v", [2, 2, 4, 4])],
                                    {"scale": 0.3}),
    "rotary": lambda: _single("RotaryEmbedding", [("x", [1, 2, 4, 8]), ("cos", [1, 4, 4]), ("sin", [1, 4, 4])],
                              {"num_heads": 2}),
}


@functools.cache
def standard_pair(name):
    model = STANDARD[name]()
    expanded = expand_unclaimed(model, [model.graph.node[0].name or f"{model.graph.node[0].op_type}_0"])
    onnx.checker.check_model(expanded)

    def session(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])

    return model, expanded, session(model), session(expanded)


def _feeds(model, data):
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = data.draw(float_arrays(shape, -3.0, 3.0))
    return feeds


@pytest.mark.parametrize("name", sorted(STANDARD))
@settings(max_examples=10)
@given(data=__import__("hypothesis").strategies.data())
def test_expansion_computes_what_onnxruntime_computes(name, data):
    model, expanded, fused_sess, expanded_sess = standard_pair(name)
    assert model.graph.node[0].op_type not in ops(expanded)
    feeds = _feeds(model, data)
    want = fused_sess.run(None, feeds)[0]
    got = expanded_sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_every_emitted_fused_op_has_an_expansion():
    from host.optimizer.rules import FAMILIES

    emitted = {op for f in FAMILIES for op in f.emits}
    assert emitted <= set(EXPANSIONS), sorted(emitted - set(EXPANSIONS))


def test_expand_leaves_other_nodes_and_unknown_names_alone():
    model = optimize(_linear_relu(), 2).model
    assert expand_unclaimed(model, ["no such node"]) .graph.node[0].op_type == "FusedMatMul"
    relu_model = make_model([helper.make_node("Relu", ["x"], ["y"], name="r")], [("x", [2])], [("y", [2])])
    assert not can_expand("", "Relu")
    assert ops(expand_unclaimed(relu_model, ["r"])) == {"Relu": 1}


def test_expand_rejects_what_is_not_a_model():
    with pytest.raises(InvalidArgument, match="^expand_unclaimed\\(\\) takes an onnx.ModelProto; got str$"):
        expand_unclaimed("model.onnx", [])


def test_expansion_outside_its_forms_names_the_node():
    model = _single("Attention", [("q", [1, 2, 4, 4]), ("k", [1, 2, 4, 4]), ("v", [1, 2, 4, 4])], {"is_causal": 1})
    model.graph.node[0].name = "attn"
    with pytest.raises(ModelError, match="^node 'attn' \\(Attention\\): no EP runs it and its expansion does not "
                                         "cover is_causal=1$"):
        expand_unclaimed(model, ["attn"])


# ---- the session hook ----------------------------------------------------------------------------
def _linear_relu():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="fc/MatMul"),
             helper.make_node("Add", ["mm", "b"], ["z"], name="fc/Add"),
             helper.make_node("Relu", ["z"], ["y"], name="fc/Relu")]
    inits = {"w": RNG.standard_normal((5, 6)).astype(np.float32), "b": RNG.standard_normal(6).astype(np.float32)}
    return make_model(nodes, [("x", [2, 3, 5])], [("y", [2, 3, 6])], inits)


@pytest.fixture
def cpu_ep_without_fused_matmul(monkeypatch):
    """The CPU EP as it would be without a FusedMatMul kernel (helper EPs may not have one either)."""
    monkeypatch.delitem(registry.CPU_KERNELS, ("ai.ephost", "FusedMatMul"), raising=False)
    assert cpu_ep.lookup("ai.ephost", "FusedMatMul", 1) is None


def test_unclaimed_fused_node_runs_unfused(cpu_ep_without_fused_matmul):
    model = _linear_relu()
    assert ops(optimize(model, 99).model) == {"ai.ephost::FusedMatMul": 1}
    x = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    with InferenceSession(model) as sess:
        got = sess.run(None, {"x": x})[0]
        kinds = sorted(n.op_type for n in sess.plan.nodes)
    assert kinds == ["Add", "MatMul", "Relu"]  # the expansion, run by the CPU EP
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_claimed_fused_node_is_kept():
    assert cpu_ep.lookup("ai.ephost", "FusedMatMul", 1) is not None  # the CPU EP claims the fused node
    with InferenceSession(_linear_relu()) as sess:
        assert [n.op_type for n in sess.plan.nodes] == ["FusedMatMul"]


def test_without_the_hook_the_unclaimed_node_is_an_error(cpu_ep_without_fused_matmul, monkeypatch):
    """The hook is what makes the difference (a planted regression: no expansion -> refused model)."""
    from host.runtime.partition import Partitioner

    monkeypatch.setattr(Partitioner, "_expand_unclaimed", lambda self, graph: graph)
    with pytest.raises(ModelError, match="^no execution provider supports 1 node\\(s\\): 'fc/FusedMatMul'"):
        InferenceSession(_linear_relu())


def test_disabled_optimization_never_fuses(cpu_ep_without_fused_matmul):
    so = SessionOptions()
    so.graph_optimization_level = 0
    with InferenceSession(_linear_relu(), so) as sess:
        assert sorted(sess.node_assignment()) == ["fc/Add", "fc/MatMul", "fc/Relu"]
        assert sess.optimization is None
