"""Saved compiled partitions (ABI v7): loading a model that holds EPContext nodes.

A context model (written by `epcontext_save.py`, `ephost compile`) replaces each compiled fused
group by one `com.microsoft` `EPContext` node, in onnxruntime's form: the EP's context bytes in
`ep_cache_context` (embedded, `embed_mode=1`, or the name of a file beside the model,
`embed_mode=0`), the EP's name in `source`, the partition's name in `partition_name`; ephost adds
the group's original nodes in a graph attribute (`ephost_subgraph`), so a context the EP cannot
use is compiled again from them. The model's metadata holds each EP's compatibility string
(`ep_compatibility_info.<EP>`, onnxruntime's key) and the source model's SHA-256.

Loading one (`SavedContexts`):
  1. `split`: before optimization (a saved model was optimized when it was written; it is not
     optimized again) the contexts and kept subgraphs are taken out of the nodes, so the graph
     the session builds holds light EPContext nodes;
  2. `resolve`, once the session's EPs exist: per node, the EP's factory judges the saved
     compatibility string (ValidateCompiledModelCompatibilityInfo): unsupported -> ContextError
     naming the reason; prefer recompilation, an EP older than v7, an EP not in the session, or a
     context the EP refuses (CompileFromContext fails: corrupt, truncated) -> the kept nodes go
     back into the graph and are claimed and compiled like any others; else CompileFromContext
     rebuilds the partition, with no optimization, no GetCapability and no Compile;
  3. `partitions`: the partitioner's hook (compiled.claim_and_compile) takes the rebuilt
     partitions as compiled fused nodes of one node each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper

import abi
from abi.dtypes import ONNX_TO_NUMPY
from host.errors import EpError, InvalidArgument, ModelError
from host.plugins import hostapi
from host.plugins.hostapi import ffi
from host.plugins.loader import text
from host.runtime.graphview import GraphView
from host.runtime.model import Graph, build_graph, is_large, load_model, outer_names
from host.runtime.partition import compile as compiled
from host.runtime.warn import warn_caller

CONTEXT_OP = "EPContext"
CONTEXT_DOMAIN = "com.microsoft"
KEPT_SUBGRAPH = "ephost_subgraph"  # the group's original nodes, for recompilation
STRIPPED = ("ep_cache_context", KEPT_SUBGRAPH)  # what split() takes out of the nodes
COMPATIBILITY_KEY = "ep_compatibility_info."  # + EP name: onnxruntime's metadata key
SOURCE_HASH_KEY = "ephost.ep_context.source_sha256"

# Session config entries (onnxruntime's names).
ENABLE = "ep.context_enable"
FILE_PATH = "ep.context_file_path"
EMBED_MODE = "ep.context_embed_mode"


class ContextError(ModelError):
    """A saved compiled context cannot be used and the EP says recompiling will not help either."""


# ---- options ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContextOptions:
    """The ep.context_* session config entries, checked."""

    enable: bool = False
    file_path: str = ""
    # 0, onnxruntime's default: each context in a file beside the model, which a session maps
    # instead of parsing it out of the model (a BERT-size context is 440 MB).
    embed_mode: int = 0

    @classmethod
    def from_entries(cls, entries: dict[str, str]) -> ContextOptions:
        return cls(_flag(entries, ENABLE, "0") == 1, entries.get(FILE_PATH, ""), _flag(entries, EMBED_MODE, "0"))


def _flag(entries: dict[str, str], key: str, default: str) -> int:
    value = entries.get(key, default)
    if value not in ("0", "1"):
        raise InvalidArgument(f"session config entry {key}={value!r}: expected '0' or '1'")
    return int(value)


def is_context_node(node) -> bool:
    return node.op_type == CONTEXT_OP and node.domain == CONTEXT_DOMAIN


def source_hash(model) -> str:
    """SHA-256 of the model as given: the file's bytes, the bytes, or the serialised ModelProto."""
    if isinstance(model, (str, Path)):
        data = Path(model).read_bytes()
    elif isinstance(model, (bytes, bytearray)):
        data = bytes(model)
    else:
        data = model.SerializeToString()
    return hashlib.sha256(data).hexdigest()


# ---- compatibility ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Compatibility:
    """One EP's answer about the contexts a model holds for it."""

    ep: str
    saved: str          # the compatibility string in the model ("" when there is none)
    answer: int         # abi.COMPILED_MODEL_*
    reason: str

    @property
    def name(self) -> str:
        return abi.COMPATIBILITY_NAMES[self.answer]


