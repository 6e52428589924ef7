"""Compiled partitions (ABI v6): fused groups claimed in GetCapability, Ep.Compile, one Compute per run.

Session creation: `collect_claims` runs every EP's GetCapability with a fuse collector open on
the graph view, and accepts a group when none of its nodes is taken yet and fusing it creates no
cycle. `compile_groups` calls Ep.Compile once per EP with all its groups (a view of just the
group's nodes each); where that fails, each group is compiled alone, so only the groups that
fail fall back to per-node kernels, with a warning.

Run time: a `FrameContext` per thread and partition owns one EpCallFrame, refilled per run.
Outputs whose shapes shape inference fixed are preallocated on the EP's device before the call
(no callback); the others come through the frame's AllocateOutput callback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

import abi
from abi.dtypes import STRING
from host.errors import EpError, InvalidArgument, KernelError
from host.plugins import hostapi
from host.plugins.ep import PluginEp, SyncStream
from host.plugins.hostapi import ffi
from host.plugins.loader import Slots, negotiate, release_rejected
from host.runtime import stages
from host.runtime.graphview import GraphView
from host.runtime.model import Graph, ValueMeta, host_only_nodes
from host.runtime.tensor import Allocation, check_output_dims
from host.runtime.warn import warn_caller

_NULL = ffi.NULL
FUSED_OP_TYPE = "FusedPartition"
FUSED_DOMAIN = "ai.ephost.fused"
MAX_TENSOR_BYTES = 1 << 62  # beyond any device; keeps shape arithmetic inside int64


# ---- claiming ---------------------------------------------------------------------------------
@dataclass
class Claims:
    """What GetCapability gave: node -> EP for single nodes, accepted fused groups per EP."""

    single: dict[int, PluginEp] = field(default_factory=dict)
    groups: list[tuple[PluginEp, tuple[int, ...]]] = field(default_factory=list)
    per_node_ok: dict[int, set[int]] = field(default_factory=dict)  # id(ep) -> nodes also claimed singly

    def drop(self, nodes) -> None:
        """Forget every claim on `nodes` (taken already: saved partitions of a context model)."""
        nodes = set(nodes)
        self.single = {i: ep for i, ep in self.single.items() if i not in nodes}
        self.groups = [(ep, g) for ep, g in self.groups if not nodes.intersection(g)]


def can_compile(ep: PluginEp) -> bool:
    return ep.slots.Compile is not None


def collect_claims(eps: list[PluginEp], view: GraphView, graph: Graph, fallbacks) -> Claims:
    """Ask each EP in priority order; a node goes to the first EP that claims it (fused or single)."""
    n = len(graph.nodes)
    claims = Claims()
    # Control flow and nodes on sequence / optional values stay with the host (model.host_only_nodes);
    # string tensors live in host memory as Python objects, which no plugin can read: their nodes stay
    # on the CPU EP whatever an EP claims.
    host_only = host_only_nodes(graph) | string_nodes(graph)
    taken: set[int] = set(host_only)
    for ep in eps:
        claimed = ffi.new("uint8_t[]", max(n, 1))
        # A v6 host serves Graph_AddNodesToFuse to every v6 EP; groups of an EP that cannot
        # compile (Compile NULL) are dropped and its per-node claims stand.
        groups = hostapi.FUSE_GROUPS.begin(view.ptr) if ep.slots.negotiated >= 6 else []
        try:
            hostapi.check(ep.slots.GetCapability(ep.ptr, view.ptr, claimed), f"{ep.owner}: GetCapability")
        finally:
            hostapi.FUSE_GROUPS.end(view.ptr)
        singles = {i for i in range(n) if claimed[i]}
        if singles & host_only:
            fallbacks["host_only_claims"] += len(singles & host_only)
        claims.per_node_ok[id(ep)] = singles
        if groups and not can_compile(ep):
            fallbacks["fused_groups_without_compile"] += len(groups)
            groups = []
        for group in groups:
            if taken.intersection(group):
                fallbacks["fused_group_overlaps"] += 1
                continue
            if not is_convex(graph, set(group)):
                fallbacks["fused_group_not_convex"] += 1
                warn_caller(f"{ep.owner}: fused group {list(group)} is not convex (a path leaves it and comes "
                            "back); its nodes are not fused")
                continue
            ordered = tuple(sorted(group))  # the model's node order is topological
            claims.groups.append((ep, ordered))
            taken.update(ordered)
        for i in sorted(singles - taken):
            claims.single[i] = ep
            taken.add(i)
    return claims


def string_nodes(graph: Graph) -> set[int]:
    """Indices of the nodes that read or write a string tensor."""
    def is_string(name: str) -> bool:
        meta = graph.values.get(name)
        return meta is not None and meta.elem_type == STRING
    return {i for i, node in enumerate(graph.nodes) if any(is_string(v) for v in (*node.inputs, *node.outputs) if v)}


def _consumers(graph: Graph) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            if name:
                out.setdefault(name, []).append(i)
    return out


def is_convex(graph: Graph, group: set[int]) -> bool:
    """True when no path leaves `group` and re-enters it (fusing it would create a cycle)."""
    consumers = _consumers(graph)
    frontier = [c for i in group for o in graph.nodes[i].outputs if o for c in consumers.get(o, ())
                if c not in group]
    seen: set[int] = set()
    while frontier:
        i = frontier.pop()
        if i in seen:
            continue
        seen.add(i)
        for o in graph.nodes[i].outputs:
            for c in consumers.get(o, ()) if o else ():
                if c in group:
                    return False
                frontier.append(c)
    return True


# ---- the fused subgraph ------------------------------------------------------------------------
@dataclass
class FusedGroup:
    """One accepted group: its nodes, its frame inputs/outputs (value names) and its views."""

    ep: PluginEp
    nodes: tuple[int, ...]
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    view: GraphView | None = None
    node_view: object = None
    error: str = "Compile failed"  # why it fell back, when it did


def describe_group(graph: Graph, ep: PluginEp, nodes: tuple[int, ...], name: str) -> FusedGroup:
    inside = set(nodes)
    produced = {o for i in nodes for o in graph.nodes[i].outputs if o}
    inputs: dict[str, None] = {}
    for i in nodes:
        for x in graph.nodes[i].inputs:
            if x and x not in produced and x not in graph.initializers:
                inputs[x] = None
    graph_outputs = {v.name for v in graph.outputs}
    used_outside = {x for j, node in enumerate(graph.nodes) if j not in inside for x in node.inputs if x}
    outputs = [o for i in nodes for o in graph.nodes[i].outputs
               if o and (o in used_outside or o in graph_outputs)]
    group = FusedGroup(ep, nodes, name, tuple(inputs), tuple(dict.fromkeys(outputs)))
    group.view = _subgraph_view(graph, group)
    group.node_view = _fused_node_view(group)
    return group


def _subgraph_view(graph: Graph, group: FusedGroup) -> GraphView:
    """A GraphView of just the group's nodes, the initializers they read, its inputs and outputs."""
    nodes = [graph.nodes[i] for i in group.nodes]
    used = {x for n in nodes for x in n.inputs if x}
    meta = {name: graph.values.get(name) or ValueMeta(name) for n in nodes for name in (*n.inputs, *n.outputs)
            if name}
    sub = Graph(SimpleNamespace(graph=SimpleNamespace(name=group.name)), nodes, meta,
                {k: v for k, v in graph.initializers.items() if k in used},
                [meta[x] for x in group.inputs], [meta[x] for x in group.outputs], graph.opsets)
    return GraphView(sub)


