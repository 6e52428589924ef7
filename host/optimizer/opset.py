"""Converting a model's ai.onnx opset up, through onnx-ir's model API.

onnxscript's `version_converter.convert_version(ModelProto, ...)` copies only the converted graph
back into the proto and keeps the old `opset_import`, so the proto claims the old opset while its
nodes use the new forms (seen on a Llama export; tests/host/optimizer pin it). Converting the
ir.Model in place and serializing that model avoids it.

onnxscript's own converter starts at opset 18; from an older opset it round-trips the whole model
through onnx's C API converter (serialize, convert, deserialize: about 10 ms for a small transformer,
most of what converting costs). When no op of the model has a new version between its opset and 18
that round trip only renumbers the opset, so `convert_opset` renumbers it here (`renumber_to_floor`)
and leaves the rest to onnxscript's converter.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

TARGET_OPSET = 23
# The lowest opset onnxscript's own converter starts from (its SUPPORTED_MIN_ONNX_OPSET); below it the
# C API converts. A copy, so that reading it does not import the converter.
CONVERTER_FLOOR = 18
# onnxscript's C API round trip (version_converter/_c_api_utils.py) takes the initializers of more than
# this many elements out of the model and registers them again afterwards, after the others: the
# renumbering keeps that order, so the optimizer's output does not depend on which path converted.
_C_API_BIG_TENSOR = 1000


def onnx_opset(model: ir.Model) -> int:
    """The model's ai.onnx opset ('' or 'ai.onnx')."""
    imports = model.opset_imports
    return int(imports.get("", imports.get("ai.onnx", 0)))


def convert_opset(model: ir.Model, target: int = TARGET_OPSET) -> bool:
    """Convert `model` in place to ai.onnx `target`; False when that fails (the model is left as it
    was, or at opset 18 when it was renumbered: the same nodes, which mean the same there).

    From opset 18 up onnxscript's own converter does it; below 18 it falls back to the onnx C API,
    unless renumbering to 18 is all that fallback would do (`renumber_to_floor`).
    """
    if onnx_opset(model) >= target:
        return True
    if target >= CONVERTER_FLOOR:
        renumber_to_floor(model)
    # Imported here: most models need no conversion, and a first session should not pay its import.
    from onnxscript.version_converter import ConvertVersionPass

    try:
        ConvertVersionPass(target, fallback=True)(model)
    except Exception:  # noqa: BLE001 - any converter failure means: keep the model's opset
        return False
    return onnx_opset(model) == target


def renumber_to_floor(model: ir.Model) -> bool:
    """Set the model's ai.onnx opset to CONVERTER_FLOOR when no node needs converting on the way:
    every node a plain ai.onnx op without subgraphs whose schema is the same at both opsets, and no
    model-local functions (onnxscript inlines those first). True when renumbered."""
    start = onnx_opset(model)
    if not 0 < start < CONVERTER_FLOOR or set(model.opset_imports) != {""} or model.functions:
        return False
    if not all(_same_schema(node, start) for node in model.graph):
        return False
    model.opset_imports[""] = CONVERTER_FLOOR
    _big_initializers_last(model.graph)
    _drop_metadata(model.graph)
    return True


def _same_schema(node: ir.Node, start: int) -> bool:
    if node.domain not in ("", "ai.onnx") or any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return False
    try:
        before = onnx.defs.get_schema(node.op_type, start).since_version
        return before == onnx.defs.get_schema(node.op_type, CONVERTER_FLOOR).since_version
    except onnx.defs.SchemaError:  # an op unknown at `start`: the C API decides
        return False


def _drop_metadata(graph: ir.Graph) -> None:
    """What onnx's C API converter does not carry over: the metadata of the graph, its nodes and values
    (onnxscript's rewriter and folding record there the rules and constants each came from)."""
    graph.metadata_props.clear()
    values = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        node.metadata_props.clear()
        values += node.outputs
    for value in values:
        value.metadata_props.clear()


def _big_initializers_last(graph: ir.Graph) -> None:
    """The round trip's order: the small initializers stay, the big ones come back after them, first
    those that are graph inputs too (in the inputs' order), then the others (in their own order)."""
    values = list(graph.initializers.values())
    big = {v.name: v for v in values if v.const_value is not None and v.const_value.size > _C_API_BIG_TENSOR}
    inputs = [v for v in graph.inputs if v.name in big and big[v.name] is v]
    order = inputs + [v for v in big.values() if v not in inputs]
    for value in order:
        graph.initializers.pop(value.name)
    for value in order:
        graph.register_initializer(value)
