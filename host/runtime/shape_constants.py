"""Shape values that symbolic shapes make constant, folded into the model before the optimizer.

host/runtime/symbolic_shapes.py follows the small integer tensors a graph computes from `Shape`
(`env`: a list of ints and dim expressions per value). Some are constant for every input shape
(Llama's `head_dim // 2` from `Shape(q)[-1]`, which bounds rotate_half's Slices); the optimizer cannot
see that, and the rotary fusion misses. Others give a Reshape or Expand target whose symbolic entries
are the input's own dims at the same place; written with 0 (Reshape, allowzero=0: copy the dim), -1
(the one dim left) or 1 (Expand: keep the dim), the target becomes a constant and the fusions that
need constant reshapes match, as on a static export.

`find` lists the changes, `apply` makes them on a copy of the model; the removed nodes' inputs die
and the optimizer drops them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from host.runtime.symbolic_rules import known

_INT64 = onnx.TensorProto.INT64


def find(model: onnx.ModelProto, env: dict, shapes: dict, types: dict, symbols: set[str]) -> dict:
    """{"constants": name -> array for node outputs constant at every input shape,
    "targets": (node index, input index) -> array for Reshape / Expand targets made constant,
    "rebased": name -> terms (ints, (input, axis)) for shape vectors read from the graph inputs}."""
    outputs = {o.name for o in model.graph.output}
    constants, targets, rebased = {}, {}, {}
    bindings = _bindings(model)
    for i, node in enumerate(model.graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type == "Constant" or len(node.output) != 1:
            continue
        name = node.output[0]
        value = _constant(env.get(name), shapes.get(name), types.get(name))
        if value is not None:
            if name not in outputs:
                constants[name] = value
            continue
        if node.op_type in ("Reshape", "Expand") and len(node.input) > 1 and node.input[1] not in constants:
            target = _target(node, env.get(node.input[1]), shapes.get(node.input[0]), symbols)
            if target is not None:
                targets[(i, 1)] = target
        terms = _rebased(node, env.get(name), shapes.get(name), types.get(name), bindings)
        if terms is not None and name not in outputs:
            rebased[name] = terms
    found = {"constants": constants, "targets": targets, "rebased": rebased}
    return found if constants or targets or rebased else {}


def _bindings(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """symbol -> (graph input, axis) declaring it; none where Shape has no start/end (opset < 15)."""
    from host.runtime import dims, range_lengths

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 15:
        return {}
    return {sym: places[0] for sym, places in dims.input_symbols(range_lengths._InputMeta.of(model)).items()}


def _rebased(node, value, shape, elem_type, bindings) -> list | None:
    """A 1-D int64 shape vector whose entries are ints or the inputs' own symbols (`[seq]` from
    `Shape(k)[-2]`, Llama's mask slice): read from the graph inputs' shapes instead, so the tensor the
    Shape read keeps one use (the GQA fusion needs that) and the arithmetic dies."""
    if value is None or elem_type != _INT64 or shape != (len(value),) or not 0 < len(value) <= 8:
        return None
    if node.op_type == "Shape" and node.input[0] in {b[0] for b in bindings.values()}:
        return None  # already read from an input
    terms = [t if isinstance(t, int) and not isinstance(t, bool) else bindings.get(t) for t in value]
    if any(t is None for t in terms) or all(isinstance(t, int) for t in terms):
        return None
    return terms


def _constant(value, shape, elem_type) -> np.ndarray | None:
    """value as an int64 array of `shape`, when it is all ints and its type is int64."""
    if value is None or elem_type != _INT64 or shape is None or len(shape) > 1:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    if shape == ():
        return np.array(value[0], np.int64) if len(value) == 1 else None
    return np.array(value, np.int64) if shape[0] == len(value) else None


def _target(node, terms, data, symbols) -> np.ndarray | None:
    """A constant target with the same meaning as `terms` for an input of dims `data`; None where
    some symbolic entry is not the input's own dim (and, for Reshape, more than one is left)."""
    if terms is None or data is None or any(not known(d, symbols) for d in data):
        return None
    if all(isinstance(t, int) for t in terms):
        return None  # already constant (the optimizer folds it)
    if node.op_type == "Expand":
        return _expand_target(terms, data)
    if any(a.name == "allowzero" and a.i for a in node.attribute):
        return None
    out = []
    for i, t in enumerate(terms):
        if isinstance(t, int) and not isinstance(t, bool):
            out.append(t)
        elif i < len(data) and t == data[i]:
            out.append(0)  # allowzero=0: copies the input's dim
        elif known(t, symbols):
            out.append(-1)  # the one dim left: what the element count gives
        else:
            return None
    return np.array(out, np.int64) if out.count(-1) <= 1 else None


def _expand_target(terms, data) -> np.ndarray | None:
    """Expand aligns from the right; a target dim equal to the input's becomes 1 (the input's kept)."""
    pad = len(terms) - len(data)
    if pad < 0:
        return None
    out = []
    for i, t in enumerate(terms):
        d = data[i - pad] if i >= pad else None
        if isinstance(t, int) and not isinstance(t, bool):
            out.append(t)
        elif d is not None and t == d:
            out.append(1)
        else:
            return None
    return np.array(out, np.int64)


def apply(model: onnx.ModelProto, plan: dict) -> None:
    """Make `find`'s changes on `model` (a copy the caller owns)."""
    if not plan:
        return
    g = model.graph
    constants = plan["constants"]
    for (i, k), target in plan["targets"].items():
        name = f"{g.node[i].output[0]}__target"
        g.initializer.append(numpy_helper.from_array(target, name))
        g.node[i].input[k] = name
    rebased = plan["rebased"]
    kept = []
    for n in g.node:
        if len(n.output) == 1 and n.output[0] in rebased:
            kept.extend(_reads(g, n.output[0], rebased[n.output[0]]))
        elif not (len(n.output) == 1 and n.output[0] in constants):
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    for name, value in constants.items():
        g.initializer.append(numpy_helper.from_array(value, name))


def _reads(g: onnx.GraphProto, name: str, terms: list) -> list[onnx.NodeProto]:
    """Nodes computing `name` from the graph inputs' shapes: Shape(input, start=axis, end=axis + 1)
    per symbol, the ints as constants, concatenated."""
    parts, nodes = [], []
    for k, t in enumerate(terms):
        part = name if len(terms) == 1 else f"{name}__part{k}"
        if isinstance(t, int):
            g.initializer.append(numpy_helper.from_array(np.array([t], np.int64), part))
        else:
            nodes.append(onnx.helper.make_node("Shape", [t[0]], [part], start=t[1], end=t[1] + 1))
        parts.append(part)
    if len(terms) > 1:
        nodes.append(onnx.helper.make_node("Concat", parts, [name], axis=0))
    return nodes
