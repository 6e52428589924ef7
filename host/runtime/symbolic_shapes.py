"""Symbolic shapes ONNX inference leaves unknown, written into a model's value_info before it is optimized.

ONNX shape inference (with data propagation) follows symbolic dims through most ops, but a few patterns
of real exports defeat it and the unknown dim ('unk__N') then spreads through the rest of the graph, so
no later `Shape` is computable from the fed shapes (host/runtime/shape_program.py) and the optimizer's
reshape rule and fusions miss (docs/dynamic_shapes.md):

- `Range(0, seq, 1)` (position ids): its length is the limit (host/runtime/range_lengths.py);
- `Slice(buffer, 0, seq)` of a constant (BERT's and GPT-2's position_ids buffer): the length is
  `Min(seq, N)` for a buffer of N, or `seq` where the slice is taken of a symbolic dim;
- broadcasting two different symbolic dims (`seq` with `Min(seq, 512)`): ONNX gives up; the result is
  their `Max` (a broadcast is valid only where they are equal or one is 1), written as the simpler one
  where one is a `Min` bounding the other;
- `Expand`, `ConstantOfShape`, `Reshape` to a shape computed from symbolic dims, `Concat` along a
  symbolic axis.

`annotate` runs ONNX inference and these rules in turn until nothing changes (each rule's result feeds
ONNX inference of the ops after it), then writes every dim it found (ints or expressions over the
inputs' symbols, host/runtime/dims.py) into value_info, where the optimizer keeps them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import shape_inference

from host.errors import InvalidArgument
from host.runtime import dims, range_lengths, shape_constants
from host.runtime.symbolic_rules import RULES, follow, known

ENABLE_KEY = "session.ephost.symbolic_shapes"  # session config entry: "0" infers Range lengths only
MAX_ROUNDS = 8  # each round adds what the previous one made inferable; real exports settle in 2-4


def enabled(entries: dict[str, str]) -> bool:
    """The session config entry: "1" (default) or "0" (only Range lengths, as before issue 23's
    symbolic shapes: a way back should these rules ever misread a model)."""
    text = entries.get(ENABLE_KEY, "1")
    if text not in ("0", "1"):
        raise InvalidArgument(f"session config '{ENABLE_KEY}' = {text!r}: expected '1' (default: infer "
                              "symbolic shapes) or '0' (Range lengths only)")
    return text == "1"


def annotate(model: onnx.ModelProto, fold: bool = True) -> onnx.ModelProto:
    """`model` with value_info entries for the values whose symbolic dims this can name and, with
    `fold`, the shape values they make constant folded (host/runtime/shape_constants.py); the same
    object when there is nothing to change. Never raises: a model this cannot read is left to the
    loader's checks."""
    symbols = set(dims.input_symbols(range_lengths._InputMeta.of(model)))
    if not symbols:
        return model
    try:
        found, env, shapes, types = _fixed_point(model, symbols)
        plan = shape_constants.find(model, env, shapes, types, symbols) if fold else {}
    except Exception:  # noqa: BLE001 - an annotation is a hint; the loader reports broken models
        return model
    if not found and not plan:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [vi for vi in out.graph.value_info if vi.name not in found]
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept)
    for name, (elem_type, shape) in found.items():
        out.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, list(shape)))
    shape_constants.apply(out, plan)
    return out


def _fixed_point(model: onnx.ModelProto, symbols: set[str]):
    """(name -> (elem type, dims) for each intermediate value whose dims were not all computable after
    plain ONNX inference and are now; the last walk's symbolic values, shapes and element types)."""
    light = _light(model, symbols)
    hints: dict[str, tuple[int, tuple]] = {}
    first = None
    for _ in range(MAX_ROUNDS):
        shapes, types = _infer(light, hints)
        first = first if first is not None else dict(shapes)
        new, env = _refine(model, shapes, types, symbols)
        changed = {k: v for k, v in new.items() if hints.get(k) != v}
        if not changed:
            break
        hints.update(changed)
    graph_io = {vi.name for vi in (*model.graph.input, *model.graph.output)}
    out = {}
    for name, shape in shapes.items():
        if name in graph_io or name not in types or _computable(first.get(name), symbols):
            continue
        if _computable(shape, symbols):
            out[name] = (types[name], shape)
    return out, env, shapes, types


def _computable(shape, symbols) -> bool:
    return shape is not None and all(known(d, symbols) for d in shape)


