"""A plain, immutable view of one ONNX node, decoded once at session creation."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import numpy_helper


@dataclass(frozen=True)
class NodeInfo:
    """What a kernel needs to know about its node; attributes are already python values."""

    name: str
    op_type: str
    domain: str
    opset: int  # opset of the node's domain in the model
    attrs: dict = field(default_factory=dict)
    inputs: tuple[str, ...] = ()  # "" marks an absent optional input
    outputs: tuple[str, ...] = ()
    implicit: int = 0  # the last `implicit` inputs are outer-scope values its subgraphs read


def _decode(value):
    """Turns what onnx.helper.get_attribute_value returns into plain python / numpy values."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    # int, float, GraphProto, SparseTensorProto, TypeProto: kept as they are.
    return value


def node_info(node: onnx.NodeProto, opset: int) -> NodeInfo:
    """Builds the NodeInfo of `node`; `opset` is the model's opset for the node's domain."""
    attrs = {a.name: _decode(onnx.helper.get_attribute_value(a)) for a in node.attribute}
    return NodeInfo(
        name=node.name,
        op_type=node.op_type,
        domain=node.domain,
        opset=int(opset),
        attrs=attrs,
        inputs=tuple(node.input),
        outputs=tuple(node.output),
    )

