"""The ABI v6 compute function of one fused partition: a Plan run on the call frame's stream.

`compute(state, frame)` reads the frame's pointers (the SDK's fast accessors), lets the EP's
graph manager start a host-orchestrated capture at the first launch of a run (as for per-node
kernels), and walks the plan. Nothing else happens per call.
"""

from __future__ import annotations

import abi
from abi import fused_blob
from abi.sdk import PluginError
from plugin_cuda import cupy_cache
from plugin_cuda.device import algo_cache, nvrtc
from plugin_cuda.plan import gc_pause, prechoose, saved, warmup
from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.plan import Plan
from plugin_cuda.plan.signatures import ConstantStore, PlanCache, host_value_inputs, is_dynamic, specialize


def build_options(opts) -> dict:
    """Plan.build's run options for an EP's options."""
    # The host's own graph capture (enable_cuda_graph) records the plan's launches; a plan
    # capturing itself as well would nest captures, so auto-graph is off then.
    auto = bool(getattr(opts, "plan_auto_graph", False)) and not opts.enable_cuda_graph
    # One variant for every run of the session (capture or not), so one input gives one result
    # whatever the run, thread or stream.
    return {"auto_graph": auto, "warmup": max(1, opts.min_num_runs_before_cuda_graph_capture),
            "capture": bool(auto or opts.enable_cuda_graph)}


class PlanFunction:
    """ComputeFunction for sdk.EpBase.compile: one compiled plan per fused node."""

    def __init__(self, ep, fused):
        self.ep = ep
        self.name = fused.name
        # Saved in this partition's context (ABI v7, with the plan's NVRTC output and algorithm choices),
        # kept only when the session writes a context model: the subgraph holds the weights in host memory.
        self.fused = fused if getattr(ep, "saves_contexts", False) else None
        self._algo_mark = algo_cache.mark()  # the choices made from here on are this partition's
        try:
            self.plan = Plan.build(fused.graph, ep, **build_options(ep.opts))
        except PlanError as exc:
            raise PluginError(f"fused node '{fused.name}': {exc}", abi.EP_INVALID_GRAPH) from None
        self._shapes = self.plan.output_shapes
        resolve_functions(self.plan)
        prechoose.make_choices(self.plan)  # in this partition's context, and out of run 1
        warmup.warm_up(ep, self.plan)  # run 1's lazy work, at creation (issue 29)

    def create_state(self):
        return None

    def context(self) -> bytes | None:
        """ABI v7: the fused subgraph with the plan's NVRTC output and algorithm choices
        (plan/saved.py); CudaEp.compile_from_context plans it again without compiling or searching."""
        if self.fused is None:
            return None
        ep = self.ep
        return saved.pack(saved.SavedPlan.of(self.fused, cc=ep.factory.compute_capability(ep.device_id),
                                             modules=saved_modules(self._plans()),
                                             algos=algo_cache.taken(self._algo_mark),
                                             warm=list(getattr(ep, "warm_recipes", {}).values()),
                                             cupy=dict(getattr(ep, "warm_payloads", {}))))

    def _plans(self) -> list:
        return [self.plan]

    def compute(self, state, frame) -> None:
        outs = frame.output_ptrs()
        if 0 in outs:  # outputs the host did not preallocate: static shapes, one callback each
            outs = [p or frame.allocate_output(i, self._shapes[i]) for i, p in enumerate(outs)]
        self._run(self.plan, frame, frame.input_ptrs(), outs)

    def _run(self, plan, frame, ins, outs) -> None:
        ep = self.ep
        stream = frame.stream
        st = ep.streams.get(stream)
        if st is None:
            plan.run(stream, ins, outs, frame.capturing)
            return
        graphs = ep.graphs
        if ep.run_streams.__dict__.get("state") is not st:
            ep.enter_run(st)
        try:
            graphs.before_kernel(st)  # begins the host-orchestrated capture at the run's first launch
            capturing = frame.capturing or graphs.capturing()
            plan.run(stream, ins, outs, capturing)
        except Exception as exc:
            if not graphs.capturing():
                raise
            graphs.abort_capture(exc)  # ends capture and re-runs what was recorded, eagerly
            plan.run(stream, ins, outs, True)
            return
        graphs.record(self, (plan, stream, ins, outs), st)

    def launch_recorded(self, call, state) -> None:
        """Re-run a recorded call eagerly (GraphManager.abort_capture)."""
        plan, stream, ins, outs = call
        plan.run(stream, ins, outs, True)

    def forget_stream(self, stream: int) -> None:
        """Drop what the plan keeps for a stream the EP is about to destroy (Plan.forget_stream)."""
        self.plan.forget_stream(stream)

    def describe(self) -> dict:
        return self.plan.describe()

    def release_state(self, state) -> None:
        return None

    def close(self) -> None:
        self.plan.close()