def validate(factory, saved: str) -> Compatibility:
    """The factory's answer (EpFactory.ValidateCompiledModelCompatibilityInfo) for `saved`."""
    slot = factory.slots.ValidateCompiledModelCompatibilityInfo
    if slot is None:
        return Compatibility(factory.name, saved, abi.COMPILED_MODEL_NOT_APPLICABLE,
                             f"the plugin speaks ABI v{factory.negotiated}; saved contexts need v7: its "
                             "partitions are compiled from the kept subgraphs")
    out = ffi.new("int32_t*", -1)
    hostapi.check(slot(factory.ptr, factory.device_structs, len(factory.devices), saved.encode(), out),
                  f"plugin '{factory.registration}': ValidateCompiledModelCompatibilityInfo")
    answer = int(out[0])
    if answer not in abi.COMPATIBILITY_NAMES:
        raise EpError(f"plugin '{factory.registration}': ValidateCompiledModelCompatibilityInfo answered {answer}; "
                      f"expected one of {abi.COMPATIBILITY_NAMES}")
    return Compatibility(factory.name, saved, answer, f"{factory.name} answers {abi.COMPATIBILITY_NAMES[answer]} "
                                                      f"for the saved compatibility string {saved!r}")


_NO_STRING = "the model holds no compatibility string for this EP: its contexts are tried as they are"


def compatibility_strings(proto: onnx.ModelProto) -> dict[str, str]:
    return {p.key[len(COMPATIBILITY_KEY):]: p.value for p in proto.metadata_props
            if p.key.startswith(COMPATIBILITY_KEY)}


def check_compatibility(model, env) -> list[Compatibility]:
    """Each EP's answer for the contexts `model` holds, without creating a session (onnxruntime's
    GetModelCompatibilityForEpDevices): EPs come from `env`'s registered plugins."""
    proto = load_model(model)
    sources = {_text(n, "source") for n in proto.graph.node if is_context_node(n)}
    saved = compatibility_strings(proto)
    out = []
    for ep in sorted(sources | set(saved)):
        _, factory = env.find_factory(ep)
        if factory is None:
            out.append(Compatibility(ep, saved.get(ep, ""), abi.COMPILED_MODEL_NOT_APPLICABLE,
                                     f"no EP called {ep!r} is registered; its partitions would run from the kept "
                                     "subgraphs"))
        elif ep not in saved:
            out.append(Compatibility(ep, "", abi.COMPILED_MODEL_NOT_APPLICABLE, _NO_STRING))
        else:
            out.append(validate(factory, saved[ep]))
    return out


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _text(node: onnx.NodeProto, name: str) -> str:
    """A string attribute as text (onnx gives bytes)."""
    return _attr(node, name, b"").decode("utf-8", "replace")


def main_graph_reads(g: onnx.GraphProto) -> set[str]:
    """What the graph's own nodes (their control-flow bodies included; an EPContext node's only graph is its
    kept subgraph, left out), inputs and outputs read."""
    read = {v.name for v in (*g.input, *g.output)}
    for n in g.node:
        read.update(n.input)
        if not is_context_node(n):
            read.update(outer_names(n))
    return read


def kept_weights_file(model_path: Path) -> Path:
    """Where a context model keeps the weights only its kept subgraphs read (ONNX external data)."""
    return model_path.with_name(f"{model_path.stem}.weights")


# Element types whose raw bytes are the array NumPy reads (a mapped weight is a view of them, not a copy).
_MAPPED_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                           onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16,
                           onnx.TensorProto.UINT16, onnx.TensorProto.INT32, onnx.TensorProto.UINT32,
                           onnx.TensorProto.INT64, onnx.TensorProto.UINT64, onnx.TensorProto.BOOL})


def mappable(t: onnx.TensorProto) -> bool:
    """Whether a weight the graph reads goes to the `.weights` file when a context model is saved, to be
    mapped at load (map_weights): a large one (typed_inputs' sense: checker and inference leave it out)
    whose raw bytes NumPy reads as they are."""
    return is_large(t) and t.data_type in _MAPPED_TYPES and t.HasField("raw_data")


