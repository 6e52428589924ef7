"""The partitioner: from an optimized graph and the session's EPs to a frozen Plan.

    Partitioner(eps, fallbacks, source_opsets).partition(graph) -> (graph, Plan)

1. Fallback expansion: fused nodes (the optimizer's) that no plugin EP claims and the CPU EP cannot
   run go back to their unfused subgraphs (host.optimizer.expand_unclaimed).
2. Claims in provider order (`claims.collect_claims`): each EP's GetCapability; v6 EPs may propose
   fused groups, accepted when convex and not overlapping earlier claims.
3. Compile (`compile.claim_and_compile`): each EP's groups in one Ep.Compile; a group that fails falls
   back to that EP's per-node kernels where it also claimed them singly, else to the CPU EP.
4. Kernels: CreateKernel for every node a plugin EP claimed singly, a CPU EP kernel for the rest
   (a typed error names the nodes no EP supports); control-flow bodies are partitioned the same way.
5. The plan: nodes in a topological order with fused groups contracted, values numbered, last uses
   computed. Copies at EP boundaries are not nodes: the executor makes them (executor.input_for).

The partitioner owns what it created (plugin kernels, compiled partitions, graph views) until
`release()`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from host import cpu_ep
from host.cpu_ep.half_carry import carry_float32
from host.cpu_ep.ops_control import ControlFlowKernel
from host.errors import ModelError
from host.plugins import hostapi
from host.plugins.ep import PluginEp
from host.plugins.hostapi import ffi
from host.plugins.loader import negotiate_or_release
from host.runtime import shape_program, stages
from host.runtime.graphview import GraphView
from host.runtime.model import Graph, ValueMeta, build_graph
from host.runtime.partition.claims import collect_claims, unit_order
from host.runtime.partition.compile import FUSED_OP_TYPE, CompiledPartition, claim_and_compile
from host.runtime.plan import Kind, Plan, PlanNode, compute_frees
from host.runtime.subgraph import SubgraphRunner, prepare_subgraph


class Partitioner:
    """Partitions graphs of one session among its plugin EPs (priority order) and the CPU EP."""

    def __init__(self, eps: list[PluginEp], fallbacks: Counter, source_opsets: dict[str, int] | None = None,
                 shape_signatures: int = shape_program.DEFAULT_CAPACITY, contexts=None):
        self.eps = eps
        self.contexts = contexts  # ABI v7: a saved context model's partitions (host/runtime/epcontext.py)
        self.graph: Graph | None = None  # the session's graph, once partitioned
        self.view: GraphView | None = None
        self.shape_signatures = shape_signatures
        self.shape_program: shape_program.ShapeProgram | None = None
        self.fallbacks = fallbacks
        self.source_opsets = source_opsets or {}
        self.kernels: list = []                        # plugin kernels' Slots, released in reverse
        self.partitions: list[CompiledPartition] = []  # compiled partitions (ABI v6)
        self.views: list[GraphView] = []               # kernels were created over them: kept alive

    def partition(self, graph: Graph) -> tuple[Graph, Plan]:
        """The session's graph after fallback expansion, and its plan."""
        view = GraphView(graph)
        if self.contexts is not None:  # ABI v7: rebuild saved partitions, or put their nodes back
            graph, view = self.contexts.resolve(self.eps, graph, view, self.fallbacks, self.partitions)
        self.views.append(view)
        expanded = self._expand_unclaimed(graph)
        if expanded is not graph:
            graph, view = expanded, GraphView(expanded)
            self.views.append(view)
        self.graph, self.view = graph, view
        # Shape arithmetic leaves the plan: the host evaluates it once per input-shape signature.
        self.shape_program = shape_program.build(graph, view.value_index, self.shape_signatures)
        graph.shape_nodes = self.shape_program.nodes
        if not self.eps or max(ep.slots.negotiated for ep in self.eps) >= 7:  # reserved before v7
            view.mark_host_computed(self.shape_program.exported)
        plan = self.plan_graph(graph, view)
        plan.host_computed = frozenset(self.shape_program.exported)
        return graph, plan

    # -- steps ----------------------------------------------------------------------------------
    def _expand_unclaimed(self, graph: Graph) -> Graph:
        """Fused nodes that no plugin EP claims and the CPU EP cannot run go back to their unfused
        subgraphs; repeated, as an expansion may hold fused ops."""
        from host.runtime.epcontext import is_context_node

        for _ in range(3):
            # Nodes the CPU EP cannot run, but for a saved context's (its partition is rebuilt already);
            # only then is the optimizer imported (onnx-ir and onnxscript: 0.4 s of a context session).
            unrunnable = [i for i, n in enumerate(graph.nodes)
                          if cpu_ep.lookup(n.domain, n.op_type, n.opset) is None and not is_context_node(n)]
            if not unrunnable:
                break
            from host import optimizer

            candidates = {i for i in unrunnable if optimizer.can_expand(graph.nodes[i].domain, graph.nodes[i].op_type)}
            if not candidates:
                break
            claims = collect_claims(self.eps, GraphView(graph), graph, Counter())
            claimed = set(claims.single) | {i for _, group in claims.groups for i in group}
            names = [graph.nodes[i].name for i in sorted(candidates - claimed)]
            if not names:
                break
            model = self.contexts.with_weights(graph.model) if self.contexts is not None else graph.model
            graph = build_graph(optimizer.expand_unclaimed(model, names))
        return graph

    def plan_graph(self, g: Graph, view: GraphView, eps: list[PluginEp] | None = None) -> Plan:
        """Partition one graph (the model's, or a control-flow subgraph's) and plan it among `eps`
        (default: the session's)."""
        assigned, parts = claim_and_compile(self.eps if eps is None else eps, view, g, self.fallbacks,
                                            self.contexts if g is self.graph else None)
        self.partitions.extend(p for p in parts if p not in self.partitions)  # saved ones are in already
        stages.enter(stages.CREATING_KERNELS)
        nodes, units, subgraphs = self._plan_nodes(g, view, assigned, parts)
        if parts:
            nodes = [nodes[u] for u in unit_order(g, units)]
        ids = view.value_index
        names = view.value_names
        objects = self._object_ids(g, ids)
        elem_types = [(g.values.get(nm) or ValueMeta(nm)).elem_type for nm in names]
        # EPs that run nodes here or in a subgraph: they get OnRunStart/OnRunEnd for every run.
        used = {id(pn.ep) for pn in nodes} | {id(ep) for sub in subgraphs for ep in sub.plan.eps}
        plan = Plan(nodes, dict(ids), names, elem_types,
                    {v.name: ids[v.name] for v in g.inputs}, {v.name: ids[v.name] for v in g.outputs},
                    {ids[k]: np.asarray(v, order="C") for k, v in g.initializers.items()},
                    [ep for ep in self.eps if id(ep) in used], objects, subgraphs)
        compute_frees(nodes, set(plan.output_ids.values()) | set(plan.constants))
        carry_float32(nodes, set(plan.output_ids.values()))  # half values kept float32 between CPU nodes
        return plan

    @staticmethod
    def _object_ids(g: Graph, ids: dict[str, int]) -> frozenset[int]:
        return frozenset(ids[name] for name, meta in g.values.items() if meta.type is not None and name in ids)

    def _plan_nodes(self, g: Graph, view: GraphView, assigned: dict[int, PluginEp], parts: list[CompiledPartition]):
        """Plan nodes in graph order (a fused group at its first member), their units (node index
        tuples, for ordering) and the prepared subgraphs of control-flow nodes."""
        ids = view.value_index
        objects = self._object_ids(g, ids)
        fused_first = {p.group.nodes[0]: p for p in parts}
        fused = {i for p in parts for i in p.group.nodes}
        nodes, unsupported, units, subgraphs = [], [], [], []
        for i, n in enumerate(g.nodes):
            if i in g.shape_nodes:  # evaluated by the session's shape program
                continue
            if i in fused:
                part = fused_first.get(i)
                if part is not None:
                    nodes.append(self._fused_node(part, ids))
                    units.append(part.group.nodes)
                continue
            ins = tuple(ids[x] if x else -1 for x in n.inputs)
            outs = tuple(ids[x] if x else -1 for x in n.outputs)
            ep = assigned.get(i)
            if ep is not None:
                nodes.append(PlanNode(i, n.name, n.op_type, ins, outs, ep, self._plugin_kernel(ep, view, i, n),
                                      Kind.PLUGIN, domain=n.domain))
            elif cpu_ep.lookup(n.domain, n.op_type, n.opset) is None:
                unsupported.append(f"'{n.name}' ({n.domain or 'ai.onnx'}::{n.op_type}, opset {self._own_opset(n)})")
                continue
            else:
                kernel = cpu_ep.create_kernel(n, g.values)  # declared types: half precision (cpu_ep/half.py)
                kernel.object_outputs = frozenset(j for j, o in enumerate(outs) if o in objects)
                if isinstance(kernel, ControlFlowKernel):
                    subgraphs += self._prepare_subgraphs(kernel, g, n)
                nodes.append(PlanNode(i, n.name, n.op_type, ins, outs, None, kernel, Kind.CPU))
            units.append((i,))
        if unsupported:
            raise ModelError(f"no execution provider supports {len(unsupported)} node(s): " + ", ".join(unsupported))
        return nodes, units, subgraphs

    @staticmethod
    def _fused_node(part: CompiledPartition, ids: dict[str, int]) -> PlanNode:
        group = part.group
        return PlanNode(group.nodes[0], part.name, FUSED_OP_TYPE, tuple(ids[x] for x in group.inputs),
                        tuple(ids[x] for x in group.outputs), group.ep, part, Kind.COMPILED,
                        members=part.node_names)

    def _own_opset(self, node) -> int:
        """The opset the user's model declares for the node's domain (the optimizer may have
        converted the graph to a newer one; messages name the model's own)."""
        return self.source_opsets.get(node.domain if node.domain != "ai.onnx" else "", node.opset)

    def _prepare_subgraphs(self, kernel: ControlFlowKernel, g: Graph, node) -> list[SubgraphRunner]:
        """Each subgraph of a control-flow node, partitioned and planned once (host/runtime/subgraph.py)."""
        outer_names = node.inputs[len(node.inputs) - node.implicit:]
        made = []

        # Bodies are offered to every EP of the session, device EPs included: values crossing the body's
        # boundary stay where they are (ControlFlowStep), CPU segments of the body copy device values
        # in (CpuSegment._enter), plugin steps move host values to their device (docs/control_flow.md).
        eps = self.eps

        def planner(attr: str) -> SubgraphRunner:
            runner = prepare_subgraph(node.attrs[attr], g, outer_names,
                                      lambda sub, view: self.plan_graph(sub, view, eps), transfer_eps=eps)
            made.append(runner)
            return runner

        kernel.prepare(planner)
        return made

    def _plugin_kernel(self, ep: PluginEp, view: GraphView, index: int, node):
        out = ffi.new("EpKernel**")
        hostapi.check(ep.slots.CreateKernel(ep.ptr, view.ptr, index, out),
                      f"{ep.owner}: CreateKernel for node '{node.name}' ({node.op_type})")
        slots = negotiate_or_release("EpKernel", out[0], ep.slots.negotiated, ep.owner)
        self.kernels.append(slots)
        return slots

    def release_steps(self) -> list:
        """Callables releasing what this partitioner made: kernels, then partitions, newest first."""
        kernels, self.kernels = self.kernels, []
        partitions, self.partitions = self.partitions, []
        self.views = []
        return ([lambda k=k: k.Release(k.ptr) for k in reversed(kernels)]
                + [p.release for p in reversed(partitions)])


__all__ = ["Partitioner"]
