"""Model loading with the `onnx` package: checker, shape inference, a flat graph the host plans."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from abi.dtypes import ONNX_TO_NUMPY, supported_names, type_name
from host.errors import InvalidArgument, ModelError, NoSuchFile
from host.runtime import contrib_types, types
from host.runtime.node import NodeInfo, node_info

# The default-domain opsets the session loads: up to the newest the installed onnx defines (its schemas
# drive checking and shape inference); kernels whose op changed meaning later carry `until` in the registry.
MIN_OPSET, MAX_OPSET = 1, onnx.defs.onnx_opset_version()


@dataclass
class ValueMeta:
    """Type and shape of a value: dims are ints, or strings for symbolic ones, or None. `type` is the
    declared TypeProto of a value that is not a tensor (a sequence, an optional, a map), else None."""

    name: str
    elem_type: int = 0
    shape: tuple | None = None
    type: onnx.TypeProto | None = None

    @property
    def type_text(self) -> str:
        """The type in ONNX words ('tensor(float)', 'seq(tensor(int64))')."""
        return types.type_text(self.type, self.elem_type)


@dataclass
class Graph:
    model: onnx.ModelProto
    nodes: list[NodeInfo]
    values: dict[str, ValueMeta]
    initializers: dict[str, np.ndarray]
    inputs: list[ValueMeta]
    outputs: list[ValueMeta]
    opsets: dict[str, int] = field(default_factory=dict)
    # Nodes the host evaluates once per input-shape signature (host/runtime/shape_program.py): no EP
    # claims them and the plan leaves them out.
    shape_nodes: frozenset[int] = frozenset()


def _meta(vi: onnx.ValueInfoProto) -> ValueMeta:
    if not types.is_tensor_type(vi.type):
        return ValueMeta(vi.name, 0, None, vi.type)
    t = vi.type.tensor_type
    shape = None
    if t.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return ValueMeta(vi.name, t.elem_type, shape)


def load_model(model, external_data: bool = True) -> onnx.ModelProto:
    """A ModelProto from a path, bytes or a ModelProto; parser errors carry the path. `external_data=False`
    leaves a file's external tensors unread (references to their files)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        try:
            proto = onnx.load_from_string(bytes(model))
        except Exception as exc:  # noqa: BLE001 - protobuf raises several types
            raise ModelError(f"model bytes could not be parsed: {exc}") from exc
        return _with_graph(proto, "", len(model))
    if isinstance(model, (str, Path)):
        path = Path(model)
        if path.is_dir():
            raise ModelError(f"model path '{path}' is a directory; expected an ONNX model file (.onnx)")
        if not path.is_file():
            raise NoSuchFile(f"model file '{path}' does not exist")
        try:
            proto = _read_file(path, external_data)
        except Exception as exc:  # noqa: BLE001
            raise ModelError(f"model file '{path}' could not be parsed: {exc}") from exc
        return _with_graph(proto, f"Load model from {path} failed: ", path.stat().st_size)
    raise ModelError(f"model must be a path, bytes or onnx.ModelProto; got {type(model).__name__}")


def _read_file(path: Path, external_data: bool) -> onnx.ModelProto:
    """onnx.load(path), a binary model parsed from a memory map of the file: protobuf copies what it keeps,
    and reading the file into a bytes object first doubled the time (0.40 -> 0.20 s for 340 MB here).
    Text formats (by extension) go through onnx.load. As with any memory map, a file truncated by another
    process during the parse faults the process (SIGBUS); ephost's own writers replace files atomically
    (`save_model`)."""
    from onnx import external_data_helper
    from onnx.serialization import registry

    if registry.get_format_from_file_extension(path.suffix) not in (None, "protobuf"):
        return onnx.load(str(path), load_external_data=external_data)
    proto = onnx.ModelProto()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                read = proto.ParseFromString(view)
            if read is not None and read != size:
                raise ValueError(f"protobuf parsed {read} of the file's {size} bytes")
    if external_data:
        external_data_helper.load_external_data_for_model(proto, str(path.parent))
    return proto


def save_model(proto: onnx.ModelProto, path) -> None:
    """onnx.save(proto, path), atomically: written beside `path` and moved into place, so that a reader
    (whose memory map a truncated file would fault, `_read_file`) sees the old model or the new one."""
    replace_atomically(path, lambda tmp: onnx.save(proto, str(tmp)))


