"""Subgraphs of control-flow nodes, prepared once per session and walked by every iteration.

At session creation the partitioner (`partition.Partitioner.plan_graph`) meets a node with subgraphs and
calls the kernel's `prepare`, which asks `prepare_subgraph` for each subgraph: the body becomes a
Graph (its formal inputs, then the outer-scope values it reads), is partitioned like the main graph
(plugin EPs get GetCapability over its nodes, fused groups are compiled), and gets its own Plan and
Executor. Nested control flow recurses. A run of the node only calls `SubgraphRunner.run`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx

from abi.dtypes import to_numpy
from host.runtime.executor import Executor
from host.runtime.graphview import GraphView
from host.runtime.model import Graph, build_subgraph
from host.runtime.plan import Plan


class SubgraphRunner:
    """One prepared subgraph: feeds formal and outer values into its executor, returns its outputs."""

    def __init__(self, graph: Graph, plan: Plan, executor: Executor, n_formal: int, outer_names: Sequence[str]):
        self.graph = graph
        self.plan = plan
        self.executor = executor
        self.input_names = [v.name for v in graph.inputs[:n_formal]]
        self.output_names = [v.name for v in graph.outputs]
        self._formal_ids = [plan.input_ids[n] for n in self.input_names]
        where = {name: k for k, name in enumerate(outer_names)}
        # (value id in the subgraph, position among the node's outer values), once.
        self._outer = [(plan.input_ids[v.name], where[v.name]) for v in graph.inputs[n_formal:]]
        self._output_ids = [plan.output_ids[n] for n in self.output_names]
        self.to_host = executor.to_host

    def run(self, formal: Sequence, outer: Sequence) -> list:
        """The subgraph's outputs for these formal inputs and outer values (node order)."""
        if len(formal) != len(self._formal_ids):
            raise ValueError(f"subgraph '{self.graph.model.graph.name}' takes {len(self._formal_ids)} input(s) "
                             f"{self.input_names}; got {len(formal)}")
        feeds = dict(zip(self._formal_ids, formal))
        for vid, k in self._outer:
            feeds[vid] = outer[k]
        return self.executor.run_subgraph(feeds, self._output_ids)

    def output_type(self, index: int) -> tuple[np.dtype, tuple | None]:
        """dtype and static shape of output `index` (for a scan output of zero iterations)."""
        meta = self.graph.outputs[index]
        try:
            dtype = to_numpy(meta.elem_type)
        except TypeError:
            dtype = np.dtype(np.float32)
        static = meta.shape is not None and all(isinstance(d, int) and d >= 0 for d in meta.shape)
        return dtype, tuple(meta.shape) if static else None

    def close(self) -> None:
        self.executor.close()


def prepare_subgraph(body: onnx.GraphProto, outer: Graph, outer_names: Sequence[str],
                     plan_graph: Callable[[Graph, GraphView], Plan], transfer_eps=None) -> SubgraphRunner:
    """Build, partition and plan `body` once; `plan_graph` is the session's planner. `transfer_eps`: the
    session's EPs, whose data transfers the body's executor copies with (a device value may reach a body
    none of whose nodes is on that device)."""
    graph = build_subgraph(body, outer.opsets, outer.values, outer.initializers)
    view = GraphView(graph)
    plan = plan_graph(graph, view)
    executor = Executor(plan, concurrent=all(ep.concurrent_runs for ep in plan.eps), transfer_eps=transfer_eps,
                        subgraph=True)
    formal = {vi.name for vi in body.input}
    runner = SubgraphRunner(graph, plan, executor, sum(v.name in formal for v in graph.inputs), outer_names)
    runner.view = view  # plugins' kernels were created over it: alive as long as the session
    return runner


__all__ = ["SubgraphRunner", "prepare_subgraph"]
