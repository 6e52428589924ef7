"""Rules built by the op types present (Family.by_trigger): only the forms that can match, and still every
form that can, subgraphs included. The optimizer's output on the zoo and tests/models is unchanged
(checked by comparing node lists before/after, docs/cli.md#start-up-time)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from host.optimizer import GraphOptimizationLevel, optimize
from host.optimizer.rules.gelu import GELU
from tests.host.optimizer.test_fusions import _gelu_erf_model, _gelu_tanh_model


def _names(ops) -> list[str]:
    return [r.name for r in GELU.rule_sets(frozenset(ops))[-1].rules]


def test_gelu_builds_the_rules_of_the_forms_present_and_all_of_them_with_both():
    erf, tanh, both = _names({"Erf"}), _names({"Tanh", "MatMul"}), _names({"Erf", "Tanh"})
    assert erf and tanh
    assert {n.split("_")[1] for n in erf} == {"none"} and {n.split("_")[1] for n in tanh} == {"tanh"}
    assert both == erf + tanh  # the order of the whole set kept


def _renamed(graph: onnx.GraphProto, suffix: str) -> onnx.GraphProto:
    """A copy of `graph` as an If branch: no inputs, every name but the outer `x` suffixed."""
    g = onnx.GraphProto()
    g.CopyFrom(graph)

    def rename(name: str) -> str:
        return name if name in ("x", "") else name + suffix

    for n in g.node:
        n.input[:] = [rename(i) for i in n.input]
        n.output[:] = [rename(o) for o in n.output]
    for t in g.initializer:
        t.name = rename(t.name)
    for o in g.output:
        o.name = rename(o.name)
    del g.input[:]
    return g


def test_a_gelu_form_only_inside_an_if_branch_is_fused_too():
    """The tanh form at the top, the exact (Erf) form only in a branch: both rule groups are built."""
    model = _gelu_tanh_model(False, "x")
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y_e"])], "else", [],
                              [helper.make_tensor_value_info("y_e", TensorProto.FLOAT, [3, 8])])
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=_renamed(
        _gelu_erf_model("x", False, False).graph, "_b"), else_branch=other))
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 8]))
    onnx.checker.check_model(model)
    out = optimize(model, GraphOptimizationLevel.ORT_ENABLE_EXTENDED).model
    branch = next(a.g for n in out.graph.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch")
    assert [n.op_type for n in out.graph.node] == ["Gelu", "If"]
    assert [n.op_type for n in branch.node] == ["Gelu"]
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        for want, got in zip(ReferenceEvaluator(model).run(None, feeds), ReferenceEvaluator(out).run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _layer_norm_names(ops) -> list[str]:
    from host.optimizer.rules.layer_norm import LAYER_NORM

    return [r.name for r in LAYER_NORM.rule_sets(frozenset(ops))[-1].rules]


def test_layer_norm_builds_the_decomposition_rules_only_with_a_reduce_mean():
    """Without ReduceMean (a model that exports LayerNormalization) the decomposition cannot match: only
    the bias rules are built; with it, all of them in their order."""
    from host.optimizer.rules.layer_norm import layer_norm_rules

    bias_only, everything = _layer_norm_names({"LayerNormalization", "Add"}), _layer_norm_names({"ReduceMean"})
    assert bias_only and len(everything) > len(bias_only)
    assert everything == [r.name for r in layer_norm_rules()]  # the whole set, as before
    assert everything[-len(bias_only):] == bias_only


def test_an_exported_layer_normalization_still_takes_its_bias_add():
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Add", ["n", "beta"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8])
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), n) for n in ("gamma", "beta")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)])
    out = optimize(model, GraphOptimizationLevel.ORT_ENABLE_EXTENDED).model
    assert [n.op_type for n in out.graph.node] == ["LayerNormalization"]
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(ReferenceEvaluator(out).run(None, feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)
