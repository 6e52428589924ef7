"""Passes that must know about subgraphs (the bodies of If, Loop, Scan, SequenceMap).

onnx-ir's IdentityEliminationPass (1.1) walks subgraphs too, but when a subgraph's output is
`y = Identity(x)` with `x` made in an enclosing graph (an If branch that hands back an outer
value, as exporters write for PyTorch's `if` on tensors), it tries to make `x` an output of the
subgraph and raises "Value ... is already an output of a different graph", and the whole model
then ran unoptimized. `eliminate_identities` is the same rewrite with that case (and an output
that is already an output of its graph) left alone: such an Identity is the subgraph's way of
naming an outer value as its output, and must stay.
"""

from __future__ import annotations

import onnx_ir as ir


def _removable(node: ir.Node) -> bool:
    if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) != 1 or len(node.outputs) != 1 or node.inputs[0] is None:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if not y.is_graph_output():
        return True
    if x.is_graph_input() or x.is_initializer() or x.is_graph_output():
        return False
    producer = x.producer()
    return producer is not None and producer.graph is node.graph  # an outer value keeps its Identity


def _eliminate(node: ir.Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    if x.shape is None:
        x.shape = y.shape
    if x.type is None:
        x.type = y.type
    is_output = y.is_graph_output()
    ir.convenience.replace_all_uses_with(y, x, replace_graph_outputs=True)
    if is_output:
        x.name = y.name  # the graph keeps its output's name
    node.graph.remove(node, safe=True)


def eliminate_identities(model: ir.Model) -> bool:
    """Remove Identity nodes in the graph, its subgraphs and functions, except those a subgraph
    needs to output an outer value (or an input or initializer) under its own name."""
    modified = False
    for graph in (model.graph, *model.functions.values()):
        for node in list(ir.traversal.RecursiveGraphIterator(graph)):
            if _removable(node):
                _eliminate(node)
                modified = True
    return modified


__all__ = ["eliminate_identities"]