def replace_atomically(path, write) -> None:
    """`write(tmp)` fills a file beside `path`, which then replaces `path` in one step (os.replace)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _with_graph(proto: onnx.ModelProto, where: str, size: int) -> onnx.ModelProto:
    """`proto` if it holds a graph. An empty file parses as an empty ModelProto; onnxruntime calls that
    an invalid argument with this message, not a model with a missing opset."""
    if not proto.HasField("graph"):
        raise InvalidArgument(f"{where}No graph was found in the protobuf ({size} bytes); expected an ONNX "
                              "ModelProto with a graph (onnx.save writes one)")
    return proto


def _check_opsets(proto: onnx.ModelProto) -> dict[str, int]:
    opsets = {(o.domain or ""): o.version for o in proto.opset_import}
    if "ai.onnx" in opsets:
        opsets[""] = opsets.pop("ai.onnx")
    default = opsets.get("")
    if default is None:
        # A model of ai.onnx.ml ops only (a converted classifier) may import no default opset.
        if all(n.domain not in ("", "ai.onnx") for n in proto.graph.node):
            return opsets
        raise ModelError("model imports no default ONNX opset; expected an opset_import for domain ''")
    if not MIN_OPSET <= default <= MAX_OPSET:
        raise ModelError(f"model uses ONNX opset {default}; supported: {MIN_OPSET}..{MAX_OPSET}")
    return opsets


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    a = node.attribute[0]
    if a.name == "value":
        arr = numpy_helper.to_array(a.t)
    elif a.name == "value_float":
        arr = np.array(a.f, np.float32)
    elif a.name == "value_floats":
        arr = np.array(list(a.floats), np.float32)
    elif a.name == "value_int":
        arr = np.array(a.i, np.int64)
    elif a.name == "value_ints":
        arr = np.array(list(a.ints), np.int64)
    else:
        return None
    return arr if arr.dtype in ONNX_TO_NUMPY.values() else None


def check_text(proto: onnx.ModelProto) -> None:
    """protobuf hands back a string field that is not UTF-8 as bytes: refuse it here, by name,
    instead of letting it fail wherever it is first used."""
    g = proto.graph
    fields = [("graph name", g.name)]
    for n in g.node:
        fields += [("node name", n.name), ("op_type", n.op_type), ("domain", n.domain)]
        fields += [("value name", v) for v in (*n.input, *n.output)]
    fields += [("value name", v.name) for v in (*g.input, *g.output, *g.value_info, *g.initializer)]
    for what, value in fields:
        if not isinstance(value, str):
            raise ModelError(f"model is not valid ONNX: a {what} is not UTF-8 text ({bytes(value)[:40]!r})")


def build_graph(model, owned: bool = False, arrays: dict | None = None) -> Graph:
    """The Graph of `model`. ONNX's checker and shape inference run with the large initializers as typed
    graph inputs (`typed_inputs`), so that neither serialises their data (seconds for a BERT-sized
    model); their value fields are checked here instead (`check_weights`), and their arrays come from
    the model. `owned`: a ModelProto `model` is the caller's to change (the session's own optimized
    model), so inference's answer is put into it instead of into a copy of its weights. `arrays`: the
    arrays of initializers that stay external in `model` (a context model's mapped weights)."""
    proto = load_model(model)
    owned = owned or proto is not model  # loaded here from a path or bytes: ours
    check_text(proto)
    opsets = _check_opsets(proto)
    if proto.ir_version < 4:
        # IR 3 required every initializer to be a graph input; old exporters (PyTorch 0.3) did not always
        # list them, and onnxruntime loads such models. Since IR 4 an initializer need not be an input.
        upgraded = onnx.ModelProto()
        upgraded.CopyFrom(proto)
        upgraded.ir_version = 4
        proto = upgraded
        owned = True
    check_weights(proto.graph)
    checked = typed_inputs(proto)
    try:
        onnx.checker.check_model(checked)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"model is not valid ONNX: {exc}") from exc
    except UnicodeDecodeError as exc:  # a string field (a name, a domain) that is not UTF-8
        raise ModelError(f"model is not valid ONNX: a string field is not UTF-8 ({exc})") from exc
    try:
        inferred = shape_inference.infer_shapes(checked, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference errors are model errors
        raise ModelError(f"shape inference failed: {exc}") from exc
    if checked is not proto:
        inferred = initializers_back(inferred, proto, in_place=owned)
    for what, vis in (("graph input", inferred.graph.input), ("graph output", inferred.graph.output)):
        for vi in vis:
            types.check_io_type(vi.name, vi.type, what)
    return _graph(inferred, inferred.graph, opsets, {}, arrays=arrays)


_LARGE_ELEMENTS = 1024  # shape inference reads the data of small initializers only (Reshape's shape...)


def is_large(t: onnx.TensorProto) -> bool:
    return int(np.prod(t.dims, dtype=np.int64)) > _LARGE_ELEMENTS


# The fields of a TensorProto that hold its values: the checker wants exactly one of them set (or external data).
_VALUE_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "raw_data", "double_data",
                 "uint64_data")  # in field-number order, as ListFields gave them


