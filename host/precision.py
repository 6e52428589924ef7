"""Converting a float32 model to float16 or bfloat16 (`ephost convert --precision fp16|bf16`).

What onnxconverter-common's `convert_float_to_float16` does, for both half types, with two fixes:
every `Cast`/`CastLike` target and `dtype` attribute that names float32 is converted with the values
(onnxconverter-common leaves `Cast(to=FLOAT)` in place and declares its output float16, a model that
onnxruntime refuses to load), and a node whose op's schema does not admit the half type at the model's
opset (many ops admit bfloat16 only since opset 13) stays in float32 like a blocked op.

- Every float32 value (graph inputs and outputs, initializers, node outputs, tensor attributes) becomes
  the half type, except around the ops of the block list, which run in float32 between Casts: their
  results are numerically sensitive or their kernels exist only in float32 (ONNX Runtime's list,
  `DEFAULT_OP_BLOCK_LIST`). An initializer that only blocked ops read stays float32.
- `keep_io_types=True` keeps float32 graph inputs and outputs, with Casts at the edges.
- float16 has a narrow range (max 65504): finite float32 initializers beyond it are clipped to it, as
  the attention masks' `finfo(float32).min` must stay finite; bfloat16 has float32's exponent but not
  its largest values (`finfo(float32).max` rounds to infinity in bfloat16), so it is clipped too, to
  bfloat16's largest finite value.
- Graphs with subgraphs (If, Loop, Scan) are refused: their bodies are not converted yet.
- bfloat16 is admitted by Conv, Sin, Cos, GlobalAveragePool and others only since opset 22: where
  nodes would stay float32 for that reason alone, the model's default opset is first raised to 22 by
  onnx's version converter (`upgrade_opset`, on by default), so a bfloat16 CNN is bfloat16 throughout
  instead of float32 between Casts at every convolution. A model the converter cannot raise is
  converted at its own opset, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from abi.dtypes import BFLOAT16, FLOAT16, to_numpy
from host.errors import InvalidArgument, ModelError

FLOAT = TensorProto.FLOAT
PRECISIONS = {"fp16": FLOAT16, "bf16": BFLOAT16}

# onnxruntime.transformers.float16 / onnxconverter_common.float16 DEFAULT_OP_BLOCK_LIST: ops kept in
# float32 (ML ops with float-only kernels, index-producing or range-sensitive ops).
DEFAULT_OP_BLOCK_LIST = frozenset({
    "ArrayFeatureExtractor", "Binarizer", "CastMap", "CategoryMapper", "DictVectorizer", "FeatureVectorizer",
    "Imputer", "LabelEncoder", "LinearClassifier", "LinearRegressor", "Normalizer", "OneHotEncoder",
    "RandomUniformLike", "SVMClassifier", "SVMRegressor", "Scaler", "TreeEnsembleClassifier",
    "TreeEnsembleRegressor", "ZipMap", "NonMaxSuppression", "TopK", "RoiAlign", "Resize", "Range", "CumSum",
    "Min", "Max", "Upsample",
})
# Attributes that name an element type the node produces.
_TYPE_ATTRS = ("to", "dtype", "output_dtype", "output_datatype")
# Ops kept in float32 whatever the block list says: BitCast reinterprets the bits of its input's type.
_ALWAYS_FLOAT32 = frozenset({"BitCast"})
# The largest finite value of each half type: finite float32 constants beyond it are clipped to it
# (an attention mask's finfo(float32).min must not become -inf, whose product with 0 is NaN).
# The opset from which the ops that took bfloat16 last (Conv, the trigonometric and pooling ops) admit it.
HALF_OPSET = 22
_HALF_MAX = {FLOAT16: float(np.finfo(np.float16).max), BFLOAT16: float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)}


def convert_precision(model: onnx.ModelProto, precision: str, keep_io_types: bool = False,
                      op_block_list: Iterable[str] | None = None, upgrade_opset: bool = True) -> onnx.ModelProto:
    """A copy of float32 `model` with its float32 values in `precision` ('fp16' or 'bf16').
    `upgrade_opset`: raise the default opset to HALF_OPSET where that lets more nodes take the half type."""
    if precision not in PRECISIONS:
        raise InvalidArgument(f"precision is {precision!r}; allowed: {', '.join(repr(p) for p in PRECISIONS)}")
    half = PRECISIONS[precision]
    blocked_ops = DEFAULT_OP_BLOCK_LIST if op_block_list is None else frozenset(op_block_list)
    out = onnx.ModelProto()
    out.CopyFrom(_upgraded(model, half, blocked_ops) if upgrade_opset else model)
    g = out.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        raise ModelError("convert: the model has control-flow subgraphs (If, Loop, Scan); converting their "
                         "bodies is not supported yet; supported: graphs without subgraphs")
    types = _value_types(out)
    del g.value_info[:]  # stale types once values change type: inference recomputes them
    opsets = {(o.domain or ""): o.version for o in out.opset_import}
    blocked = {i for i, n in enumerate(g.node)
               if n.op_type in blocked_ops or n.op_type in _ALWAYS_FLOAT32 or not _admits(n, half, opsets)}
    blocked |= angle_nodes(g, types)
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for x in n.input:
            readers.setdefault(x, []).append(i)
    keep_inits = {t.name for t in g.initializer if t.data_type == FLOAT
                  and readers.get(t.name) and all(r in blocked for r in readers[t.name])}
    _convert_initializers(g, half, keep_inits)
    nodes, float32_names, wide_of = [], set(keep_inits), {}
    for i, n in enumerate(g.node):
        if i in blocked:
            nodes += _blocked_node(n, types, half, keep_inits, float32_names, wide_of)
        else:
            _retype_attributes(n, half)
            nodes.append(n)
    del g.node[:]
    g.node.extend(_without_unread_casts(nodes, g, wide_of))
    first, last = _retype_io(g, half, keep_io_types)
    nodes = [*first, *g.node, *last]
    del g.node[:]
    g.node.extend(nodes)
    float32_names.update(n.output[0] for n in last)  # keep_io_types: the float32 graph outputs
    _cast_float_results(out, half, float32_names)
    try:
        onnx.checker.check_model(out)
        return onnx.shape_inference.infer_shapes(out, strict_mode=True)
    except Exception as exc:  # noqa: BLE001 - checker and inference raise several types
        raise ModelError(f"convert: the {precision} model is not valid ONNX ({exc}); the float32 model may use an "
                         f"op that the converter should keep in float32 (op_block_list)") from exc


def _upgraded(model: onnx.ModelProto, half: int, blocked_ops: frozenset) -> onnx.ModelProto:
    """`model` at HALF_OPSET when some node admits `half` there but not at the model's opset (onnx's
    version converter); `model` itself otherwise, or when the converter fails (with a warning)."""
    opsets = {(o.domain or ""): o.version for o in model.opset_import}
    if opsets.get("", HALF_OPSET) >= HALF_OPSET or onnx.defs.onnx_opset_version() < HALF_OPSET:
        return model
    target = {**opsets, "": HALF_OPSET}
    gains = {n.op_type for n in model.graph.node if n.op_type not in blocked_ops
             and not _admits(n, half, opsets) and _admits(n, half, target)}
    if not gains:
        return model
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, HALF_OPSET)
    except Exception as exc:  # noqa: BLE001 - the converter raises several types; the model converts anyway
        warnings.warn(f"convert: raising the model from opset {opsets['']} to {HALF_OPSET} (where "
                      f"{', '.join(sorted(gains))} admit the half type) failed ({exc}); those nodes stay float32",
                      RuntimeWarning, stacklevel=3)
        return model


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value the model declares or inference finds."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"convert: shape inference failed: {exc}") from exc
    g = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.value_info, *g.output)
             if vi.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _admits(node: onnx.NodeProto, half: int, opsets: dict[str, int]) -> bool:
    """False when the op's schema (at the model's opset) has a constraint that admits float32 but not
    `half`: such a node stays float32. Ops without a schema (other domains) are assumed to admit it."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return True
    want = f"tensor({'float16' if half == FLOAT16 else 'bfloat16'})"
    # Only the constraints of the inputs: an output's own (LayerNormalization's statistics) follows an attribute.
    used = {p.type_str for p in schema.inputs}
    return all(want in c.allowed_type_strs for c in schema.type_constraints
               if c.type_param_str in used and "tensor(float)" in c.allowed_type_strs)


