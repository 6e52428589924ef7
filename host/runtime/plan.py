"""The plan a partitioner makes for one graph: nodes in run order, each on one EP, and the values.

A plan is made once per session (and once per control-flow body) by host/runtime/partition and is
not changed afterwards; the executor (host/runtime/executor.py) turns its nodes into run steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from host.plugins.ep import PluginEp


class Kind(Enum):
    """What runs a plan node (and so what its `kernel` is)."""

    CPU = "cpu"             # a CPU EP OpKernel (host/cpu_ep)
    PLUGIN = "plugin"       # a plugin kernel: the Slots of its EpKernel table
    COMPILED = "compiled"   # a compiled partition (ABI v6): partition.compile.CompiledPartition


@dataclass
class PlanNode:
    index: int                    # the node's index in the graph (a fused node: its first member's)
    name: str
    op_type: str
    inputs: tuple[int, ...]       # value ids, -1 for absent optional inputs
    outputs: tuple[int, ...]
    ep: PluginEp | None           # None: the CPU EP
    kernel: object                # see Kind
    kind: Kind = Kind.CPU
    frees: tuple[int, ...] = ()   # values whose last consumer is this node
    members: tuple[str, ...] = ()  # a compiled partition: the names of the nodes it fused
    domain: str = ""              # the op's domain ("" for ONNX)

    @property
    def provider(self) -> str:
        return self.ep.name if self.ep is not None else "CPUExecutionProvider"


@dataclass
class Plan:
    nodes: list[PlanNode]
    value_ids: dict[str, int]
    value_names: list[str]
    elem_types: list[int]
    input_ids: dict[str, int]
    output_ids: dict[str, int]
    constants: dict[int, np.ndarray]
    eps: list[PluginEp] = field(default_factory=list)
    # Values whose declared type is not a tensor (lists, None, dicts: host/runtime/types.py).
    object_ids: frozenset[int] = frozenset()
    # The prepared subgraphs of control-flow nodes (host/runtime/subgraph.py), closed with the plan.
    subgraphs: list = field(default_factory=list)
    # Values the host's shape program computes per input-shape signature (host memory): plugin
    # kernels of v7+ EPs get them there (EpValueInfo.flags VALUE_HOST_COMPUTED), not copied.
    host_computed: frozenset[int] = frozenset()

    def node_assignment(self) -> dict[str, str]:
        """Which EP runs each node, by node name (a fused node's members each)."""
        return {name: n.provider for n in self.nodes for name in (n.members or (n.name,))}


def compute_frees(nodes: list[PlanNode], keep: set[int]) -> None:
    """Set each node's `frees`: the values (not in `keep`) it is the last to read or write."""
    last: dict[int, int] = {}
    for pos, n in enumerate(nodes):
        for v in (*n.inputs, *n.outputs):
            if v >= 0:
                last[v] = pos
    by_pos: dict[int, list[int]] = {}
    for v, pos in last.items():
        if v not in keep:
            by_pos.setdefault(pos, []).append(v)
    for pos, n in enumerate(nodes):
        n.frees = tuple(by_pos.get(pos, ()))


__all__ = ["Kind", "Plan", "PlanNode", "compute_frees"]