def check_weights(g: onnx.GraphProto) -> None:
    """What ONNX's checker says of a large initializer that `typed_inputs` leaves out of its view: one value
    field, or external data (sizes against dims and types are checked when the arrays are read)."""
    for t in g.initializer:
        if not is_large(t):
            continue
        # HasField and len, not ListFields: that returns every field's value, a copy of raw_data (a GPT-2
        # embedding table: 154 MB, 0.14 s of a session on the H200's host).
        fields = [name for name in _VALUE_FIELDS if (t.HasField(name) if name == "raw_data" else len(getattr(t, name)))]
        external = t.data_location == onnx.TensorProto.EXTERNAL
        if len(fields) + external != 1:
            raise ModelError(f"model is not valid ONNX: TensorProto (tensor name: {t.name}) should contain one and "
                             f"only one value field; it has {fields or 'none'}{' and external data' if external else ''}")


def typed_inputs(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `proto` whose large initializers are graph inputs of their type and shape (no data);
    `proto` itself when it has none. Those that are graph inputs already are simply left out."""
    g = proto.graph
    large = [t for t in g.initializer if is_large(t)]
    if not large:
        return proto
    light = onnx.ModelProto()
    copy_fields(proto, light, skip=("graph",))
    copy_fields(g, light.graph, skip=("initializer",))
    light.graph.initializer.extend(t for t in g.initializer if not is_large(t))
    listed = {vi.name for vi in g.input}
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in large if t.name not in listed)
    return light


def initializers_back(inferred: onnx.ModelProto, proto: onnx.ModelProto, in_place: bool = False) -> onnx.ModelProto:
    """`inferred` (shape inference's answer for `typed_inputs(proto)`) with `proto`'s graph inputs and
    initializers again (copies of the data, not serialisations). `in_place`: `proto` itself with
    inference's graph fields instead (nodes, whose subgraphs inference also annotates, value infos and
    outputs): no copy of the weights, which for a BERT-sized model is a few hundred megabytes."""
    if in_place:
        for name in ("node", "value_info", "output"):
            proto.graph.ClearField(name)
            getattr(proto.graph, name).extend(getattr(inferred.graph, name))
        return proto
    out = onnx.ModelProto()
    copy_fields(inferred, out, skip=("graph",))
    copy_fields(inferred.graph, out.graph, skip=("initializer", "input"))
    out.graph.input.extend(proto.graph.input)
    out.graph.initializer.extend(proto.graph.initializer)
    return out


def copy_fields(src, dst, skip: tuple[str, ...]) -> None:
    """Every set field of the message `src` but those named in `skip` into the empty message `dst` (copies)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        # protobuf 7 has is_repeated only; older releases have label only
        if fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def build_subgraph(body: onnx.GraphProto, opsets: dict[str, int], outer: dict[str, ValueMeta],
                   outer_constants: dict[str, np.ndarray] | None = None) -> Graph:
    """The Graph of a control-flow node's body: its formal inputs first, then the outer-scope values
    it reads (implicit inputs, in first-use order), which the host feeds like inputs. Outer values that
    are initializers of the enclosing graph (`outer_constants`) become the body's initializers instead:
    EPs see them as constant data (a device EP copies them once, not at every iteration)."""
    return _graph(SimpleNamespace(graph=body), body, opsets, outer, outer_constants)


def _initializers(g: onnx.GraphProto, arrays: dict | None = None) -> dict[str, np.ndarray]:
    inits = {}
    for t in g.initializer:
        if arrays and t.name in arrays and t.data_location == onnx.TensorProto.EXTERNAL:
            inits[t.name] = arrays[t.name]  # read where it lies (epcontext.map_weights)
            continue
        if t.data_type not in ONNX_TO_NUMPY:
            raise ModelError(f"initializer {t.name!r} has element type {type_name(t.data_type)}; "
                             f"supported: {supported_names()}")
        try:
            inits[t.name] = numpy_helper.to_array(t)
        except (ValueError, TypeError) as exc:  # data that does not fit its dims or type
            raise ModelError(f"initializer {t.name!r} (element type {type_name(t.data_type)}, dims {list(t.dims)}) cannot be "
                             f"read: {exc}") from None
    return inits


def _graph(model, g: onnx.GraphProto, opsets: dict[str, int], outer: dict[str, ValueMeta],
           outer_constants: dict[str, np.ndarray] | None = None, arrays: dict | None = None) -> Graph:
    inits = _initializers(g, arrays)
    if outer_constants:
        inits.update({n: outer_constants[n] for n in free_names(g) if n in outer_constants and n not in inits})
    values: dict[str, ValueMeta] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        values[vi.name] = _meta(vi)
    for name, arr in inits.items():
        values[name] = ValueMeta(name, onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape)
    nodes = []
    for i, n in enumerate(g.node):
        folded = _constant_value(n)
        if folded is not None:
            # Constants become initializers, so EPs see shapes and axes as constant data.
            inits[n.output[0]] = folded
            values[n.output[0]] = ValueMeta(n.output[0], onnx.helper.np_dtype_to_tensor_dtype(folded.dtype),
                                            folded.shape)
            continue
        info = node_info(n, opsets.get(n.domain or "", 0))
        implicit = tuple(outer_names(n))
        if not info.name or implicit:
            # A node with subgraphs takes the outer values they read as extra inputs (after its own),
            # so ordering, lifetimes and partition boundaries see them.
            info = NodeInfo(info.name or f"{n.op_type}_{i}", info.op_type, info.domain, info.opset, info.attrs,
                            info.inputs + implicit, info.outputs, len(implicit))
        nodes.append(info)
    contrib_types.fill(nodes, values)
    implicit = [name for name in free_names(g) if name not in inits]
    for name in implicit:
        values.setdefault(name, outer.get(name) or ValueMeta(name))
    inputs = [values[vi.name] for vi in g.input if vi.name not in inits] + [values[x] for x in implicit]
    outputs = [values[vi.name] for vi in g.output]
    return Graph(model, nodes, values, inits, inputs, outputs, opsets)


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held in a node's attributes (If's branches, Loop's and Scan's body...)."""
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def outer_names(node: onnx.NodeProto) -> list[str]:
    """The values a node's subgraphs read from the scopes around the node, in first-use order."""
    seen: dict[str, None] = {}
    for body in subgraphs(node):
        for name in free_names(body):
            seen[name] = None
    return list(seen)


def free_names(g: onnx.GraphProto) -> list[str]:
    """Names a graph reads (its nodes, nested subgraphs and outputs included) that it does not define."""
    defined = {vi.name for vi in g.input} | {t.name for t in g.initializer} | {""}
    defined |= {t.values.name for t in g.sparse_initializer}
    seen: dict[str, None] = {}
    for n in g.node:
        for name in [*n.input, *outer_names(n)]:
            if name not in defined:
                seen[name] = None
        defined.update(n.output)
    for vi in g.output:
        if vi.name not in defined:
            seen[vi.name] = None
    return list(seen)


def host_only_nodes(graph: Graph) -> set[int]:
    """Nodes no plugin EP may take: control flow (the host runs it) and nodes that read or write a
    value that is not a tensor (the C ABI describes tensors only), and the shape arithmetic the
    host evaluates per input-shape signature."""
    out = set(graph.shape_nodes)
    for i, n in enumerate(graph.nodes):
        names = [x for x in (*n.inputs, *n.outputs) if x]
        if n.implicit or any(isinstance(v, onnx.GraphProto) for v in n.attrs.values()) \
                or any(getattr(graph.values.get(x), "type", None) is not None for x in names):
            out.add(i)
    return out