def _light(model: onnx.ModelProto, symbols: set[str]) -> onnx.ModelProto:
    """A copy without the large weights (typed inputs instead), its value_info keeping only dims that
    are computable: an exporter's stale 'unk__N' would otherwise win over what inference finds."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    g = light.graph
    small = [t for t in g.initializer if np.prod(t.dims, dtype=np.int64) <= 64]
    for t in g.initializer:
        if np.prod(t.dims, dtype=np.int64) > 64:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del g.initializer[:]
    g.initializer.extend(small)
    for vi in g.value_info:
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value") and not known(d.dim_param, symbols):
                d.Clear()
    return light


def _infer(light: onnx.ModelProto, hints: dict) -> tuple[dict[str, tuple], dict[str, int]]:
    proto = onnx.ModelProto()
    proto.CopyFrom(light)
    g = proto.graph
    kept = [vi for vi in g.value_info if vi.name not in hints]
    del g.value_info[:]
    g.value_info.extend(kept)
    for name, (elem_type, shape) in hints.items():
        g.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, list(shape)))
    inferred = shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    shapes, types = {}, {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        types[vi.name] = t.elem_type
        if t.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                    for d in t.shape.dim)
    return shapes, types


def _refine(model: onnx.ModelProto, shapes: dict, types: dict, symbols: set[str]) -> tuple[dict, dict]:
    """One walk over the nodes: the symbolic integer values (range_lengths' env) and, for each output
    whose shape has an unknown dim, what the rule of its op finds."""
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
              if t.data_type in range_lengths._INT_TYPES and np.prod(t.dims, dtype=np.int64) <= 64}
    env: dict[str, list] = {k: [int(x) for x in np.ravel(v)] for k, v in consts.items()}
    scalar = {k for k, v in consts.items() if v.ndim == 0}
    opsets = {o.domain: o.version for o in model.opset_import}
    data = {t.name: t for t in model.graph.initializer if np.prod(t.dims, dtype=np.int64) <= 64}
    out = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant":
            range_lengths._constant(node, env, scalar)
            for a in node.attribute:
                if a.name == "value":
                    data[node.output[0]] = a.t
            continue
        if node.op_type != "Range":
            value = follow(node, env, scalar, shapes)
            if value is not None:
                env[node.output[0]] = value
                if node.op_type in ("Gather", "Squeeze") and range_lengths._is_scalar(node, shapes):
                    scalar.add(node.output[0])
        name = node.output[0] if node.output else ""
        if not name or _computable(shapes.get(name), symbols) or name not in types:
            continue
        rule = RULES.get(node.op_type)
        shape = rule(node, shapes, env, symbols) if rule is not None else None
        if shape is not None and _better(shape, shapes.get(name), symbols):
            out[name] = (types[name], tuple(shape))
            shapes[name] = tuple(shape)  # later nodes of this walk see it
        elif any(x in out for x in node.input):
            # An input's shape changed in this walk: ONNX's inference of this node alone, so that one
            # walk carries a refined dim through every layer (a round per layer otherwise).
            for oname, oshape in _node_inference(node, shapes, types, opsets, data).items():
                oshape = _combine(oshape, shapes.get(oname), symbols)
                if oname in types and _better(oshape, shapes.get(oname), symbols):
                    out[oname] = (types[oname], oshape)
                    shapes[oname] = oshape
    return out, env


def _combine(new: tuple, old, symbols) -> tuple:
    """`new`, with `old`'s known dims where `new` has none (one node's inference knows less than the
    whole graph's: a Split without its sizes)."""
    if old is None or len(old) != len(new):
        return new
    return tuple(n if known(n, symbols) or not known(o, symbols) else o for n, o in zip(new, old))


def _node_inference(node, shapes: dict, types: dict, opsets: dict[str, int], data: dict) -> dict[str, tuple]:
    """ONNX shape inference of one node from the current shapes of its inputs (and the values of its
    small constant inputs); {} where it cannot."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain or "", 1), node.domain or "")
        ins = {x: onnx.helper.make_tensor_type_proto(types[x], shapes.get(x)) for x in node.input if x}
        values = {x: data[x] for x in node.input if x in data}
        result = shape_inference.infer_node_outputs(schema, node, ins, values)
    except Exception:  # noqa: BLE001 - an op ONNX cannot infer alone (unknown input, custom domain)
        return {}
    out = {}
    for name, tp in result.items():
        t = tp.tensor_type
        if tp.HasField("tensor_type") and t.HasField("shape"):
            out[name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return out


def _better(new, old, symbols) -> bool:
    """`new` names more dims than `old` (and contradicts none of its fixed ones)."""
    if old is None:
        return any(known(d, symbols) for d in new)
    if len(new) != len(old):
        return False
    if any(isinstance(o, int) and o != n for o, n in zip(old, new)):
        return False
    return sum(known(d, symbols) for d in new) > sum(known(d, symbols) for d in old)
