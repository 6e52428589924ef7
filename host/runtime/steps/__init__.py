"""Run steps: every plan node becomes, once per plan, one step of this small protocol.

    step.context(run_state, stream) -> the step's per-thread context (or None)
    step(run_state, context)        -> runs it: reads and writes run_state.values

Four implementations: `CpuSegment` (consecutive CPU EP nodes, one tight loop with the CPU EP's
chains and bound constants), `ControlFlowStep` (If/Loop/Scan over subgraph plans), `PluginStep`
(one plugin kernel's Compute) and `CompiledStep` (one compiled partition's Compute on a call
frame). The executor (host/runtime/executor.py) walks the list; a profiler's observer wraps each
step's call once, when the steps are built.
"""

from __future__ import annotations

from host.runtime.plan import Kind, Plan, PlanNode
from host.runtime.steps.cpu import ControlFlowStep, CpuSegment, through_identities
from host.runtime.steps.frame import CompiledStep
from host.runtime.steps.plugin import PluginStep


def _in_segment(node: PlanNode) -> bool:
    return node.kind is Kind.CPU and not node.kernel.takes_device_values


def _runs(nodes: list[PlanNode]) -> list[list[PlanNode]]:
    """The plan cut into maximal runs of segment nodes and single other nodes, in order."""
    runs: list[list[PlanNode]] = []
    for node in nodes:
        if _in_segment(node) and runs and _in_segment(runs[-1][0]):
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def _read_outside(runs: list[list[PlanNode]]) -> list[set[int]]:
    """Per run: the values that nodes of *other* runs read (a segment must not join them away)."""
    reads = [{v for n in run for v in n.inputs if v >= 0} for run in runs]
    total: dict[int, int] = {}
    for r in reads:
        for v in r:
            total[v] = total.get(v, 0) + 1
    return [{v for v, count in total.items() if count > (v in r)} for r in reads]


def build_steps(plan: Plan, observer=None) -> tuple[list[tuple[object, tuple[int, ...]]], list[tuple]]:
    """(step, values to free after it) for the plan's nodes in order, and the prelude: (value id,
    array) pairs a run starts from besides the initializers (Identity outputs over initializers)."""
    outputs = set(plan.output_ids.values())
    constants = through_identities(plan.nodes, plan.constants)
    runs = _runs(plan.nodes)
    steps, prelude = [], []
    for run, outside in zip(runs, _read_outside(runs)):
        node = run[0]
        if _in_segment(node):
            segment = CpuSegment(run, outputs | outside, constants, plan, observer)
            prelude += segment.prelude
            steps.append((segment, ()))  # a segment frees per node itself
        elif node.kind is Kind.CPU:
            steps.append((ControlFlowStep(node, observer), node.frees))
        elif node.kind is Kind.PLUGIN:
            steps.append((PluginStep(node, observer, plan.host_computed), node.frees))
        else:
            steps.append((CompiledStep(node, observer), node.frees))
    return steps, prelude


__all__ = ["CompiledStep", "ControlFlowStep", "CpuSegment", "PluginStep", "build_steps"]
