"""Whether the optimizer could change a model at all, read from the proto alone.

Kept apart from host.optimizer.pipeline, which imports onnxscript and onnx-ir (the fusion families'
modules do): a model no pass can change (a single-op test model, a plain Conv / Relu chain) then skips
that import on its first session as well as the passes.
"""

from __future__ import annotations

import onnx

# Each fusion family's (triggers, requires): the op types whose presence means it may fire, and those
# that must all be present as well (host/optimizer/rules/base.py, Family). A copy, so that reading it
# imports no rule module; tests/host/optimizer/test_quick.py checks it against FAMILIES.
FAMILY_TRIGGERS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "QdqToInteger": (frozenset({"DequantizeLinear"}), frozenset({"QuantizeLinear"})),
    "QdqToMatMulNBits": (frozenset({"DequantizeLinear"}), frozenset({"MatMul"})),
    "DynamicQuantMatMul": (frozenset({"DynamicQuantizeLinear"}), frozenset({"MatMulInteger"})),
    "ConvBatchNorm": (frozenset({"BatchNormalization"}), frozenset()),
    "HardSwish": (frozenset({"Clip", "HardSigmoid"}), frozenset()),
    "LayerNormalization": (frozenset({"LayerNormalization", "ReduceMean"}), frozenset()),
    "RMSNormalization": (frozenset({"Pow", "ReduceMean"}), frozenset()),
    "Gelu": (frozenset({"Erf", "Tanh"}), frozenset()),
    "Attention": (frozenset({"Softmax"}), frozenset()),
    "RotaryEmbedding": (frozenset({"Cos", "Neg", "Sin"}), frozenset({"Concat", "Neg", "Slice"})),
    "Attention3D": (frozenset({"Attention"}), frozenset()),
    "Gemm": (frozenset({"MatMul"}), frozenset()),
    "FusedMatMul": (frozenset({"Gemm", "MatMul"}), frozenset()),
    "BiasGelu": (frozenset({"Gelu"}), frozenset()),
    "SkipLayerNormalization": (frozenset({"LayerNormalization"}), frozenset()),
}


# Ops the BASIC rules rewrite or fold whatever their inputs, and the binary ops whose constant operand
# may make them no-ops; with none of these, no constant inputs, no duplicate or dead node and no
# fusion trigger, no pass can change the graph.
_BASIC_CANDIDATES = frozenset({
    "Identity", "Dropout", "Cast", "CastLike", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Flatten",
    "Shape", "Size", "ConstantOfShape", "Constant", "Slice", "Split", "Concat", "Gather",
})
_CONSTANT_SENSITIVE = frozenset({"Add", "Sub", "Mul", "Div", "Min", "Max", "Clip"})


# What one node alone can lose: removal, a no-op, or folding from the declared input shape. (A lone
# Flatten or identity Gather would become a Reshape (rules/views.py); that buys nothing on its own.)
_SINGLE_NODE_CANDIDATES = frozenset({"Identity", "Dropout", "Shape", "Size", "Transpose", "Expand", "Constant"})


def _single_node_is_final(g: onnx.GraphProto, constants: set[str], used: set[str]) -> bool:
    n = g.node[0]
    ins = [i for i in n.input if i]
    if n.domain not in ("", "ai.onnx") or n.op_type in _SINGLE_NODE_CANDIDATES:
        return False
    if (ins and all(i in constants for i in ins)) or not any(o in used for o in n.output):
        return False
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
        return False
    if n.op_type in ("Cast", "CastLike"):
        types = {vi.name: vi.type.tensor_type.elem_type for vi in g.input}
        to = next((a.i for a in n.attribute if a.name == "to"), None)
        target = types.get(n.input[1]) if n.op_type == "CastLike" and len(n.input) > 1 else to
        return types.get(n.input[0]) != target  # a Cast to its own type is removed
    return True


def nothing_to_do(model: onnx.ModelProto) -> bool:
    """A cheap, conservative look at the proto: True only when no pass could change the graph
    (single-op test models and the like skip deserializing and the pass pipeline)."""
    g = model.graph
    if model.functions:
        return False
    constants = {t.name for t in g.initializer}
    used = {name for n in g.node for name in n.input} | {o.name for o in g.output}
    if len(g.node) == 1:
        return _single_node_is_final(g, constants, used)
    present = {n.op_type for n in g.node}
    triggers = set().union(*(t for t, requires in FAMILY_TRIGGERS.values() if requires <= present))
    seen = set()
    for n in g.node:
        if n.domain not in ("", "ai.onnx") or n.op_type in _BASIC_CANDIDATES or n.op_type in triggers:
            return False
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            return False
        ins = [i for i in n.input if i]
        if ins and all(i in constants for i in ins):
            return False  # foldable
        if n.op_type in _CONSTANT_SENSITIVE and any(i in constants for i in ins):
            return False
        if not any(o in used for o in n.output):
            return False  # dead
        key = (n.op_type, tuple(n.input), tuple(a.SerializeToString() for a in n.attribute))
        if key in seen:
            return False  # a common subexpression
        seen.add(key)
    return True
