"""A GraphSpec straight from an ONNX model (what the host hands a plugin), for tests and benchmarks.

Imports `onnx` when called: the plugin itself never needs it.
"""

from __future__ import annotations

from abi.sdk import GraphSpec, NodeSpec, ValueSpec

_KIND_INTERMEDIATE, _KIND_INPUT, _KIND_OUTPUT, _KIND_INITIALIZER = 0, 1, 2, 3


def _shape(type_proto):
    t = type_proto.tensor_type
    if not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)


def spec_from_onnx(model) -> GraphSpec:
    """Every value and node of `model` (after ONNX shape inference) as the SDK's GraphSpec."""
    import onnx
    from onnx import numpy_helper

    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    values: list = []
    index: dict = {}

    def add(name, elem_type, shape, kind, const=None):
        index[name] = len(values)
        values.append(ValueSpec(name, elem_type, shape, kind, const))

    inits = {t.name for t in g.initializer}
    for t in g.initializer:
        arr = numpy_helper.to_array(t)
        add(t.name, t.data_type, tuple(arr.shape), _KIND_INITIALIZER, arr)
    outputs = {o.name for o in g.output}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name in index or vi.name in inits:
            continue
        kind = _KIND_INPUT if vi in g.input else _KIND_OUTPUT if vi.name in outputs else _KIND_INTERMEDIATE
        add(vi.name, vi.type.tensor_type.elem_type, _shape(vi.type), kind)
    nodes = []
    for i, n in enumerate(g.node):
        for name in list(n.input) + list(n.output):
            if name and name not in index:
                add(name, 0, None, _KIND_OUTPUT if name in outputs else _KIND_INTERMEDIATE)
        attrs = {}
        for a in n.attribute:
            v = onnx.helper.get_attribute_value(a)
            if isinstance(v, bytes):
                v = v.decode()
            elif isinstance(v, onnx.TensorProto):
                v = numpy_helper.to_array(v)
            elif isinstance(v, list):
                v = [x.decode() if isinstance(x, bytes) else x for x in v]
            attrs[a.name] = v
        if n.op_type == "Constant":
            raise ValueError(f"node '{n.name}' is a Constant node; fold constants into initializers first")
        nodes.append(NodeSpec(i, n.name or f"{n.op_type}_{i}", n.op_type, n.domain, opsets.get(n.domain or "", 1),
                              tuple(index[x] if x else -1 for x in n.input),
                              tuple(index[x] if x else -1 for x in n.output), attrs))
    spec = GraphSpec(nodes, values)
    spec.inputs = [values[index[vi.name]] for vi in g.input if vi.name not in inits]
    spec.outputs = [values[index[vi.name]] for vi in g.output]
    return spec
