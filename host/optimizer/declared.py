"""Graph outputs keep the element types the model declares, through the optimizer.

A model whose declared types contradict its ops (onnxconverter-common leaves `Cast(to=FLOAT)` in place
and declares its result float16; onnxruntime refuses such a model) comes out of onnx-ir's passes with
its outputs retyped as the ops compute them. The declaration is the contract with the caller, so each
output whose type changed gets a Cast back to its declared type at the end of the graph.
"""

from __future__ import annotations

import onnx
from onnx import helper


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


__all__ = ["keep_declared_output_types"]