def _fused_node_view(group: FusedGroup):
    view = group.view
    c = ffi.new("EpNodeView*")
    keep = [c]
    for attr, text in (("name", group.name), ("op_type", FUSED_OP_TYPE), ("domain", FUSED_DOMAIN)):
        s = ffi.new("char[]", text.encode())
        keep.append(s)
        setattr(c, attr, s)
    c.opset = 1
    ins = ffi.new("int32_t[]", [view.value_index[x] for x in group.inputs] or [0])
    outs = ffi.new("int32_t[]", [view.value_index[x] for x in group.outputs] or [0])
    keep += [ins, outs]
    c.num_inputs, c.inputs = len(group.inputs), ins
    c.num_outputs, c.outputs = len(group.outputs), outs
    view._keep.append(keep)
    return c


# ---- compiling ---------------------------------------------------------------------------------
class CompiledPartition:
    """A compiled fused node: its EpNodeComputeInfo slots and state; the kernel of its PlanNode."""

    def __init__(self, group: FusedGroup, info: Slots, graph: Graph):
        self.group = group
        self.info = info
        self.ptr = info.ptr
        self.compute = info.Compute
        self.name = group.name
        self.node_names = tuple(graph.nodes[i].name for i in group.nodes)
        self.node_ops = tuple(graph.nodes[i].op_type for i in group.nodes)
        metas = [graph.values.get(o) for o in group.outputs]
        # Static output shapes (known after shape inference) are preallocated by the host.
        self.static_shapes = [static_shape(m) for m in metas]
        self.inferred_dims = [inferred_dims(m) for m in metas]
        self.state = _NULL
        self._released = False
        if info.CreateState is not None:
            out = ffi.new("void**")
            hostapi.check(info.CreateState(info.ptr, out), f"{group.ep.owner}: CreateState of fused node "
                                                           f"'{group.name}'")
            self.state = out[0]

    def describe_error(self, error_node: int) -> str:
        nodes = ", ".join(f"'{n}'" for n in self.node_names)
        where = f"fused node '{self.name}' (nodes {nodes}) on {self.group.ep.name}"
        if 0 <= error_node < len(self.node_names):
            where += f", at node '{self.node_names[error_node]}' ({self.node_ops[error_node]})"
        return where

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        info = self.info
        if info.ReleaseState is not None and self.state != _NULL:
            info.ReleaseState(info.ptr, self.state)
        info.Release(info.ptr)


