"""Test helpers: the context bytes of a saved context model's EPContext nodes, embedded
(`embed_mode=1`) or in the files beside the model that the nodes name (`embed_mode=0`, the default)."""

from __future__ import annotations

from pathlib import Path

import onnx


def _nodes(proto: onnx.ModelProto):
    for node in proto.graph.node:
        if node.op_type == "EPContext":
            attrs = {a.name: a for a in node.attribute}
            yield attrs["ep_cache_context"], ("embed_mode" not in attrs or attrs["embed_mode"].i == 1)


def context_files(path: Path) -> list[Path]:
    """The files beside the model at `path` that its EPContext nodes name (none when embedded)."""
    path = Path(path)
    return [path.parent / cache.s.decode() for cache, embedded in _nodes(onnx.load(str(path))) if not embedded]


def context_blobs(path: Path) -> list[bytes]:
    """Each EPContext node's bytes, in node order."""
    path = Path(path)
    return [cache.s if embedded else (path.parent / cache.s.decode()).read_bytes()
            for cache, embedded in _nodes(onnx.load(str(path)))]


def edit_contexts(path: Path, edit) -> None:
    """Rewrite each EPContext node's bytes with `edit(bytes) -> bytes`, where they are."""
    path = Path(path)
    proto = onnx.load(str(path))
    for cache, embedded in _nodes(proto):
        if embedded:
            cache.s = edit(cache.s)
        else:
            file = path.parent / cache.s.decode()
            file.write_bytes(edit(file.read_bytes()))
    onnx.save(proto, str(path))
