"""Saved compiled partitions (ABI v7): writing a context model (session config ep.context_enable=1).

After partitioning, each compiled fused group of the session's graph whose EP hands out a context
(EpNodeComputeInfo.GetContext) becomes one `com.microsoft` `EPContext` node in a copy of the
optimized model (the form epcontext.py loads; see there). A group whose EP gives no context
(a v6 plugin, an EP that saves nothing, an error) keeps its nodes: loading the model compiles them
as today. `ep.context_file_path` names the file (default: `<model>_ctx.onnx` beside a model given
as a path); `ep.context_embed_mode=0` writes each context to a file beside it instead of into the
node.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx
from onnx import external_data_helper, helper

from host.errors import EpError, InvalidArgument
from host.plugins import hostapi
from host.plugins.hostapi import ffi
from host.runtime.epcontext import (
    COMPATIBILITY_KEY,
    CONTEXT_DOMAIN,
    CONTEXT_OP,
    KEPT_SUBGRAPH,
    SOURCE_HASH_KEY,
    ContextOptions,
    current_compatibility,
    kept_weights_file,
    main_graph_reads,
    mappable,
    source_hash,
)
from host.runtime.model import replace_atomically, save_model
from host.runtime.warn import warn_caller


def save_if_enabled(session, source) -> Path | None:
    """Write the session's context model when its options ask for one; returns its path."""
    opts = ContextOptions.from_entries(session.options.entries)
    if not opts.enable:
        return None
    if session.contexts is not None:
        raise InvalidArgument("ep.context_enable=1: the model already holds EPContext nodes; expected a source "
                              "model (one without compiled contexts)")
    path = _target(opts, source)
    parts = main_graph_partitions(session)
    blobs = {p.name: blob for p in parts if (blob := _context_of(p, session.fallbacks)) is not None}
    files: dict[Path, bytes] = {}  # embed mode 0: the context files beside the model
    proto = _context_model(session, [p for p in parts if p.name in blobs], blobs, opts, path, files)
    proto.metadata_props.add(key=SOURCE_HASH_KEY, value=source_hash(source))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for file, blob in files.items():  # replaced whole: a session may have the old one mapped
            replace_atomically(file, lambda tmp, blob=blob: tmp.write_bytes(blob))
        _kept_weights_apart(proto, path, graph_weights=opts.embed_mode == 0)
        save_model(proto, path)
    except OSError as exc:
        raise InvalidArgument(f"ep.context_file_path '{path}': cannot write the "
                              f"context model ({exc.strerror or exc}); expected a writable file path") from exc
    return path


KEPT_WEIGHTS_MIN_BYTES = 4096  # smaller weights stay in the model
_ALIGN = 64


def _kept_weights_apart(proto: onnx.ModelProto, path: Path, graph_weights: bool) -> None:
    """Move the weights that only the kept subgraphs read, and with `graph_weights` the large weights the
    graph itself reads, into kept_weights_file(path), as ONNX external data (64-byte aligned). A session from
    the context model never reads the first unless it compiles a kept subgraph again, and maps the second
    instead of parsing them (epcontext.map_weights: a GPT-2 embedding table read by a per-node Gather is
    154 MB), so loading the model parses its graph and contexts only. `graph_weights` is embed mode 0's:
    its contexts are files beside the model already; with embed mode 1 the graph's own weights stay in the
    model, which then loads from bytes too (its contexts serve; only a recompile needs the file)."""
    read = main_graph_reads(proto.graph)
    apart = [t for t in proto.graph.initializer
             if (len(t.raw_data) >= KEPT_WEIGHTS_MIN_BYTES if t.name not in read else graph_weights and mappable(t))]
    if not apart:
        return
    file = kept_weights_file(path)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            for t in apart:
                f.write(b"\0" * (-f.tell() % _ALIGN))
                offset = f.tell()
                f.write(t.raw_data)
                external_data_helper.set_external_data(t, file.name, offset, len(t.raw_data))
                t.ClearField("raw_data")

    replace_atomically(file, write)


def _target(opts: ContextOptions, source) -> Path:
    if opts.file_path:
        return Path(opts.file_path)
    if isinstance(source, (str, Path)):
        src = Path(source)
        return src.with_name(f"{src.stem}_ctx.onnx")
    raise InvalidArgument("ep.context_enable=1 with a model given as bytes: set ep.context_file_path to the "
                          "file the context model goes to")


def main_graph_partitions(session) -> list:
    """The compiled partitions of the session's own graph (not of control-flow bodies), in plan order."""
    nodes = session.graph.nodes
    return [p for p in session._partitioner.partitions
            if all(i < len(nodes) and nodes[i].name == n for i, n in zip(p.group.nodes, p.node_names))]


