"""Whether a model treats the rows of its batch axis independently: the static check behind batch buckets.

Padding the batch axis (docs/dynamic_shapes.md, "CUDA graphs per shape and buckets") is only exact
when no op mixes rows: a reduction over axis 0, a transpose moving it, a reshape merging it with
another axis, a MatMul contracting it, a Gather picking rows, or the batch size read as data. The
check is conservative: it runs ONNX shape inference (with data propagation, so reshapes to computed
shapes keep their symbolic dims), follows the values whose dim 0 is the batch symbol, and accepts a
node only when its op is in the tables below and its axes leave dim 0 alone; anything else is a
refusal naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

# Ops that compute each output element from the same position of their (broadcast) inputs.
ELEMENTWISE = frozenset("""
Abs Acos Acosh Add And Asin Asinh Atan Atanh BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Cast CastLike
Ceil Celu Clip Cos Cosh Div Dropout Elu Equal Erf Exp Expand Floor Gelu Greater GreaterOrEqual HardSigmoid
HardSwish Identity IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Mean Min Mish Mod Mul Neg Not Or PRelu Pow
QuantizeLinear DequantizeLinear Reciprocal Relu Round Selu Shrink Sigmoid Sign Sin Sinh Softplus Softsign Sqrt
Sub Sum Tan Tanh ThresholdedRelu Where Xor
""".split())
# Ops over axis 0 as N (images, channels first): each sample on its own.
PER_SAMPLE = frozenset("""
AveragePool Conv ConvTranspose GlobalAveragePool GlobalLpPool GlobalMaxPool GroupNormalization
InstanceNormalization LpPool MaxPool
""".split())
# Ops that change the rank; the net (dim 0 in = dim 0 out) decides.
RESHAPING = frozenset({"Reshape", "Flatten", "Unsqueeze", "Squeeze"})
# Ops with an axis attribute (and its default) that must not be 0.
AXIS_OPS = {"Softmax": -1, "LogSoftmax": -1, "Hardmax": -1, "LayerNormalization": -1, "LpNormalization": -1,
            "TopK": -1, "ArgMax": 0, "ArgMin": 0, "Concat": None, "Split": 0, "GatherElements": 0}
REDUCE_OPS = frozenset("""
ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare
""".split())
# Where a shape vector may end up: the sizes of a Reshape, Expand, ConstantOfShape or Tile.
SHAPE_SINKS = {("Reshape", 1), ("Expand", 1), ("ConstantOfShape", 0), ("Tile", 1)}
SHAPE_FLOW = frozenset({"Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Identity"})


def refusal(model: onnx.ModelProto, batch: str) -> str | None:
    """Why padding `batch` (the symbol of the inputs' dim 0) would change `model`'s results, or None."""
    try:
        model = shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises several kinds; the check then cannot vouch
        return f"the model cannot be checked (ONNX shape inference failed: {type(exc).__name__}: {exc})"
    g = model.graph
    dims = _dims(g)
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))
    for n in g.node:
        why = _node_refusal(n, dims, consts, consumers, batch)
        if why is not None:
            return f"node '{n.name or n.output[0]}' ({n.op_type}) {why}"
    return None


def _dims(g) -> dict[str, list | None]:
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        out[vi.name] = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim] \
            if t.HasField("shape") else None
    for t in g.initializer:
        out[t.name] = list(t.dims)
    return out


def _carries(dims, name: str, batch: str) -> bool:
    d = dims.get(name)
    return bool(name) and d is not None and len(d) > 0 and d[0] == batch


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _node_refusal(n, dims, consts, consumers, batch: str) -> str | None:
    ins = [i for i in n.input if _carries(dims, i, batch)]
    if n.op_type in ("Shape", "Size"):
        if not ins or (n.op_type == "Shape" and _shape_skips_batch(n, dims)):
            return None
        return _size_leak(n.output[0], consts, consumers, dims)
    if not ins:
        return None  # weights and sizes; a batch dim produced from sizes was checked where the size went
    if n.op_type in ("If", "Loop", "Scan"):
        return "has a subgraph; batch buckets do not look inside control flow"
    for out in n.output:
        if out and not _carries(dims, out, batch):
            return (f"takes the batch axis in but its output '{out}' does not carry it as dim 0 "
                    f"(shape {dims.get(out)}): it mixes or drops batch rows")
    rank = len(dims[n.output[0]])
    return _op_refusal(n, dims, consts, batch, rank)


def _op_refusal(n, dims, consts, batch: str, rank: int) -> str | None:
    op = n.op_type
    if op in RESHAPING:
        return None  # dim 0 in and out is the batch: row i stays row i in row-major order
    if op == "MatMul":
        return _matmul(n, dims, batch, rank)
    if op == "Gemm":
        if _carries(dims, n.input[1], batch) or _attr(n, "transA", 0):
            return "contracts the batch axis"
        return None
    if op == "Gather":
        return _gather(n, dims, batch)
    misaligned = [i for i in n.input if _carries(dims, i, batch) and len(dims[i]) != rank]
    if misaligned:
        return f"broadcasts '{misaligned[0]}' so that its batch axis is not the output's dim 0"
    if op in ELEMENTWISE or op in PER_SAMPLE:
        return None
    if op == "BatchNormalization":
        return "computes batch statistics (training_mode=1)" if _attr(n, "training_mode", 0) else None
    if op == "Transpose":
        perm = _attr(n, "perm")
        return None if perm and perm[0] == 0 else "moves the batch axis away from dim 0"
    if op in AXIS_OPS:
        axis = _attr(n, "axis", AXIS_OPS[op])
        return None if axis is not None and axis % rank != 0 else "works along the batch axis"
    if op in REDUCE_OPS or op in ("Slice", "CumSum", "Pad", "Tile"):
        return _axes_input_refusal(n, consts, rank)
    return "is not known to keep batch rows independent"


def _matmul(n, dims, batch: str, rank: int) -> str | None:
    a, b = n.input[0], n.input[1]
    if _carries(dims, a, batch) and len(dims[a]) != rank:
        return "contracts the batch axis (a 1-D left operand)"
    if _carries(dims, b, batch) and (len(dims[b]) != rank or rank < 3):
        return "contracts the batch axis (it is the right operand's row axis)"
    return None


def _gather(n, dims, batch: str) -> str | None:
    axis = _attr(n, "axis", 0)
    data, indices = n.input[0], n.input[1]
    if _carries(dims, data, batch):
        if axis % len(dims[data]) == 0 or _carries(dims, indices, batch):
            return "selects along the batch axis"
        return None
    return None if axis == 0 else "puts the indices' batch axis away from dim 0"


def _axes_input_refusal(n, consts, rank: int) -> str | None:
    """ReduceX, Slice, CumSum, Pad, Tile: the axes (or per-axis amounts) they touch must leave axis 0."""
    op = n.op_type
    if op == "Pad":
        pads = consts.get(n.input[1]) if len(n.input) > 1 else _attr(n, "pads")
        axes = consts.get(n.input[3]) if len(n.input) > 3 and n.input[3] else np.arange(rank)
        if pads is None or axes is None:
            return "pads axes that are not constant"
        pads = np.asarray(pads).reshape(2, -1)
        touched = [int(a) % rank for a, lo, hi in zip(np.asarray(axes), pads[0], pads[1]) if lo or hi]
    elif op == "Tile":
        reps = consts.get(n.input[1])
        if reps is None:
            return "repeats by a count that is not constant"
        touched = [a for a, r in enumerate(np.asarray(reps)) if r != 1]
    else:
        touched = _axes(n, consts, rank)
        if touched is None:
            return "works along axes that are not constant"
    return "works along the batch axis" if 0 in touched else None


def _axes(n, consts, rank: int) -> list[int] | None:
    op = n.op_type
    if op == "CumSum":
        axis = consts.get(n.input[1])
        return None if axis is None else [int(axis) % rank]
    if op == "Slice":
        axes = consts.get(n.input[3]) if len(n.input) > 3 and n.input[3] else None
        if axes is None:
            starts = consts.get(n.input[1])
            return None if starts is None else list(range(len(np.asarray(starts))))
        return [int(a) % rank for a in np.asarray(axes)]
    axes = _attr(n, "axes")
    if axes is None and len(n.input) > 1 and n.input[1]:
        axes = consts.get(n.input[1])
        if axes is None:
            return None
    if axes is None or len(np.asarray(axes)) == 0:
        return [] if _attr(n, "noop_with_empty_axes", 0) else list(range(rank))
    return [int(a) % rank for a in np.asarray(axes)]


def _shape_skips_batch(n, dims) -> bool:
    start = _attr(n, "start", 0)
    rank = len(dims[n.input[0]])
    return start % rank != 0 if start < 0 else start >= 1


def _size_leak(start: str, consts, consumers, dims) -> str | None:
    """Follow a shape vector holding the batch size through shape arithmetic; it may only size a tensor."""
    todo, seen = [start], set()
    while todo:
        value = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        for node, slot in consumers.get(value, []):
            if (node.op_type, slot) in SHAPE_SINKS:
                continue
            if node.op_type not in SHAPE_FLOW:
                return (f"reads the batch size, which reaches node '{node.name or node.output[0]}' "
                        f"({node.op_type}) as data: padding would change what it computes")
            if not _drops_dim0(node, slot, consts):
                todo += [o for o in node.output if o]
    return None


def _drops_dim0(node, slot: int, consts) -> bool:
    """A Gather or Slice of a shape vector with constant indices that leave element 0 out."""
    if slot != 0:
        return False
    if node.op_type == "Gather":
        idx = consts.get(node.input[1])
        return idx is not None and bool(np.all(np.asarray(idx) > 0))
    if node.op_type == "Slice":
        starts = consts.get(node.input[1])
        return starts is not None and bool(np.all(np.asarray(starts) > 0))
    return False