def _compile(ep: PluginEp, groups: list[FusedGroup]) -> list:
    """Ep.Compile over `groups`; the EpNodeComputeInfo* array (raises EpError on a failed status)."""
    graphs = ffi.new("EpGraphView*[]", [g.view.ptr for g in groups])
    nodes = ffi.new("EpNodeView[]", len(groups))
    for i, g in enumerate(groups):
        nodes[i] = g.node_view[0]
    out = ffi.new("EpNodeComputeInfo*[]", len(groups))
    names = ", ".join(f"'{g.name}'" for g in groups)
    hostapi.check(ep.slots.Compile(ep.ptr, graphs, nodes, len(groups), out), f"{ep.owner}: Compile of {names}")
    return [out[i] for i in range(len(groups))]


def compile_groups(groups: list[FusedGroup], graph: Graph, fallbacks) -> tuple[list[CompiledPartition],
                                                                                   list[FusedGroup]]:
    """Compile each EP's groups in one call; returns (compiled, groups that must run per node)."""
    compiled: list[CompiledPartition] = []
    failed: list[FusedGroup] = []
    by_ep: dict[int, list[FusedGroup]] = {}
    for g in groups:
        by_ep.setdefault(id(g.ep), []).append(g)
    for batch in by_ep.values():
        ep = batch[0].ep
        stages.enter(stages.COMPILING, ep.name)
        try:
            infos = _compile(ep, batch)
            pairs = list(zip(batch, infos))
        except EpError as exc:
            if len(batch) == 1:
                batch[0].error = str(exc)
                pairs = [(batch[0], None)]
            else:
                # Find which partitions fail: each alone, so the others still run compiled.
                pairs = [(g, _compile_one(ep, g)) for g in batch]
        for g, info in pairs:
            part = _partition(ep, g, info, graph) if info is not None else None
            if part is None:
                failed.append(g)
            else:
                compiled.append(part)
    for g in failed:
        fallbacks["compile_failed"] += 1
        warn_caller(_failure_text(g))
    return compiled, failed


def _compile_one(ep: PluginEp, group: FusedGroup):
    try:
        return _compile(ep, [group])[0]
    except EpError as exc:
        group.error = str(exc)
        return None


