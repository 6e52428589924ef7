"""Claims: which EP takes which node, and which fused groups (ABI v6) are accepted.

`collect_claims` runs every EP's GetCapability in priority order with a fuse collector open on the
graph view, and accepts a group when none of its nodes is taken yet and fusing it creates no cycle
(`is_convex`). A node goes to the first EP that claims it, fused or single. `unit_order` orders the
plan once groups are contracted to one node each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from abi.dtypes import STRING
from host.errors import EpError
from host.plugins import hostapi
from host.plugins.ep import PluginEp
from host.plugins.hostapi import ffi
from host.runtime.graphview import GraphView
from host.runtime.model import Graph, host_only_nodes
from host.runtime.warn import warn_caller


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


__all__ = ["Claims", "can_compile", "collect_claims", "is_convex", "string_nodes", "unit_order"]
