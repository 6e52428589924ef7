"""Which nodes of a graph a compiled plan takes, and in which groups (CudaEp.claim_fused).

Pure Python (no CuPy). Connected runnable nodes form one group, visited in dependency order; a
node joins a producer's group only when no path leaves that group and comes back through this
node (the fused graph would otherwise have a cycle: group -> outside node -> group).
"""

from __future__ import annotations

from plugin_cuda.plan.lower import PROBE_DIM, topo_order, unsupported_reason


def fusable_groups(graph, accept=None, min_size: int = 1, dynamic: bool = False) -> list:
    """Node-index groups for claim_fused. `accept(node) -> bool` adds a further filter (the EP's own).
    `dynamic`: nodes whose inputs have symbolic dims are taken too (checked at a probe size)."""
    producer = {v: n.index for n in graph.nodes for v in n.outputs if v >= 0}
    group_of: dict = {}  # node index -> group id
    exits: dict = {}  # node index -> group ids this node depends on through a node outside them
    members: dict = {}  # group id -> node indices
    next_id = 0
    for node in topo_order(graph):
        ok = not unsupported_reason(graph, node, probe=PROBE_DIM if dynamic else None) and (accept is None or accept(node))
        parents = [producer[v] for v in node.inputs if v >= 0 and v in producer]
        blocked = set()
        for p in parents:
            blocked |= exits.get(p, set())
        gid = None
        if ok:
            for p in parents:
                g = group_of.get(p)
                if g is not None and g not in blocked:
                    gid = g
                    break
            if gid is None:
                gid = next_id
                next_id += 1
                members[gid] = []
            members[gid].append(node.index)
            group_of[node.index] = gid
        mine = set()
        for p in parents:
            mine |= exits.get(p, set())
            g = group_of.get(p)
            if g is not None and g != gid:
                mine.add(g)
        exits[node.index] = mine
    return [sorted(m) for m in members.values() if len(m) >= min_size]