def _half_array(arr: np.ndarray, half: int) -> np.ndarray:
    finite = np.isfinite(arr)
    arr = np.where(finite, np.clip(arr, -_HALF_MAX[half], _HALF_MAX[half]), arr)
    return arr.astype(to_numpy(half))


def _half_tensor(t: onnx.TensorProto, half: int) -> onnx.TensorProto:
    return numpy_helper.from_array(_half_array(numpy_helper.to_array(t), half), t.name)


def _without_unread_casts(nodes: list, g: onnx.GraphProto, wide_of: dict[str, str]) -> list:
    """`nodes` without the Casts back to half after blocked nodes that nothing reads: a blocked node's
    result that only other blocked nodes read (in float32) needs none."""
    wanted = {x for n in nodes for x in n.input} | {vi.name for vi in g.output}
    return [n for n in nodes if not (n.op_type == "Cast" and n.output[0] not in wanted
                                     and wide_of.get(n.output[0]) == n.input[0])]


def _convert_initializers(g: onnx.GraphProto, half: int, keep: set[str]) -> None:
    for i, t in enumerate(g.initializer):
        if t.data_type == FLOAT and t.name not in keep:
            g.initializer[i].CopyFrom(_half_tensor(t, half))


# Ops whose output is float32 when an attribute is absent: the attribute the converter then sets.
_FLOAT_BY_DEFAULT = {"ConstantOfShape": "value", "RandomNormal": "dtype", "RandomUniform": "dtype",
                     "HannWindow": "output_datatype", "HammingWindow": "output_datatype",
                     "BlackmanWindow": "output_datatype", "MelWeightMatrix": "output_datatype"}


