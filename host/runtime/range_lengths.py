"""Symbolic lengths of Range outputs, written into a model's value_info before it is optimized.

ONNX shape inference gives `Range(0, seq, 1)` an unknown length ('unk__0') even when `seq` is a
Gather of a Shape: it reads constant inputs only. Exported transformers build their position ids that
way, and the unknown length then spreads through every broadcast with the embeddings, so no later
Shape node could be computed from the input shapes (host/runtime/shape_program.py). Here the integer
shape values are followed symbolically (Shape, Gather, Slice, Concat, Unsqueeze, Squeeze, Cast,
Identity, Add, Sub, Mul) and each Range(0, limit, 1) with a symbolic limit gets the length `limit`, as a dim expression over the inputs' symbols (host/runtime/dims.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from host.runtime import dims

_INT_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}


def annotate(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with a value_info entry for each Range whose length this can name; the same object when
    there is nothing to add. Never raises: a model this cannot read is left to the loader's checks."""
    if not any(n.op_type == "Range" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return model
    try:
        lengths = _range_lengths(model)
    except Exception:  # noqa: BLE001 - an annotation is a hint; the loader reports broken models
        return model
    if not lengths:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    known = {vi.name for vi in out.graph.value_info}
    for name, (elem_type, length) in lengths.items():
        if name in known:
            _set_length(out, name, length)
        else:
            out.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, [length]))
    return out


def _set_length(model: onnx.ModelProto, name: str, length) -> None:
    for vi in model.graph.value_info:
        if vi.name == name:
            dim = vi.type.tensor_type.shape.dim
            del dim[:]
            d = dim.add()
            if isinstance(length, int):
                d.dim_value = length
            else:
                d.dim_param = length


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """name -> dims (int, str or None) after ONNX inference on a copy without the large weights."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    g = light.graph
    kept = [t for t in g.initializer if np.prod(t.dims, dtype=np.int64) <= 64]
    for t in g.initializer:
        if np.prod(t.dims, dtype=np.int64) > 64:  # shapes only: a weight becomes a typed input
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del g.initializer[:]
    g.initializer.extend(kept)
    inferred = shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    out = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return out


def _range_lengths(model: onnx.ModelProto) -> dict[str, tuple[int, object]]:
    shapes = _shapes(model)
    symbols = set(dims.input_symbols(_InputMeta.of(model)))
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type in _INT_TYPES
              and np.prod(t.dims, dtype=np.int64) <= 64}
    env: dict[str, list] = {k: [int(x) for x in np.ravel(v)] for k, v in consts.items()}
    scalar = {k for k, v in consts.items() if v.ndim == 0}
    out = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant":
            _constant(node, env, scalar)
            continue
        if node.op_type == "Range":
            length = _range_length(node, env, shapes, symbols)
            if length is not None:
                out[node.output[0]] = (onnx.TensorProto.INT64, length)
            continue
        value = _follow(node, env, scalar, shapes)
        if value is not None:
            env[node.output[0]] = value
            if node.op_type in ("Gather", "Squeeze") and _is_scalar(node, shapes):
                scalar.add(node.output[0])
    return out


def _is_scalar(node, shapes) -> bool:
    return shapes.get(node.output[0]) == ()


def _constant(node, env, scalar) -> None:
    for a in node.attribute:
        if a.name == "value" and a.t.data_type in _INT_TYPES:
            arr = numpy_helper.to_array(a.t)
            if arr.size <= 64:
                env[node.output[0]] = [int(x) for x in np.ravel(arr)]
                if arr.ndim == 0:
                    scalar.add(node.output[0])


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _follow(node, env, scalar, shapes) -> list | None:
    """The symbolic value (a list of dim terms) of the node's first output, or None."""
    op, ins = node.op_type, list(node.input)
    if op == "Shape":
        shape = shapes.get(ins[0])
        if shape is None:
            return None
        start, end = _attr(node, "start", 0), _attr(node, "end", None)
        return [d if d is not None else None for d in shape[slice(start, end)]]
    args = [env.get(x) for x in ins if x]
    if any(a is None for a in args):
        return None
    if op == "Gather" and _attr(node, "axis", 0) == 0 and len(args) == 2:
        return [args[0][i] for i in args[1]]
    if op in ("Unsqueeze", "Squeeze", "Identity", "Cast"):
        return args[0]
    if op == "Concat":
        return [t for a in args for t in a]
    if op == "Slice" and len(args) >= 3 and all(len(a) == 1 for a in args[1:]):
        if len(args) > 3 and args[3] != [0]:
            return None
        step = args[4][0] if len(args) > 4 else 1
        return args[0][slice(args[1][0], args[2][0], step)]
    fn = {"Add": dims.term_add, "Sub": dims.term_sub, "Mul": dims.term_mul}.get(op)
    if fn is not None and len(args) == 2 and (len(args[0]) == len(args[1]) or 1 in (len(args[0]), len(args[1]))):
        n = max(len(args[0]), len(args[1]))
        a, b = (x * n if len(x) == 1 else x for x in args)
        if any(t is None for t in (*a, *b)):
            return None
        return [fn(x, y) for x, y in zip(a, b)]
    return None


def _range_length(node, env, shapes, symbols: set[str]):
    """limit - start for Range(start, limit, 1), when it is an int or an expression over `symbols`."""
    current = shapes.get(node.output[0])
    if current is not None and len(current) == 1 and dims.compile_dim(current[0], symbols) is not None:
        return None  # inference already knows it
    start, limit, delta = (env.get(x) for x in node.input)
    if start is None or limit is None or delta != [1] or len(start) != 1 or len(limit) != 1:
        return None
    length = dims.term_sub(limit[0], start[0])
    if isinstance(length, int):
        return length if length >= 0 else None
    # A symbolic length limit - start is sound only where it cannot be negative: Range(0, dim), the
    # exporters' position ids (a dim is never negative), or a sum or product of dims and whole numbers.
    # A '-' (a Sub, a negative constant) can make it negative, where Range gives an empty output.
    if start[0] != 0 or "-" in length:
        return None
    return length if dims.compile_dim(length, symbols) is not None else None


class _InputMeta:
    """name and shape of a graph input, as dims.input_symbols reads them."""

    def __init__(self, name: str, shape: tuple | None):
        self.name, self.shape = name, shape

    @classmethod
    def of(cls, model: onnx.ModelProto) -> list[_InputMeta]:
        inits = {t.name for t in model.graph.initializer}
        out = []
        for vi in model.graph.input:
            t = vi.type.tensor_type
            if vi.name in inits or not t.HasField("shape"):
                continue
            out.append(cls(vi.name, tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                          for d in t.shape.dim)))
        return out