def map_weights(proto: onnx.ModelProto, model_path: Path | None) -> dict[str, np.ndarray]:
    """The graph's initializers stored in the context model's `.weights` file, as read-only NumPy views of
    one memory map of it: no read and no copy (pages are read when a kernel or a device upload touches
    them). The tensors stay external in `proto`; build_graph takes these arrays for them (`arrays=`).
    A view that the file cannot hold is a ModelError naming the tensor."""
    if model_path is None:
        return {}
    file = kept_weights_file(model_path)
    wanted = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
              and t.data_type in _MAPPED_TYPES and _location(t) == file.name]
    if not wanted:
        return {}
    try:
        with open(file, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file
        raise ModelError(f"the weights of the context model: cannot map '{file}' ({exc}); expected the "
                         "file written beside the model") from None
    return {t.name: _view(mapped, t, file) for t in wanted}


def _location(t: onnx.TensorProto) -> str:
    return next((d.value for d in t.external_data if d.key == "location"), "")


def _view(mapped: mmap.mmap, t: onnx.TensorProto, file: Path) -> np.ndarray:
    entries = {d.key: d.value for d in t.external_data}
    dtype = np.dtype(ONNX_TO_NUMPY[t.data_type])
    count = int(np.prod(t.dims, dtype=np.int64))
    offset = int(entries.get("offset", 0))
    length = int(entries.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize or offset < 0 or offset + length > len(mapped):
        raise ModelError(f"initializer {t.name!r} ({dtype}, dims {list(t.dims)}): bytes {offset}..{offset + length} "
                         f"of '{file}' ({len(mapped)} bytes) do not hold it; expected the file written with the "
                         "context model")
    arr = np.frombuffer(mapped, dtype, count, offset).reshape(tuple(t.dims))
    arr.flags.writeable = False
    return arr


def take_unread_initializers(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers that no node, graph input or graph output of `proto` reads, taken out of it (in place,
    the others left where they are: no copy of their data), in their order. In a context model these are the
    weights of the compiled partitions: only the kept subgraphs read them (from the `.weights` file, unread
    until then), and the session's graph is built without them, so that the checker and shape inference do
    not serialise them and GetCapability does not hand them to the EPs (the kept subgraphs are compiled from
    the model with them put back when a context is refused)."""
    g = proto.graph
    read = main_graph_reads(g)
    taken = []
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in read:
            copy = onnx.TensorProto()
            copy.CopyFrom(g.initializer[i])
            taken.append(copy)
            del g.initializer[i]
    taken.reverse()
    return taken


# ---- loading ----------------------------------------------------------------------------------
@dataclass
class SavedNode:
    """One EPContext node as loaded: its context bytes (or why there are none) and kept subgraph."""

    name: str
    source: str
    blob: bytes | mmap.mmap | None  # embedded bytes, or the context file mapped
    kept: onnx.GraphProto | None
    problem: str = ""  # why the bytes could not be read (a missing file, ...)


@dataclass
class SavedContexts:
    """The EPContext nodes of a loaded context model and what became of them."""

    model: onnx.ModelProto                # the model with light EPContext nodes (see split)
    nodes: dict[str, SavedNode]
    compatibility: dict[str, str]         # EP name -> saved compatibility string
    ready: dict[str, compiled.CompiledPartition] = field(default_factory=dict)
    base: Path | None = None              # the model's folder (external weights and context files)
    unread: list = field(default_factory=list)  # initializers only kept subgraphs read (take_unread_initializers)
    mapped: dict = field(default_factory=dict)  # name -> a read-only view of the `.weights` file (map_weights)

    @classmethod
    def split(cls, model) -> tuple[onnx.ModelProto, SavedContexts | None]:
        """The loaded model, and its contexts when it holds EPContext nodes (None otherwise). External
        tensors are read for a plain model; a context model's stay unread until a kept subgraph is compiled
        again (its saver puts there the weights only the kept subgraphs read: kept_weights_file)."""
        base = Path(model).parent if isinstance(model, (str, Path)) else None
        proto = load_model(model, external_data=False)
        if not any(is_context_node(n) for n in proto.graph.node):
            if base is not None:  # as onnx.load would have (every tensor, subgraphs' and attributes' too)
                _load_external(proto, base, "the model's external tensors")
            return proto, None
        light = proto
        if proto is model:  # the caller's ModelProto is not ours to change (a loaded one is: no copy of the weights)
            light = onnx.ModelProto()
            light.CopyFrom(proto)
        nodes: dict[str, SavedNode] = {}
        for node in light.graph.node:
            if is_context_node(node):
                saved = _read_node(node, base)
                nodes[saved.name] = saved
                kept = [a for a in node.attribute if a.name not in STRIPPED]
                del node.attribute[:]
                node.attribute.extend(kept)
        unread = take_unread_initializers(light)
        mapped = map_weights(light, Path(model) if base is not None else None)
        _load_external(light, base, "the external tensors the graph reads", skip=set(mapped))
        return light, cls(light, nodes, compatibility_strings(light), base=base, unread=unread, mapped=mapped)

    def resolve(self, eps, graph: Graph, view: GraphView, fallbacks, owned: list) -> tuple[Graph, GraphView]:
        """Rebuild what can be rebuilt; put the kept nodes back for the rest (see the module doc). The
        rebuilt partitions are appended to `owned` at once (the session releases them, even if its
        creation fails later)."""
        by_name = {ep.name: ep for ep in eps}
        answers: dict[str, Compatibility] = {}
        recompile: list[str] = []
        for index, node in enumerate(graph.nodes):
            saved = self.nodes.get(node.name) if is_context_node(node) else None
            if saved is None:
                continue
            ep = by_name.get(saved.source)
            why = self._why_not_loaded(saved, ep, answers)
            part = None if why else self._load(saved, ep, graph, index)
            if part is None and saved.kept is None:
                raise ContextError(f"compiled context of '{saved.name}' cannot be used "
                                   f"({(why or saved.problem).lstrip('!')}) and the node keeps no subgraph to "
                                   "compile again; compile the source model again (ephost compile)")
            if part is None:
                recompile.append(saved.name)
                fallbacks["context_recompiled"] += 1
                if why is None or why.startswith("!"):
                    warn_caller(f"compiled context of '{saved.name}' not used "
                                f"({(why or saved.problem).lstrip('!')}); its nodes are compiled again")
            else:
                self.ready[saved.name] = part
                owned.append(part)
                fallbacks["context_loaded"] += 1
                saved.blob = None  # the partition holds the bytes now, until its release
        if not recompile:
            return graph, view
        graph = build_graph(self._inlined(recompile))
        return graph, GraphView(graph)

    def _why_not_loaded(self, saved: SavedNode, ep, answers: dict[str, Compatibility]) -> str | None:
        """Why `saved` is compiled again instead (a leading '!' asks for a warning), or None."""
        if ep is None:
            return f"!{saved.source} is not an EP of this session"
        if ep.slots.CompileFromContext is None:
            return f"{ep.name} speaks ABI v{ep.slots.negotiated}; contexts need v7"
        answer = answers.get(ep.name)
        if answer is None:
            answer = answers[ep.name] = self._answer(ep)
        if answer.answer == abi.COMPILED_MODEL_UNSUPPORTED:
            raise ContextError(f"compiled context of '{saved.name}' cannot be used: {answer.reason} (this EP now "
                               f"writes {current_compatibility(ep) or ''!r}); compile the source model again "
                               "(ephost compile)")
        if answer.answer == abi.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION:
            return answer.reason
        if saved.blob is None:
            return f"!{saved.problem}"
        return None

    def _answer(self, ep) -> Compatibility:
        saved = self.compatibility.get(ep.name)
        if saved is None:  # the EP wrote no compatibility string: nothing to judge (onnxruntime skips it too)
            return Compatibility(ep.name, "", abi.COMPILED_MODEL_NOT_APPLICABLE, _NO_STRING)
        return validate(ep.factory, saved)

    def _load(self, saved: SavedNode, ep, graph: Graph, index: int):
        """Ep.CompileFromContext for one node; None (with saved.problem set) when the EP refuses."""
        group = compiled.describe_group(graph, ep, (index,), saved.name)
        if group.outputs != tuple(graph.nodes[index].outputs):
            saved.problem = f"outputs {list(graph.nodes[index].outputs)} are not all read after the node"
            return None
        out = ffi.new("EpNodeComputeInfo**")
        blob = ffi.from_buffer(saved.blob)
        try:
            hostapi.check(ep.slots.CompileFromContext(ep.ptr, group.view.ptr, group.node_view, blob, len(saved.blob),
                                                      out), f"{ep.owner}: CompileFromContext of '{saved.name}'")
        except EpError as exc:
            saved.problem = str(exc)
            return None
        part = compiled.adopt_compute_info(ep, group, out[0], graph)
        if part is None:
            saved.problem = group.error
        else:
            part.keep_alive(saved.blob)  # the EP may keep views of the bytes until its release (abi/ep_abi.h)
        return part

    def _inlined(self, names: list[str]) -> onnx.ModelProto:
        """The model with the kept nodes of `names` in place of their EPContext nodes."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self.model)
        nodes = []
        for node in proto.graph.node:
            if is_context_node(node) and node.name in names:
                nodes.extend(self.nodes[node.name].kept.node)
            else:
                nodes.append(node)
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        proto.graph.initializer.extend(self.unread)
        _load_external(proto, self.base, f"the weights of {', '.join(repr(n) for n in names)}, to compile them again")
        return proto

    def with_weights(self, proto: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of `proto` (the session's graph model) with its mapped weights read in (an expansion by the
        optimizer needs them as data)."""
        if not self.mapped:
            return proto
        full = onnx.ModelProto()
        full.CopyFrom(proto)
        _load_external(full, self.base, "the weights of the context model")
        return full

    def partitions(self, graph: Graph) -> list[compiled.CompiledPartition]:
        """The rebuilt partitions, their groups pointing at `graph`'s node indices."""
        index = {n.name: i for i, n in enumerate(graph.nodes) if is_context_node(n)}  # other nodes may share a name
        parts = []
        for name, part in self.ready.items():
            part.group = dataclasses.replace(part.group, nodes=(index[name],))
            parts.append(part)
        return parts


def _load_external(proto: onnx.ModelProto, base: Path | None, what: str, skip: frozenset | set = frozenset()) -> None:
    """Read `proto`'s external tensors (but the initializers named in `skip`: mapped instead) from the files
    beside the model (in place; nothing when it has none); a typed error when the model was not given as a
    path or a file cannot be read."""
    tensors = [t for t in external_data_helper._get_all_tensors(proto)
               if t.data_location == onnx.TensorProto.EXTERNAL and t.name not in skip]
    files = sorted({_location(t) for t in tensors})
    if not files:
        return
    if base is None:
        raise ModelError(f"{what} are in {files} beside the model, and the model was not given as a path; "
                         "expected a model path (the files are found beside it)")
    try:
        for t in tensors:
            external_data_helper.load_external_data_for_tensor(t, str(base))
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"{what}: cannot read {files} in '{base}' ({exc}); expected the files written "
                         "beside the model") from None


def current_compatibility(ep, graph_ptr=ffi.NULL) -> str | None:
    """The EP's compatibility string now (Ep.GetCompiledModelCompatibilityInfo); None: it gives none."""
    slot = ep.slots.GetCompiledModelCompatibilityInfo
    p = slot(ep.ptr, graph_ptr) if slot is not None else ffi.NULL
    return None if p == ffi.NULL else text(p, f"{ep.owner}: Ep.GetCompiledModelCompatibilityInfo", EpError)


def _read_node(node: onnx.NodeProto, base: Path | None) -> SavedNode:
    if not node.name:
        raise ModelError(f"an EPContext node of source {_text(node, 'source')!r} has no name; expected the "
                         "partition name")
    kept = _attr(node, KEPT_SUBGRAPH, None)
    if kept is not None:  # a copy: split() takes the attribute out of the node
        kept = onnx.GraphProto.FromString(kept.SerializeToString())
    saved = SavedNode(node.name, _text(node, "source"), None, kept)
    data = _attr(node, "ep_cache_context", b"")
    if _attr(node, "main_context", 1) != 1:
        saved.problem = "main_context=0 (a context shared with another node) is not supported"
    elif _attr(node, "embed_mode", 1) == 1:
        saved.blob = data
    elif base is None:
        saved.problem = f"the context is in file '{data.decode(errors='replace')}', and the model was not given as a path"
    else:
        path = base / data.decode(errors="replace")  # a name that is not UTF-8 names no file: "cannot be read"
        try:
            saved.blob = _mapped(path)
        except OSError as exc:
            saved.problem = f"context file '{path}' cannot be read: {exc.strerror or exc}"
    return saved


def _mapped(path: Path):
    """A context file's bytes, mapped read-only rather than read: the EP reads what it needs (a
    BERT-size context is 440 MB, mostly weights that go straight to the device)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # an empty file cannot be mapped
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


__all__ = ["ContextError", "ContextOptions", "Compatibility", "SavedContexts", "check_compatibility",
           "current_compatibility", "is_context_node", "source_hash", "validate"]
