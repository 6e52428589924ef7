"""Which nodes of a graph a compiled plan takes, and in which groups (CudaEp.claim_fused), and which
values are shape arithmetic the host keeps on the CPU (CudaEp.claim, claim_fused).

Pure Python (no CuPy). Connected runnable nodes form one group, visited in dependency order; a
node joins a producer's group only when no path leaves that group and comes back through this
node (the fused graph would otherwise have a cycle: group -> outside node -> group).
"""

from __future__ import annotations

from abi.host_inputs import host_read_inputs
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


_SHAPE_SOURCES = ("Shape", "Size")
_INT64 = 7


def shape_arithmetic_values(graph) -> set[int]:
    """Values that are shape arithmetic: Shape/Size outputs and int64 results computed only from
    them and constants. The host runs these on the CPU (the ALLOW_CPU_FOR_SHAPES policy), where
    the shape-reading inputs (Reshape's shape, Slice's bounds) of this EP's kernels must be."""
    shape: set[int] = set()
    changed = True
    while changed:  # nodes are usually in topological order: one pass, a second to confirm
        changed = False
        for node in graph.nodes:
            outputs = [v for v in node.outputs if v >= 0]
            if not outputs or all(v in shape for v in outputs):
                continue
            inputs = [v for v in node.inputs if v >= 0]
            if node.op_type in _SHAPE_SOURCES and node.domain in ("", "ai.onnx"):
                derived = True
            else:
                derived = (any(v in shape for v in inputs)
                           and all(v in shape or graph.values[v].constant is not None for v in inputs)
                           and all(graph.values[v].elem_type == _INT64 for v in outputs))
            if derived:
                shape.update(outputs)
                changed = True
    return shape


def host_shape_values(graph) -> set[int]:
    """The shape-arithmetic values (shape_arithmetic_values) this EP leaves to the host: those the
    host needs there, namely values it computes itself (flagged VALUE_HOST_COMPUTED, ABI v7), values
    read at an input an op reads on the host (abi/host_inputs.py), and, transitively, the inputs of
    nodes computing any of these; and graph outputs nothing reads. The rest are data that device
    kernels read (BERT's token-type ids expanded to [batch, seq], a mask's additive term): on the
    device they need no CPU node beside a captured graph and no copy per run. Without the flags (a
    host or negotiation below v7) the host's shape program cannot be told apart from the rest: every
    shape value stays on the host, as before."""
    shape = shape_arithmetic_values(graph)
    if not any(getattr(v, "host_computed", False) for v in graph.values):
        return shape
    needed = {i for i, v in enumerate(graph.values) if v.host_computed}
    for node in graph.nodes:
        needed.update(v for j, v in enumerate(node.inputs)
                      if v >= 0 and j in host_read_inputs(node.op_type, node.domain))
    changed = True
    while changed:  # reverse topological order converges in one pass; a second confirms
        changed = False
        for node in reversed(graph.nodes):
            if any(v in needed for v in node.outputs if v >= 0):
                new = {v for v in node.inputs if v >= 0} - needed
                if new:
                    needed |= new
                    changed = True
    read = {v for node in graph.nodes for v in node.inputs if v >= 0}
    return {v for v in shape if v in needed or v not in read}
