"""Renumbering an opset-17 model to 18 instead of onnx's C API round trip (host/optimizer/opset.py): the
optimizer's output is the same bytes either way, and models the round trip would change keep it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from host.cli import zoo
from host.optimizer import GraphOptimizationLevel, optimize
from host.optimizer import opset as opset_module
from host.optimizer.opset import CONVERTER_FLOOR, convert_opset, onnx_opset, renumber_to_floor
from tests.host.optimizer.common import make_model

TORCHSCRIPT_BERT = "tests/models/bert_torchscript.onnx"


def _optimized_both_ways(model: onnx.ModelProto, monkeypatch) -> tuple[bytes, bytes, list[bool]]:
    """The optimizer's output with the renumbering, then through the C API alone, and what the
    renumbering answered on the first run."""
    answers = []

    def spy(m):
        answers.append(renumber_to_floor(m))
        return answers[-1]

    monkeypatch.setattr(opset_module, "renumber_to_floor", spy)
    renumbered = optimize(model, GraphOptimizationLevel.ORT_ENABLE_ALL).model.SerializeToString()
    monkeypatch.setattr(opset_module, "renumber_to_floor", lambda m: False)
    c_api = optimize(model, GraphOptimizationLevel.ORT_ENABLE_ALL).model.SerializeToString()
    return renumbered, c_api, answers


def _documented_block() -> onnx.ModelProto:
    """The zoo block with doc strings and metadata on the model, the graph, nodes, values, initializers."""
    model = zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128)
    model.doc_string = model.graph.doc_string = "doc"
    helper.set_model_props(model, {"model": "m"})
    model.graph.metadata_props.add(key="graph", value="g")
    for i, node in enumerate(model.graph.node):
        node.doc_string = f"node {i}"
        node.metadata_props.add(key="node", value=str(i))
    for item in (model.graph.input[0], model.graph.output[0], model.graph.initializer[0]):
        item.doc_string = "doc"
        item.metadata_props.add(key="value", value="v")
    model.graph.value_info.append(helper.make_tensor_value_info(model.graph.node[0].output[0],
                                                                onnx.TensorProto.FLOAT, None, doc_string="doc"))
    return model


def _weights_as_inputs() -> onnx.ModelProto:
    """The zoo block with its big weights also graph inputs (as IR < 4 models list them), reversed."""
    model = zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128)
    big = [t for t in model.graph.initializer if np.prod(t.dims) > 1000]
    assert len(big) > 2
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in reversed(big))
    return model


@pytest.mark.parametrize("build", [
    lambda: zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128),  # initializers over 1000 elements
    lambda: onnx.load(TORCHSCRIPT_BERT),  # folded constants and rewritten nodes carry onnxscript metadata
    _documented_block,  # what the round trip keeps and drops of docs and metadata, at every level
    _weights_as_inputs,  # big initializers listed as graph inputs too, in another order
], ids=["zoo-transformer", "bert-torchscript", "documented", "weights-as-inputs"])
def test_renumbering_gives_the_bytes_of_the_c_api_round_trip(build, monkeypatch):
    renumbered, c_api, answers = _optimized_both_ways(build(), monkeypatch)
    assert answers == [True]
    assert renumbered == c_api


# The other opset-17 fixtures converted for a fusion whose ops are the same at 18 (GPT-2 and Llama have
# ops that changed at 18; MobileNetV3, the recurrent models and the Loop model are not converted at all).
RENUMBERED_FIXTURES = ("tests/models/vit_torchscript.onnx", "tests/models/dynamic_hf/bert_ts.onnx",
                       "tests/models/dynamic_hf/vit_ts.onnx")


@pytest.mark.parametrize("path", RENUMBERED_FIXTURES, ids=lambda p: p.rsplit("/", 1)[-1])
def test_renumbered_fixtures_give_the_bytes_of_the_c_api_round_trip(path, monkeypatch):
    renumbered, c_api, answers = _optimized_both_ways(onnx.load(path), monkeypatch)
    assert answers == [True]
    assert renumbered == c_api


def _reduce_mean_model() -> onnx.ModelProto:
    """ReduceMean has a new version at 18 (axes an input): the C API has to convert it."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Softmax", ["m"], ["y"])]
    return make_model(nodes, [("x", [2, 3, 4])], [("y", [2, 3])])


def test_a_node_that_changes_at_18_keeps_the_c_api_path():
    model = ir.serde.deserialize_model(_reduce_mean_model())
    assert not renumber_to_floor(model) and onnx_opset(model) == 17
    assert convert_opset(model, 23) and onnx_opset(model) == 23
    reduce = next(n for n in model.graph if n.op_type == "ReduceMean")
    assert len(reduce.inputs) == 2 and "axes" not in reduce.attributes  # converted, not renumbered


def _if_model() -> onnx.ModelProto:
    branch = helper.make_graph([helper.make_node("Relu", ["x"], ["r"])], "b", [],
                               [helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Softmax", ["x"], ["s"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
    float2 = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])]
    graph = helper.make_graph(nodes, "g", float2, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _contrib_model() -> onnx.ModelProto:
    model = make_model([helper.make_node("Softmax", ["x"], ["y"])], [("x", [2])], [("y", [2])])
    model.graph.node.append(helper.make_node("Gelu", ["y"], ["z"], domain="com.microsoft"))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _unknown_op_model() -> onnx.ModelProto:
    """Gelu is an ai.onnx op from opset 20: at 17 it has no schema (onnx's converter decides)."""
    x, y = (helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in ("x", "y"))
    graph = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("build", [_if_model, _contrib_model, _unknown_op_model,
                                   lambda: make_model([helper.make_node("Softmax", ["x"], ["y"])], [("x", [2])],
                                                      [("y", [2])], opset=18)],
                         ids=["subgraph", "other-domain", "no-schema-at-17", "already-18"])
def test_models_the_renumbering_leaves_to_the_converter(build):
    model = ir.serde.deserialize_model(build())
    before = onnx_opset(model)
    assert not renumber_to_floor(model)
    assert onnx_opset(model) == before


def test_renumbering_moves_big_initializers_last_and_drops_metadata():
    big, small = np.zeros(CONVERTER_FLOOR * 100, np.float32), np.ones(3, np.float32)
    nodes = [helper.make_node("Add", ["x", "big"], ["a"]), helper.make_node("Softmax", ["a"], ["y"])]
    model = ir.serde.deserialize_model(make_model(nodes, [("x", [big.size])], [("y", [big.size])],
                                                  {"big": big, "small": small}))
    node = next(iter(model.graph))
    node.metadata_props["pkg.onnxscript.rewriter.rule_name"] = "X"
    node.outputs[0].metadata_props["pkg.onnxscript.optimizer.folded_from"] = "['c']"
    assert renumber_to_floor(model) and onnx_opset(model) == CONVERTER_FLOOR
    assert list(model.graph.initializers) == ["small", "big"]
    assert not node.metadata_props and not node.outputs[0].metadata_props
