"""The element types a model declares, kept through the optimizer.

onnxconverter-common's float16 conversion leaves each `Cast(to=FLOAT)` in place and declares its result
float16 (onnxruntime refuses such a model). ephost follows the declarations, which are what the
converter meant:

- `declared_casts`, before the passes: a float-to-float Cast whose `to` contradicts the declared type
  of its output casts to the declared type; the model is then consistently typed, so the passes see
  one type per value and the fusions match as in any half-precision model;
- `keep_declared_output_types`, after them: a graph output whose type the passes changed anyway gets
  a Cast back to its declared type at the end of the graph.
"""

from __future__ import annotations

import onnx
from onnx import helper

_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                     onnx.TensorProto.DOUBLE})


def declared_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy whose float-to-float Casts cast to the float type their output is declared
    with (value_info or graph output) where `to` says another."""
    g = model.graph
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.value_info, *g.output)
                if vi.type.HasField("tensor_type")}
    wrong = [i for i, n in enumerate(g.node) if n.op_type == "Cast" and n.domain in ("", "ai.onnx")
             and _cast_to(n) in _FLOATS and declared.get(n.output[0]) in _FLOATS
             and declared[n.output[0]] != _cast_to(n)]
    if not wrong:
        return model
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for i in wrong:
        node = fixed.graph.node[i]
        for a in node.attribute:
            if a.name == "to":
                a.i = declared[node.output[0]]
    return fixed


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def keep_declared_output_types(original: onnx.ModelProto, optimized: onnx.ModelProto) -> onnx.ModelProto:
    """`optimized`, with a Cast to the declared type on each graph output whose type differs from the
    one `original` declares (the same proto, changed in place; most models need nothing)."""
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in original.graph.output
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    g = optimized.graph
    for vi in g.output:
        want = declared.get(vi.name)
        if want is None or not vi.type.HasField("tensor_type") or vi.type.tensor_type.elem_type == want:
            continue
        inner = f"{vi.name}__as_computed"
        for node in g.node:
            node.output[:] = [inner if y == vi.name else y for y in node.output]
            node.input[:] = [inner if x == vi.name else x for x in node.input]
        g.node.append(helper.make_node("Cast", [inner], [vi.name], name=f"{vi.name}__declared_type", to=want))
        vi.type.tensor_type.elem_type = want
    return optimized


__all__ = ["declared_casts", "keep_declared_output_types"]