def _partition(ep: PluginEp, group: FusedGroup, info_ptr, graph: Graph) -> CompiledPartition | None:
    try:
        info = negotiate("EpNodeComputeInfo", info_ptr, ep.slots.negotiated, f"{ep.owner}: fused node "
                                                                              f"'{group.name}'")
    except Exception as exc:  # noqa: BLE001 - a bad table means per-node kernels
        group.error = str(exc)
        release_rejected("EpNodeComputeInfo", info_ptr)  # where its Release slot can still be found
        return None
    try:
        return CompiledPartition(group, info, graph)
    except Exception as exc:  # noqa: BLE001 - a failed CreateState means per-node kernels
        group.error = str(exc)
        info.Release(info.ptr)
        return None


adopt_compute_info = _partition  # ABI v7: epcontext.py adopts what CompileFromContext returned


def _failure_text(group: FusedGroup) -> str:
    return (f"{group.ep.name}: fused node '{group.name}' could not be compiled ({group.error}); its "
            f"{len(group.nodes)} node(s) run as per-node kernels")


# ---- planning ---------------------------------------------------------------------------------
def unit_order(graph: Graph, units: list[tuple[int, ...]]) -> list[int]:
    """Topological order of `units` (each a tuple of node indices; fused groups contracted to one)."""
    unit_of = {i: u for u, nodes in enumerate(units) for i in nodes}
    producer = {o: unit_of[i] for i, n in enumerate(graph.nodes) if i in unit_of for o in n.outputs if o}
    deps = [set() for _ in units]
    for u, nodes in enumerate(units):
        for i in nodes:
            for x in graph.nodes[i].inputs:
                p = producer.get(x) if x else None
                if p is not None and p != u:
                    deps[u].add(p)
    order, done = [], set()
    pending = sorted(range(len(units)), key=lambda u: min(units[u]))
    while pending:
        ready = next((u for u in pending if deps[u] <= done), None)
        if ready is None:
            raise EpError("fused partitions form a cycle; this is a host bug (groups are checked for convexity)")
        pending.remove(ready)
        order.append(ready)
        done.add(ready)
    return order


def static_shape(meta: ValueMeta | None) -> tuple[int, ...] | None:
    """The shape when every dimension is a known int (0 allowed), else None."""
    if meta is None or meta.shape is None:
        return None
    if all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in meta.shape):
        return tuple(meta.shape)
    return None


def inferred_dims(meta: ValueMeta | None) -> tuple[int, ...] | None:
    if meta is None or meta.shape is None:
        return None
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in meta.shape)


# ---- run time ----------------------------------------------------------------------------------
class FrameRegistry:
    """Maps the context pointers of call frames to their FrameContext (cffi pointers key by address)."""

    def __init__(self) -> None:
        self._items: dict[object, FrameContext] = {}

    def add(self, ctx: FrameContext):
        holder = ffi.new("char[1]")
        key = ffi.cast("void*", holder)
        self._items[key] = ctx
        return key, holder

    def get(self, key) -> FrameContext | None:
        return self._items.get(key)

    def remove(self, key) -> None:
        self._items.pop(key, None)


FRAMES = FrameRegistry()


def _status(code: int, message: str):
    return hostapi.STATUSES.create(code, message.encode("utf-8", "replace"))


@ffi.callback("EpStatus*(void*, int32_t, const int64_t*, int32_t, void**)", onerror=hostapi._status_onerror)
def _allocate_output(context, index, dims, rank, data):
    ctx = FRAMES.get(context)
    if ctx is None or not ctx.active or data == _NULL or rank < 0 or (rank > 0 and dims == _NULL):
        return _status(abi.EP_INVALID_ARGUMENT, "AllocateOutput: unknown frame context (a frame used outside "
                                                "Compute), NULL out, or a bad rank/dims")
    if rank > hostapi.MAX_RANK:  # checked before a single dim is read
        return _status(abi.EP_INVALID_ARGUMENT, f"AllocateOutput: rank {int(rank)} is not allowed; expected "
                                                f"0..{hostapi.MAX_RANK}")
    try:
        data[0] = ctx.allocate_output(int(index), tuple(int(dims[d]) for d in range(rank)))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status for the plugin
        return _status(getattr(exc, "abi_code", abi.EP_FAIL), f"AllocateOutput: {exc}")
    return _NULL