def _context_of(part, fallbacks) -> bytes | None:
    """The context bytes of a compiled partition (EpNodeComputeInfo.GetContext), or None."""
    slot = part.info.GetContext
    if slot is None:
        fallbacks["context_not_offered"] += 1
        return None
    data, size = ffi.new("void**"), ffi.new("size_t*", 0)
    try:
        hostapi.check(slot(part.ptr, data, size), f"{part.group.ep.owner}: GetContext of '{part.name}'")
    except EpError as exc:
        warn_caller(f"{exc}; the model keeps the nodes of '{part.name}'")
        fallbacks["context_not_offered"] += 1
        return None
    if data[0] == ffi.NULL or size[0] == 0:
        fallbacks["context_not_offered"] += 1
        return None
    return bytes(ffi.buffer(data[0], size[0]))


def _context_model(session, parts: list, blobs: dict[str, bytes], opts: ContextOptions,
                   path: Path, files: dict[Path, bytes]) -> onnx.ModelProto:
    graph = session.graph
    proto = onnx.ModelProto()
    proto.CopyFrom(graph.model)
    names = _node_names(proto.graph)
    by_node = {n: p for p in parts for n in p.node_names}
    members: dict[str, list[onnx.NodeProto]] = {p.name: [] for p in parts}
    nodes: list[onnx.NodeProto] = []
    for node, name in zip(proto.graph.node, names):
        node.name = name  # the kept subgraph's nodes keep the names the session gave them
        part = by_node.get(name)
        if part is None:
            nodes.append(node)
            continue
        if not members[part.name]:
            nodes.append(_context_node(part, blobs[part.name], opts, path, files))
        members[part.name].append(node)
    for part in parts:
        _attach_kept(nodes, part, members[part.name], graph)
    del proto.graph.node[:]
    proto.graph.node.extend(_topological(nodes, proto.graph))
    _set_metadata(proto, session, parts)
    if not any(o.domain == CONTEXT_DOMAIN for o in proto.opset_import):
        proto.opset_import.add(domain=CONTEXT_DOMAIN, version=1)
    return proto


def _node_names(g: onnx.GraphProto) -> list[str]:
    """Each node's name as the session's graph knows it (host.runtime.model names unnamed nodes)."""
    return [n.name or f"{n.op_type}_{k}" for k, n in enumerate(g.node)]


def _context_node(part, blob: bytes, opts: ContextOptions, path: Path, files: dict[Path, bytes]) -> onnx.NodeProto:
    """`files`: where embed mode 0 puts the context (written by save_if_enabled with the model)."""
    ep = part.group.ep
    if opts.embed_mode == 1:
        cache = blob
    else:
        file = path.with_name(f"{path.stem}_{re.sub(r'[^A-Za-z0-9_.-]', '_', part.name)}.bin")
        files[file] = blob
        cache = file.name.encode()  # relative to the model's folder, as onnxruntime writes it
    return helper.make_node(CONTEXT_OP, list(part.group.inputs), list(part.group.outputs), name=part.name,
                            domain=CONTEXT_DOMAIN, main_context=1, ep_cache_context=cache,
                            embed_mode=opts.embed_mode, source=ep.name, partition_name=part.name,
                            ep_sdk_version=ep.factory.plugin_version or "")


def _attach_kept(nodes: list[onnx.NodeProto], part, members: list[onnx.NodeProto], graph) -> None:
    """The group's original nodes as a graph attribute of its EPContext node (for recompilation)."""
    outputs = [_value_info(graph, name) for name in part.group.outputs]
    kept = helper.make_graph(members, part.name, [], outputs)
    node = next(n for n in nodes if n.op_type == CONTEXT_OP and n.name == part.name)
    node.attribute.append(helper.make_attribute(KEPT_SUBGRAPH, kept))


def _value_info(graph, name: str) -> onnx.ValueInfoProto:
    meta = graph.values.get(name)
    if meta is None or meta.elem_type is None:
        return helper.make_empty_tensor_value_info(name)
    return helper.make_tensor_value_info(name, meta.elem_type, meta.shape)


def _set_metadata(proto: onnx.ModelProto, session, parts: list) -> None:
    for ep in {id(p.group.ep): p.group.ep for p in parts}.values():
        text = current_compatibility(ep, session._partitioner.view.ptr)
        if text is not None:
            proto.metadata_props.add(key=COMPATIBILITY_KEY + ep.name, value=text)


def _topological(nodes: list[onnx.NodeProto], g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """`nodes` in an order where each node follows the producers of its inputs (stable otherwise):
    an EPContext node stands where its first member stood, which may precede a producer of a later
    member's input."""
    ready = {vi.name for vi in g.input} | {t.name for t in g.initializer} | {""}
    produced = {o for n in nodes for o in n.output}
    pending, out = list(nodes), []
    while pending:
        for k, node in enumerate(pending):
            if all(x in ready or x not in produced for x in node.input):
                out.append(pending.pop(k))
                ready.update(node.output)
                break
        else:
            raise InvalidArgument("ep.context_enable: the context model's nodes form a cycle; this is a host bug")
    return out