def _retype_attributes(node: onnx.NodeProto, half: int) -> None:
    """Type attributes naming float32 and float32 tensor attributes (Constant, ConstantOfShape) -> half."""
    missing = _FLOAT_BY_DEFAULT.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if missing is not None and all(a.name != missing for a in node.attribute):
        value = numpy_helper.from_array(np.zeros(1, to_numpy(half))) if missing == "value" else half
        node.attribute.append(helper.make_attribute(missing, value))
        return
    for a in node.attribute:
        if a.name in _TYPE_ATTRS and a.type == onnx.AttributeProto.INT and a.i == FLOAT:
            a.i = half
        elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == FLOAT:
            a.t.CopyFrom(_half_tensor(a.t, half))


def _cast(src: str, dst: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], name=f"{dst}_cast", to=to)


def _blocked_node(node: onnx.NodeProto, types: dict[str, int], half: int, keep_inits: set[str],
                  float32_names: set[str], wide_of: dict[str, str]) -> list:
    """A blocked node in float32: Casts to float32 on its (now half) float inputs, and its float outputs
    computed under new names then cast to half under the original names (added to `float32_names`).
    An input another blocked node produced is read in float32 (`wide_of`), not through the half type:
    a chain of blocked nodes rounds once, at its end."""
    before, after = [], []
    for j, x in enumerate(node.input):
        if x in wide_of:
            node.input[j] = wide_of[x]
        elif x and types.get(x) == FLOAT and x not in keep_inits:
            wide = f"{x}_fp32_for_{node.name or node.op_type}_{j}"
            before.append(_cast(x, wide, FLOAT))
            node.input[j] = wide
            float32_names.add(wide)
    for j, y in enumerate(node.output):
        if y and types.get(y) == FLOAT:
            wide = f"{y}_fp32"
            after.append(_cast(wide, y, half))
            node.output[j] = wide
            float32_names.add(wide)
            wide_of[y] = wide
    return [*before, node, *after]


# Trigonometric ops whose angle, when computed from positions and constants alone (rotary position
# tables), stays float32 with everything it is computed from.
_ANGLE_OPS = frozenset({"Sin", "Cos"})
# The most nodes an angle may take with it into float32: a larger cone is not a position table.
_ANGLE_CONE_LIMIT = 64