@ffi.callback("EpStatus*(void*, size_t, void**)", onerror=hostapi._status_onerror)
def _alloc_scratch(context, nbytes, data):
    ctx = FRAMES.get(context)
    if ctx is None or not ctx.active or data == _NULL:
        return _status(abi.EP_INVALID_ARGUMENT, "AllocScratch: unknown frame context or NULL out")
    try:
        data[0] = ffi.cast("void*", ctx.alloc_scratch(int(nbytes)))
    except Exception as exc:  # noqa: BLE001
        return _status(abi.EP_OUT_OF_MEMORY, f"AllocScratch: {exc}")
    return _NULL


@ffi.callback("void(void*, void*)", onerror=hostapi._log_onerror)
def _free_scratch(context, data):
    ctx = FRAMES.get(context)
    if ctx is not None and ctx.active:
        ctx.free_scratch(int(ffi.cast("uintptr_t", data)))


class _OutputRequest(InvalidArgument):
    abi_code = abi.EP_INVALID_ARGUMENT


class FrameContext:
    """The EpCallFrame of one compiled partition on one thread, with its C arrays."""

    def __init__(self, run, node, stream: SyncStream | None):
        part: CompiledPartition = node.kernel
        self.run = run
        self.node = node
        self.part = part
        self.ep: PluginEp = node.ep
        self.stream = stream
        self.compute = part.compute
        self.frame = f = ffi.new("EpCallFrame*")
        f.struct_size, f.version = ffi.sizeof("EpCallFrame"), abi.ABI_VERSION
        f.stream = stream.handle if stream is not None else _NULL
        f.sync_stream = stream.ptr if stream is not None else _NULL
        f.num_inputs, f.num_outputs = len(node.inputs), len(node.outputs)
        self.inputs = ffi.new("EpFrameTensor[]", max(len(node.inputs), 1))
        self.outputs = ffi.new("EpFrameTensor[]", max(len(node.outputs), 1))
        f.inputs, f.outputs = self.inputs, self.outputs
        self.active = False  # True only during Compute: a frame kept past its call is refused
        self.key, self._holder = FRAMES.add(self)
        f.AllocateOutput, f.allocate_context = _allocate_output, self.key
        f.AllocScratch, f.FreeScratch, f.scratch_context = _alloc_scratch, _free_scratch, self.key
        self.static = part.static_shapes
        self._dims = []  # dims arrays of outputs the host does not preallocate (inferred, -1 unknown)
        for dims in part.inferred_dims:
            self._dims.append((ffi.new("int64_t[]", list(dims) or [0]), len(dims)) if dims is not None
                              else (_NULL, -1))
        self.scratch: dict[int, object] = {}

    # callbacks
    def allocate_output(self, index: int, dims: tuple) -> object:
        if not 0 <= index < len(self.node.outputs):
            raise _OutputRequest(f"output index {index} out of range 0..{len(self.node.outputs) - 1}")
        t = self.outputs[index]
        vid = self.node.outputs[index]
        name = self.run.plan.value_names[vid]
        itemsize = self.run.executor.dtype_of(vid).itemsize
        if any(d < 0 for d in dims) or math.prod(dims) * itemsize > MAX_TENSOR_BYTES:
            raise _OutputRequest(f"output {index} ('{name}'): dims {list(dims)} must be >= 0 and hold at most "
                                 f"{MAX_TENSOR_BYTES} bytes")
        check_output_dims(dims, self.run.executor.dtype_of(vid), f"output {index} of fused node '{self.part.name}'")
        if t.data != _NULL:
            have = tuple(t.dims[d] for d in range(t.rank))
            if have != dims:
                raise _OutputRequest(f"output {index} ('{name}') is already allocated "
                                     f"with shape {list(have)}; asked for {list(dims)}")
            return t.data
        value = self.run.make_output(vid, dims, self.ep, self.stream)
        self._fill(t, value)
        return t.data

    def alloc_scratch(self, nbytes: int) -> int:
        ep = self.ep
        if ep.allocator is None:
            block = np.empty(max(nbytes, 1), np.uint8)  # a CPU EP with no allocator: host memory
            ptr = block.ctypes.data
        else:
            block = Allocation(ep.allocator, max(nbytes, 1), self.stream.ptr if self.stream else None, ep.owner)
            ptr = block.ptr
        self.scratch[ptr] = block
        return ptr

    def free_scratch(self, ptr: int) -> None:
        block = self.scratch.pop(ptr, None)
        if isinstance(block, Allocation):
            block.close()

    # one run
    def _fill(self, t, value) -> None:
        if isinstance(value, np.ndarray):
            # Not from_buffer: an empty array must still give a non-NULL pointer ("allocated").
            t.data = ffi.cast("void*", value.ctypes.data)
        else:
            t.data = ffi.cast("void*", value.ptr)
        shape = value.shape
        t.dims = self.run.shape_array(shape)
        t.rank = len(shape)
        t.elem_type = self.run.executor.elem_type_of(value.dtype)

    def execute(self, executor, capturing: bool) -> None:
        st, node, ep, stream = self.run, self.node, self.ep, self.stream
        for j, vid in enumerate(node.inputs):
            self._fill(self.inputs[j], executor._input_for(st, vid, ep.location, stream, ep))
        outs = self.outputs
        for j, vid in enumerate(node.outputs):
            t = outs[j]
            shape = self.static[j]
            t.elem_type = executor.elem_type_of(executor.dtype_of(vid))
            if shape is not None:
                self._fill(t, st.make_output(vid, shape, ep, stream))
            else:
                t.data = _NULL
                t.dims, t.rank = self._dims[j]
        f = self.frame
        f.capturing = 1 if capturing else 0
        f.error_node = -1
        self.active = True
        try:
            status = self.compute(self.part.ptr, self.part.state, f)
        finally:
            self.active = False
            for ptr in list(self.scratch):
                self.free_scratch(ptr)
        if status != _NULL:
            where = self.part.describe_error(int(f.error_node))
            try:
                hostapi.check(status, where, KernelError)
            except KernelError as exc:
                exc.node, exc.ep = self.part.name, ep.name
                raise
        missing = [st.plan.value_names[vid] for j, vid in enumerate(node.outputs) if outs[j].data == _NULL]
        if missing:
            raise KernelError(f"{self.part.describe_error(-1)} returned without producing output(s) {missing}",
                              self.part.name, ep.name)
        if stream is not None:
            for vid in node.outputs:
                st.producer[vid] = stream

    def close(self) -> None:
        FRAMES.remove(self.key)
        for ptr in list(self.scratch):
            self.free_scratch(ptr)



