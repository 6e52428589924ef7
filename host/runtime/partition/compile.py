"""Compiling fused groups (ABI v6): Ep.Compile once per EP with all its groups, per-group retries.

Each accepted group is described (`describe_group`: its frame inputs and outputs, a GraphView of just
its nodes, the fused node's view) and compiled. Where an EP's Compile fails for a batch, each group
is compiled alone, so only the groups that fail fall back to per-node kernels, with a warning.
A `CompiledPartition` is the kernel of its plan node; the run step is host/runtime/steps/frame.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import abi
from abi.host_inputs import host_only_values
from host.errors import EpError, PluginLoadError
from host.plugins import hostapi
from host.plugins.ep import PluginEp
from host.plugins.hostapi import ffi
from host.plugins.loader import Slots, negotiate_or_release
from host.runtime import stages
from host.runtime.graphview import GraphView
from host.runtime.model import Graph, ValueMeta
from host.runtime.partition.claims import collect_claims
from host.runtime.warn import warn_caller

_NULL = ffi.NULL
FUSED_OP_TYPE = "FusedPartition"
FUSED_DOMAIN = "ai.ephost.fused"


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
    # Frame input positions the host fills with host arrays: shape-program values that the group's
    # nodes read only on the host (a Reshape's target), for a v7+ EP (abi/host_inputs.py).
    host_inputs: tuple[int, ...] = ()


def describe_group(graph: Graph, ep: PluginEp, nodes: tuple[int, ...], name: str,
                   host_computed: frozenset[str] = frozenset()) -> FusedGroup:
    """`host_computed`: names of the values the host's shape program computes (flagged in the
    group's view for a v7+ EP; those read only on the host reach Compute in host memory)."""
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
    if ep.slots.negotiated >= 7:
        _mark_host_inputs(graph, group, host_computed)
    return group


def _mark_host_inputs(graph: Graph, group: FusedGroup, host_computed: frozenset[str]) -> None:
    """Flag the group's inputs that the host computes, as the session's view does, and note those
    its nodes read only on the host: the frame hands them over as host arrays."""
    computed = [x for x in group.inputs if x in host_computed]
    if not computed:
        return
    group.view.mark_host_computed([group.view.value_index[x] for x in computed])
    triples = [(graph.nodes[i].op_type, graph.nodes[i].domain, graph.nodes[i].inputs) for i in group.nodes]
    host_only = host_only_values(triples, computed)
    group.host_inputs = tuple(j for j, x in enumerate(group.inputs) if x in host_only)


def host_computed_names(view: GraphView) -> frozenset[str]:
    """The values `view` flags VALUE_HOST_COMPUTED (the session's shape program), by name."""
    vals = view.ptr.values
    return frozenset(name for name, i in view.value_index.items() if vals[i].flags & abi.VALUE_HOST_COMPUTED)


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
        self._kept: list = []  # host memory the EP may point into until Release (a context's bytes)
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

    def keep_alive(self, obj) -> None:
        """Hold `obj` (bytes handed to the EP) until the compute info is released."""
        self._kept.append(obj)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        info = self.info
        if info.ReleaseState is not None and self.state != _NULL:
            info.ReleaseState(info.ptr, self.state)
        info.Release(info.ptr)
        self._kept.clear()  # a mapped context is unmapped once nothing points into it


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
        info = negotiate_or_release("EpNodeComputeInfo", info_ptr, ep.slots.negotiated,
                                    f"{ep.owner}: fused node '{group.name}'")
    except PluginLoadError as exc:  # a bad table means per-node kernels
        group.error = str(exc)
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
    host_computed = host_computed_names(view)
    for ep, nodes in claims.groups:
        k = counts[id(ep)] = counts.get(id(ep), -1) + 1
        groups.append(describe_group(graph, ep, nodes, f"{ep.name}_fused_{k}", host_computed))
    parts, failed = compile_groups(groups, graph, fallbacks)
    assigned = dict(claims.single)
    for g in failed:
        singles = claims.per_node_ok[id(g.ep)]
        for i in g.nodes:
            if i in singles:
                assigned[i] = g.ep
    return assigned, saved + parts


__all__ = ["CompiledPartition", "FusedGroup", "FUSED_DOMAIN", "FUSED_OP_TYPE", "claim_and_compile", "compile_groups",
           "describe_group"]
