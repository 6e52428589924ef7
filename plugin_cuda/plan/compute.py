"""The ABI v6 compute function of one fused partition: a Plan run on the call frame's stream.

`compute(state, frame)` reads the frame's pointers (the SDK's fast accessors), lets the EP's
graph manager start a host-orchestrated capture at the first launch of a run (as for per-node
kernels), and walks the plan. Nothing else happens per call.
"""

from __future__ import annotations

import abi
from abi import fused_blob
from abi.sdk import PluginError
from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.plan import Plan


class PlanFunction:
    """ComputeFunction for sdk.EpBase.compile: one compiled plan per fused node."""

    def __init__(self, ep, fused):
        self.ep = ep
        self.name = fused.name
        # Saved as this partition's context (ABI v7; NVRTC output is in the disk cache), only when the
        # session writes a context model: the subgraph holds the weights in host memory.
        self.fused = fused if getattr(ep, "saves_contexts", False) else None
        opts = ep.opts
        # The host's own graph capture (enable_cuda_graph) records the plan's launches; a plan
        # capturing itself as well would nest captures, so auto-graph is off then.
        auto = bool(getattr(opts, "plan_auto_graph", False)) and not opts.enable_cuda_graph
        try:
            # One variant for every run of the session (capture or not), so one input gives one
            # result whatever the run, thread or stream.
            self.plan = Plan.build(fused.graph, ep, auto_graph=auto,
                                   warmup=max(1, opts.min_num_runs_before_cuda_graph_capture),
                                   capture=bool(auto or opts.enable_cuda_graph))
        except PlanError as exc:
            raise PluginError(f"fused node '{fused.name}': {exc}", abi.EP_INVALID_GRAPH) from None
        self._shapes = self.plan.output_shapes

    def create_state(self):
        return None

    def context(self) -> bytes | None:
        """ABI v7: the fused subgraph as bytes; CudaEp.compile_from_context plans it again (no host
        optimization or partitioning; kernels come from the NVRTC disk cache)."""
        return None if self.fused is None else fused_blob.to_bytes(self.fused)

    def compute(self, state, frame) -> None:
        ep = self.ep
        stream = frame.stream
        st = ep.streams.get(stream)
        outs = frame.output_ptrs()
        if 0 in outs:  # outputs the host did not preallocate: static shapes, one callback each
            outs = [p or frame.allocate_output(i, self._shapes[i]) for i, p in enumerate(outs)]
        ins = frame.input_ptrs()
        if st is None:
            self.plan.run(stream, ins, outs, frame.capturing)
            return
        graphs = ep.graphs
        if ep.run_streams.__dict__.get("state") is not st:
            ep.enter_run(st)
        try:
            graphs.before_kernel(st)  # begins the host-orchestrated capture at the run's first launch
            capturing = frame.capturing or graphs.capturing()
            self.plan.run(stream, ins, outs, capturing)
        except Exception as exc:
            if not graphs.capturing():
                raise
            graphs.abort_capture(exc)  # ends capture and re-runs what was recorded, eagerly
            self.plan.run(stream, ins, outs, True)
            return
        graphs.record(self, (stream, ins, outs), st)

    def launch_recorded(self, call, state) -> None:
        """Re-run a recorded call eagerly (GraphManager.abort_capture)."""
        stream, ins, outs = call
        self.plan.run(stream, ins, outs, True)

    def release_state(self, state) -> None:
        return None

    def close(self) -> None:
        self.plan.close()