def angle_nodes(g: onnx.GraphProto, types: dict[str, int]) -> set[int]:
    """Indices of the Sin/Cos nodes whose float input derives from integers and constants only (no float
    graph input), with the float-producing nodes it is computed from. A rotary table's angle is
    position x frequency: in a half type the product keeps 8 (bfloat16) or 11 (float16) bits, so at
    position 127 a bfloat16 angle is off by up to 0.25 rad. transformers computes these tables in float32
    (autocast off) and rounds only the sines and cosines; the converter does the same."""
    producer = {y: i for i, n in enumerate(g.node) for y in n.output if y}
    float_inputs = {vi.name for vi in g.input if vi.type.tensor_type.elem_type == FLOAT}
    chosen: set[int] = set()
    for i, n in enumerate(g.node):
        if n.op_type in _ANGLE_OPS and n.domain in ("", "ai.onnx"):
            cone = _float_cone(g, n.input[0], producer, types, float_inputs)
            if cone is not None:
                chosen |= cone | {i}
    return chosen


def _float_cone(g: onnx.GraphProto, value: str, producer: dict[str, int], types: dict[str, int],
                float_inputs: set[str]) -> set[int] | None:
    """The nodes that compute float `value` through float values, back to integers and constants; None
    when it reaches a float graph input or grows past _ANGLE_CONE_LIMIT (then it is not a table)."""
    cone: set[int] = set()
    todo = [value]
    while todo:
        x = todo.pop()
        if x in float_inputs:
            return None
        i = producer.get(x)
        if i is None or i in cone or types.get(x) != FLOAT:
            continue
        cone.add(i)
        if len(cone) > _ANGLE_CONE_LIMIT:
            return None
        todo.extend(y for y in g.node[i].input if y)
    return cone


def _cast_float_results(model: onnx.ModelProto, half: int, float32_names: set[str]) -> None:
    """Results an op computes in float32 whatever its inputs (LayerNormalization's statistics, which
    follow `stash_type`; TfIdfVectorizer) get a Cast to half after them, so that readers see one type."""
    scratch = onnx.ModelProto()
    scratch.CopyFrom(model)
    for vi in scratch.graph.output:
        vi.type.tensor_type.elem_type = 0  # the producers' types, not the (already half) declarations
    try:
        inferred = onnx.shape_inference.infer_shapes(scratch, strict_mode=False)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"convert: shape inference failed: {exc}") from exc
    ig = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*ig.value_info, *ig.output)}
    g = model.graph
    nodes = []
    for n in g.node:
        nodes.append(n)
        for j, y in enumerate(n.output):
            if y and types.get(y) == FLOAT and y not in float32_names:
                wide = f"{y}_fp32"
                n.output[j] = wide
                nodes.append(_cast(wide, y, half))
    del g.node[:]
    g.node.extend(nodes)


def _retype_io(g: onnx.GraphProto, half: int, keep_io_types: bool) -> tuple[list, list]:
    """Graph inputs and outputs of type float32: retyped to half, or (keep_io_types) kept float32 with
    Casts inside the graph. Returns the Casts to put first and last."""
    first, last = [], []
    inits = {t.name for t in g.initializer}
    for vi in g.input:
        if vi.name in inits or vi.type.tensor_type.elem_type != FLOAT:
            continue
        if keep_io_types:
            inner = f"{vi.name}_half"
            first.append(_cast(vi.name, inner, half))
            _rename_reads(g, vi.name, inner)
        else:
            vi.type.tensor_type.elem_type = half
    for vi in g.output:
        if vi.type.tensor_type.elem_type != FLOAT:
            continue
        if keep_io_types:
            inner = f"{vi.name}_half"
            _rename_writes(g, vi.name, inner)
            last.append(_cast(inner, vi.name, FLOAT))
        else:
            vi.type.tensor_type.elem_type = half
    return first, last


def _rename_reads(g: onnx.GraphProto, old: str, new: str) -> None:
    for n in g.node:
        for j, x in enumerate(n.input):
            if x == old:
                n.input[j] = new


def _rename_writes(g: onnx.GraphProto, old: str, new: str) -> None:
    """The producer of graph output `old` writes `new`, and its readers read `new`."""
    for n in g.node:
        for j, y in enumerate(n.output):
            if y == old:
                n.output[j] = new
    _rename_reads(g, old, new)


__all__ = ["DEFAULT_OP_BLOCK_LIST", "PRECISIONS", "convert_precision"]