def claim_and_compile(eps: list[PluginEp], view: GraphView, graph: Graph, fallbacks,
                      contexts=None) -> tuple[dict[int, PluginEp], list[CompiledPartition]]:
    """The partitioner's v6 step: claims, fused groups compiled per EP, per-node fallbacks.

    Returns (node -> EP for per-node kernels, compiled partitions). Nodes of a group that failed
    to compile keep the EP where it also claimed them singly; the rest go to the CPU EP.
    `contexts` (ABI v7, host/runtime/epcontext.py): partitions rebuilt from a saved context model
    come first; no EP claims their EPContext nodes."""
    saved = contexts.partitions(graph) if contexts is not None else []
    claims = collect_claims(eps, view, graph, fallbacks)
    if saved:
        claims.drop(i for p in saved for i in p.group.nodes)
    if not claims.groups:
        return claims.single, saved
    counts: dict[int, int] = {}
    groups = []
    for ep, nodes in claims.groups:
        k = counts[id(ep)] = counts.get(id(ep), -1) + 1
        groups.append(describe_group(graph, ep, nodes, f"{ep.name}_fused_{k}"))
    parts, failed = compile_groups(groups, graph, fallbacks)
    assigned = dict(claims.single)
    for g in failed:
        singles = claims.per_node_ok[id(g.ep)]
        for i in g.nodes:
            if i in singles:
                assigned[i] = g.ep
    return assigned, saved + parts


__all__ = ["Claims", "CompiledPartition", "FrameContext", "collect_claims", "compile_groups",
           "claim_and_compile", "describe_group", "unit_order"]
