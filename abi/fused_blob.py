"""A FusedGraph as bytes and back: the simplest context a Python plugin can save (ABI v7).

A plugin whose compiled form is cheap to rebuild from the subgraph (or whose heavy artefacts
already live in a disk cache keyed by their source) can save the FusedGraph Compile received as
its context (`to_bytes`) and rebuild it in CompileFromContext (`from_bytes`, then its own
compile). JSON for the structure and `np.savez` for constants and tensor attributes, behind a
magic header: a context read from a model file never runs code (no pickle).
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np

from abi.graph_spec import FusedGraph, GraphSpec, NodeSpec, ValueSpec, _io_spec

MAGIC = b"EPHOST-FUSED-GRAPH\0"
FORMAT = 1


class BlobError(ValueError):
    """Bytes that are not a FusedGraph this module wrote (damaged, truncated, another format)."""


def to_bytes(fused: FusedGraph) -> bytes:
    """`fused` as bytes that `from_bytes` turns back into an equal FusedGraph."""
    arrays: dict[str, np.ndarray] = {}
    g = fused.graph
    values = []
    for i, v in enumerate(g.values):
        if v.constant is not None:
            arrays[f"v{i}"] = v.constant
        values.append([v.name, v.elem_type, None if v.shape is None else list(v.shape), v.kind])
    nodes = []
    for n in g.nodes:
        attrs = {}
        for k, a in n.attrs.items():
            if isinstance(a, np.ndarray):
                arrays[f"n{n.index}.{k}"] = a
                attrs[k] = {"array": f"n{n.index}.{k}"}
            else:
                attrs[k] = {"value": a}
        nodes.append([n.index, n.name, n.op_type, n.domain, n.opset, list(n.inputs), list(n.outputs), attrs])
    head = {"format": FORMAT, "name": fused.name, "graph": g.name, "values": values, "nodes": nodes,
            "inputs": list(g.input_ids), "outputs": list(g.output_ids)}
    text = json.dumps(head).encode()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return MAGIC + len(text).to_bytes(8, "little") + text + buf.getvalue()


def from_bytes(blob: bytes) -> FusedGraph:
    """The FusedGraph `to_bytes` wrote; BlobError on anything else."""
    try:
        head, arrays = _split(blob)
        return _build(head, arrays)
    except BlobError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BlobError(f"not a readable fused graph ({len(blob)} bytes): {type(exc).__name__}: {exc}") from None


def _split(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    if not blob.startswith(MAGIC):
        raise BlobError(f"not a fused graph ({len(blob)} bytes): no {MAGIC[:-1].decode()} header")
    start = len(MAGIC) + 8
    size = int.from_bytes(blob[len(MAGIC):start], "little")
    if start + size > len(blob):
        raise BlobError(f"truncated fused graph: the header needs {size} bytes, {max(0, len(blob) - start)} follow")
    head = json.loads(blob[start:start + size])
    if head.get("format") != FORMAT:
        raise BlobError(f"fused graph format {head.get('format')!r}; this SDK reads {FORMAT}")
    with np.load(io.BytesIO(blob[start + size:]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return head, arrays


def _build(head: dict, arrays: dict[str, np.ndarray]) -> FusedGraph:
    values = [ValueSpec(name, elem, None if shape is None else tuple(shape), kind, arrays.get(f"v{i}"))
              for i, (name, elem, shape, kind) in enumerate(head["values"])]
    nodes = []
    for index, name, op, domain, opset, ins, outs, attrs in head["nodes"]:
        decoded = {k: arrays[a["array"]] if "array" in a else a["value"] for k, a in attrs.items()}
        nodes.append(NodeSpec(index, name, op, domain, opset, tuple(ins), tuple(outs), decoded))
    ins, outs = tuple(head["inputs"]), tuple(head["outputs"])
    graph = GraphSpec(nodes, values, [_io_spec(values[i]) for i in ins], [_io_spec(values[i]) for i in outs], ins,
                      outs, head["graph"])
    return FusedGraph(head["name"], graph)
