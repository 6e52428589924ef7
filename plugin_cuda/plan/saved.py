"""The CUDA plugin's saved context (ABI v7): a compiled partition as bytes, and back.

A context holds what rebuilding the partition's plan would otherwise redo on the device:

  graph    the fused subgraph without its constants, in abi/fused_blob.py's own framing (its format
           number inside; small tensor attributes stay in it);
  array    one per constant of the subgraph (the weights): its raw bytes, with the value's index, dtype
           and shape in the header, each starting 64-byte aligned in the context, so that loading
           makes NumPy views of the context's bytes (no copy, no zip to read; plan format 3);
  modules  NVRTC's output for the plan's generated source, one per module, each with its
           architecture ("sm_90": a cubin; "compute_90": PTX) and source hash (nvrtc.source_hash):
           loaded through nvrtc.provide, so the plan's `nvrtc.load` finds it without compiling;
  algos    the cuBLASLt heuristic answers and cuDNN algorithm choices the partition made
           (device/algo_cache.py keys), handed to algo_cache.provide;
  warm     (in the header, optional) the EP's per-node kernel warm-up recipes, replayed in a
           background thread at load (plugin_cuda/kernel_prefetch.py);
  cupy     one per CuPy kernel those recipes loaded or compiled: its payload under CuPy's own cache
           name (plugin_cuda/cupy_cache.py), handed to CuPy's kernel cache before the recipes replay.

Lowering and code generation run again at load (pure Python: the generated source's hash is what
finds the saved module); a symbolic-shape partition keeps the modules of the signatures it had
planned when the context was written, and plans each signature again at its first call.

Layout: MAGIC, the plan format (uint32 LE), the header's length (uint64 LE), the header (JSON),
then the sections back to back. The header lists each section's offset, size and CRC-32 (damage, not
tampering, is what it detects: a context is as trusted as the model holding it; CRC-32 reads a
BERT-size section three times faster than SHA-256), so a truncated or altered context is refused
(PlanBlobError) before anything is loaded from it; the
plugin then answers CompileFromContext with an error and the host compiles the kept subgraph.
A bare fused_blob (what the plugin wrote before plan format 2) still loads: graph only. Plan format 2
(the constants inside the graph section's np.savez) is not read: its compatibility string names
format 2, which this plugin answers with prefer recompilation before the bytes are ever read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

import abi
from abi import fused_blob
from abi.graph_spec import FusedGraph

MAGIC = b"EPHOST-CUDA-PLAN\0"
# 1 was the bare fused graph (abi/fused_blob.py), still read by `unpack`; 2 kept the constants in
# the graph section's np.savez (copied three times at load), 3 keeps them as array sections, 4 adds
# the per-node kernels' CuPy payloads (a section a format-3 reader refuses).
FORMAT = 4
_FIXED = len(MAGIC) + 4 + 8
ALIGN = 64  # where array sections start, from the context's first byte
SECTIONS = ("graph", "module", "array", "cupy")
_CRC_THREADS = 8
_CRC_PARALLEL_BYTES = 64 << 20  # below this, threads cost more than they save

__all__ = ["FORMAT", "MAGIC", "PlanBlobError", "SavedModule", "SavedPlan", "pack", "unpack"]


class PlanBlobError(fused_blob.BlobError):
    """Bytes that are not a CUDA plan context this plugin reads (damaged, truncated, another format)."""


@dataclass(frozen=True)
class SavedModule:
    arch: str  # "sm_XY" or "compute_XY"
    digest: str  # nvrtc.source_hash of the generated source
    binary: bytes


@dataclass
class SavedPlan:
    graph: bytes  # abi/fused_blob.py bytes (without the constants of `constants`)
    cc: str = ""  # the compute capability it was compiled on ("" for a bare fused graph)
    modules: list[SavedModule] = field(default_factory=list)
    algos: dict = field(default_factory=dict)
    format: int = FORMAT
    constants: dict[int, np.ndarray] = field(default_factory=dict)  # value index -> its constant
    warm: list = field(default_factory=list)  # the EP's per-node warm-up recipes (kernel_prefetch.py)
    cupy: dict[str, bytes] = field(default_factory=dict)  # CuPy cache name -> payload (cupy_cache.py)

    @classmethod
    def of(cls, fused: FusedGraph, **kw) -> SavedPlan:
        """The SavedPlan of `fused`: its constants apart (array sections), the rest as the graph."""
        values = fused.graph.values
        constants = {i: v.constant for i, v in enumerate(values) if v.constant is not None}
        bare = [dataclasses.replace(v, constant=None) if i in constants else v for i, v in enumerate(values)]
        graph = dataclasses.replace(fused.graph, values=bare)
        return cls(fused_blob.to_bytes(dataclasses.replace(fused, graph=graph)), constants=constants, **kw)

    def fused_graph(self) -> FusedGraph:
        """The subgraph with its constants (each with the shape it was saved with, as np.savez kept it:
        a value's declared shape may differ, () for a one-element constant); PlanBlobError when its own
        bytes do not read or an array names a value that cannot take it."""
        try:
            fused = fused_blob.from_bytes(self.graph)
        except fused_blob.BlobError as exc:
            raise PlanBlobError(f"graph section: {exc}") from None
        values = fused.graph.values
        for i, arr in self.constants.items():
            if not 0 <= i < len(values) or values[i].kind != abi.VALUE_INITIALIZER or values[i].constant is not None:
                raise PlanBlobError(f"CUDA plan context array for value {i}: the graph has {len(values)} values; "
                                    "expected the index of an initializer without a constant")
            values[i].constant = arr
        return fused


def pack(saved: SavedPlan) -> bytes:
    """`saved` as bytes that `unpack` turns back into an equal SavedPlan. Every section starts at a
    multiple of ALIGN from the first byte (the header is padded with spaces, the sections with zeros
    before them)."""
    sections, payload, offset = [], [], 0

    def add(name: str, data, **extra) -> None:
        nonlocal offset
        data = memoryview(data).cast("B")
        pad = -offset % ALIGN  # zeros before the section, none after the last one
        offset += pad
        sections.append({"name": name, "offset": offset, "size": data.nbytes, "crc32": zlib.crc32(data), **extra})
        payload.extend((bytes(pad), data))
        offset += data.nbytes

    add("graph", saved.graph)
    for i, arr in sorted(saved.constants.items()):
        arr = np.ascontiguousarray(arr)
        add("array", arr.reshape(-1).view(np.uint8), value=i, dtype=arr.dtype.str, shape=list(arr.shape))
    for m in saved.modules:
        add("module", m.binary, arch=m.arch, digest=m.digest)
    for name, binary in sorted(saved.cupy.items()):
        add("cupy", binary, key=name)
    head = json.dumps({"format": FORMAT, "cc": saved.cc, "algos": saved.algos, "sections": sections,
                       "warm": saved.warm}, sort_keys=True).encode()
    head += b" " * (-(_FIXED + len(head)) % ALIGN)  # JSON ignores trailing blanks
    return MAGIC + FORMAT.to_bytes(4, "little") + len(head).to_bytes(8, "little") + head + b"".join(payload)


def unpack(blob) -> SavedPlan:
    """The SavedPlan `pack` wrote (or a bare fused graph's, graph only); PlanBlobError on anything else.
    `blob` is any bytes-like object (bytes, a memoryview, a mapped file): the arrays are views of it,
    never copies, so it must outlive them (the host keeps CompileFromContext's bytes until the compute
    info is released)."""
    view = memoryview(blob).cast("B")
    if _starts(view, fused_blob.MAGIC):
        return SavedPlan(graph=bytes(view), format=1)
    if not _starts(view, MAGIC):
        raise PlanBlobError(f"not a CUDA plan context ({len(view)} bytes): no {MAGIC[:-1].decode()} header "
                            f"(allowed: plan format {FORMAT}, or a bare fused graph)")
    if len(view) < _FIXED:
        raise PlanBlobError(f"truncated CUDA plan context: {len(view)} bytes, the fixed header needs {_FIXED}")
    version = int.from_bytes(view[len(MAGIC):len(MAGIC) + 4], "little")
    if version != FORMAT:
        raise PlanBlobError(f"CUDA plan context format {version}; this plugin reads format {FORMAT} "
                            "(and bare fused graphs)")
    size = int.from_bytes(view[len(MAGIC) + 4:_FIXED], "little")
    if _FIXED + size > len(view):
        raise PlanBlobError(f"truncated CUDA plan context: the header needs {size} bytes, "
                            f"{len(view) - _FIXED} follow")
    try:
        head = json.loads(bytes(view[_FIXED:_FIXED + size]))
        return _read_sections(head, view, _FIXED + size)
    except PlanBlobError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanBlobError(f"unreadable CUDA plan context header: {type(exc).__name__}: {exc}") from None


def _starts(view: memoryview, magic: bytes) -> bool:
    return len(view) >= len(magic) and view[:len(magic)] == magic


def _read_sections(head: dict, blob: memoryview, base: int) -> SavedPlan:
    """The sections listed in `head`, which follow it from byte `base` of `blob`."""
    if head.get("format") != FORMAT:
        raise PlanBlobError(f"CUDA plan context header says format {head.get('format')!r}; expected {FORMAT}")
    warm = head.get("warm", [])  # absent from contexts written before the recipes
    if not isinstance(warm, list):
        raise PlanBlobError(f"CUDA plan context header: 'warm' is a {type(warm).__name__}; expected a list")
    saved = SavedPlan(graph=b"", cc=str(head["cc"]), algos=dict(head["algos"]), warm=warm)
    graphs = 0
    payload = blob[base:]
    sections = [(s, _section(s, payload)) for s in head["sections"]]
    _check_crcs(sections)
    for s, data in sections:
        if s["name"] == "graph":
            saved.graph = bytes(data)
            graphs += 1
        elif s["name"] == "module":
            saved.modules.append(SavedModule(str(s["arch"]), str(s["digest"]), bytes(data)))
        elif s["name"] == "array":
            if int(s["value"]) in saved.constants:
                raise PlanBlobError(f"CUDA plan context has two array sections for value {s['value']}")
            saved.constants[int(s["value"])] = _array(s, data)
        elif s["name"] == "cupy":
            saved.cupy[str(s["key"])] = bytes(data)
        else:
            raise PlanBlobError(f"CUDA plan context section {s['name']!r}; allowed: "
                                f"{', '.join(repr(n) for n in SECTIONS)}")
    if graphs != 1:
        raise PlanBlobError(f"CUDA plan context has {graphs} graph sections; expected 1")
    return saved


def _section(s: dict, payload: memoryview) -> memoryview:
    """A section's bytes (a view), checked against its size (the CRC-32: _check_crcs)."""
    start, size = int(s["offset"]), int(s["size"])
    if start < 0 or size < 0 or start + size > len(payload):
        raise PlanBlobError(f"truncated CUDA plan context: section {s['name']!r} needs bytes {start}..{start + size}, "
                            f"{len(payload)} follow the header")
    return payload[start:start + size]


def _check_crcs(sections: list) -> None:
    """Each section against its CRC-32. zlib releases the GIL for large buffers, so a large context is
    checked by several threads (440 MB: 0.16 s in one thread on a 2-CPU VM)."""
    total = sum(len(data) for _, data in sections)
    workers = min(_CRC_THREADS, os.cpu_count() or 1) if total >= _CRC_PARALLEL_BYTES else 1
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            crcs = list(pool.map(lambda item: zlib.crc32(item[1]), sections))
    else:
        crcs = [zlib.crc32(data) for _, data in sections]
    for (s, data), crc in zip(sections, crcs):
        if crc != s["crc32"]:
            raise PlanBlobError(f"damaged CUDA plan context: section {s['name']!r} ({len(data)} bytes) does not "
                                "match its CRC-32")


def _array(s: dict, data: memoryview) -> np.ndarray:
    """An array section as a read-only NumPy view of the context's bytes (they stay alive with it)."""
    dtype, shape = np.dtype(s["dtype"]), tuple(int(d) for d in s["shape"])
    if dtype.hasobject or any(d < 0 for d in shape) or dtype.itemsize * int(np.prod(shape)) != int(s["size"]):
        raise PlanBlobError(f"CUDA plan context array for value {s['value']}: {s['size']} bytes do not hold a "
                            f"{dtype} array of shape {list(shape)}")
    arr = np.frombuffer(data, dtype, int(np.prod(shape))).reshape(shape)
    arr.flags.writeable = False
    return arr