class ShapePlanFunction(PlanFunction):
    """ComputeFunction of a fused node whose inputs have symbolic dims: a plan per input-shape
    signature (plugin_cuda/plan/signatures.py), built at the first call with that signature."""

    def __init__(self, ep, fused):
        self.ep = ep
        self.name = fused.name
        self.fused = fused if getattr(ep, "saves_contexts", False) else None
        self._algo_mark = algo_cache.mark()
        graph = fused.graph
        self._graph = graph
        self._input_ids = list(graph.input_ids) or [graph.values.index(v) for v in graph.inputs]
        # Inputs handed over in host memory (host-computed shapes): their values join the signature.
        self._host = host_value_inputs(graph, self._input_ids)
        self._device = [j for j in range(len(self._input_ids)) if j not in self._host]
        self._options = build_options(ep.opts)
        self.constants = ConstantStore(self._upload)
        self.cache = PlanCache(self._build, ep.opts.plan_shape_cache, ep.opts.plan_shape_cache_mb << 20)
        self.num_nodes = len(graph.nodes)
        self.stats = {"symbolic": 0, "literal": 0}
        self.last_symbolic_error = None

    def _build(self, signature):
        shapes = [s for j, s in enumerate(signature) if j not in self._host]
        if not all(shape is not None and all(d is not None and d >= 0 for d in shape) for shape in shapes):
            raise PluginError(f"fused node '{self.name}': input shapes {list(signature)} are not all known",
                              abi.EP_INVALID_ARGUMENT)
        try:
            with gc_pause.paused():
                return self._build_symbolic(signature)
        except PlanError as exc:
            raise PluginError(f"fused node '{self.name}' at input shapes {list(signature)}: {exc}",
                              abi.EP_FAIL) from None

    def _build_symbolic(self, signature):
        """The plan with symbolic sizes as kernel arguments (one module for every signature that
        plans the same way); where such a module does not compile (a size the source needs as a
        literal), the plan of this signature with every size a literal."""
        graph = specialize(self._graph, self._input_ids, signature, host=self._host)
        try:
            plan = Plan.build(graph, self.ep, constants=self.constants, **self._options)
            self.stats["symbolic"] += 1
            return plan
        except (nvrtc.CompileError, PlanError) as exc:
            # Planned again with literal sizes: a module that then compiles, or the error of this
            # signature in plain numbers (a symbolic size prints as its expression in f-strings).
            self.stats["literal"] += 1
            self.last_symbolic_error = str(exc)[:2000]
        graph = specialize(self._graph, self._input_ids, signature, symbolic=False, host=self._host)
        return Plan.build(graph, self.ep, constants=self.constants, **self._options)

    def _upload(self, host):
        ep = self.ep
        cp = ep.cupy
        with cp.cuda.Device(ep.device_id):
            block = ep.memory.malloc(max(host.nbytes, 1))
            block.copy_from_host(host.ctypes.data, host.nbytes)
            cp.cuda.runtime.deviceSynchronize()  # the upload is done before any stream reads it
        return block

    def signature(self, frame) -> tuple:
        """The input shapes of this call; for the inputs in host memory, their values."""
        if not self._host:
            return tuple(t.shape for t in frame.inputs)
        inputs = frame.inputs
        return tuple(frame.input_ints(j) if j in self._host else inputs[j].shape for j in range(len(inputs)))

    def compute(self, state, frame) -> None:
        signature = self.signature(frame)
        plan = self.cache.acquire(signature)
        try:
            outs = frame.output_ptrs()
            if 0 in outs:
                shapes = plan.output_shapes
                outs = [p or frame.allocate_output(i, shapes[i]) for i, p in enumerate(outs)]
            ins = frame.input_ptrs()
            if self._host:
                ins = [ins[j] for j in self._device]  # the plan's inputs: the host values are its constants
            self._run(plan, frame, ins, outs)
        finally:
            self.cache.release(signature, plan)

    def _plans(self) -> list:
        return self.cache.plans()  # the signatures planned so far: their modules go in the context

    def context(self) -> bytes | None:
        # A saved context keeps no value flags, and the host hands an EPContext node's inputs over on
        # the device: a partition with host inputs saves none and is compiled again at load.
        return None if self._host else super().context()

    def forget_stream(self, stream: int) -> None:
        for plan in self.cache.plans():
            plan.forget_stream(stream)

    def describe(self) -> dict:
        c = self.cache
        return {"nodes": self.num_nodes, "dynamic": True, "signatures": len(c), "builds": c.stats["builds"],
                "symbolic_builds": self.stats["symbolic"], "literal_builds": self.stats["literal"],
                "evictions": c.stats["evictions"], "arena_bytes": c.bytes, "const_bytes": self.constants.nbytes}

    def close(self) -> None:
        self.cache.close()
        self.constants.close()


def resolve_functions(plan) -> None:
    """Look up every kernel of the plan's module now: with CUDA's lazy module loading a function is
    loaded at its lookup, which would otherwise happen in the first run."""
    for variant in {id(v): v for v in (plan.eager, plan.graph)}.values():
        for spec in variant.specs:
            if spec is not None:
                plan.module.function(spec.name)


def saved_modules(plans) -> list:
    """The NVRTC output of `plans`' modules (one per source), for a context."""
    out = {}
    for plan in plans:
        m = plan.module
        if m.binary is not None:  # None: CuPy compiled it (no bytes to keep); the loader compiles it again
            out[m.digest] = saved.SavedModule(m.arch, m.digest, m.binary)
    return list(out.values())


def subgraph_from_context(ep, name: str, blob: bytes):
    """The subgraph of a saved context (plan/saved.py), its modules and algorithm choices installed
    for the plan built next (no NVRTC compile, no search). A context that does not read, or was made
    on another compute capability, is refused (PluginError): the host compiles the kept subgraph."""
    try:
        plan = saved.unpack(blob)
        graph = plan.fused_graph().graph
    except fused_blob.BlobError as exc:
        raise PluginError(f"context of fused node '{name}': {exc}", abi.EP_INVALID_GRAPH) from None
    here = ep.factory.compute_capability(ep.device_id)
    if plan.cc and plan.cc != here:
        raise PluginError(f"context of fused node '{name}' was compiled for compute capability {plan.cc}; "
                          f"device {ep.device_id} has {here}", abi.EP_INVALID_GRAPH)
    prefetch = getattr(ep, "prefetch", None)
    if prefetch is not None:
        cupy_cache.provide(plan.cupy)  # the per-node kernels' CuPy code, as the saving machine compiled it
        prefetch.start(plan.warm)  # CuPy loads (or compiles) the per-node kernels while this plan is built
    for m in plan.modules:
        nvrtc.provide(m.arch, m.digest, m.binary)
    algo_cache.provide(plan.algos)
    return graph


def make_function(ep, fused):
    """The compute function of one fused node: per signature when its inputs have symbolic dims."""
    graph = fused.graph
    ids = list(graph.input_ids) or [graph.values.index(v) for v in graph.inputs]
    if is_dynamic(graph, ids) or host_value_inputs(graph, ids):
        return ShapePlanFunction(ep, fused)
    return PlanFunction(ep, fused)
