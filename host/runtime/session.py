"""InferenceSession, SessionOptions, RunOptions and IOBinding, shaped like onnxruntime's."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import numpy as np

import abi
from abi.dtypes import STRING, dtype_type_name, to_numpy, to_onnx, type_name
from host import cpu_ep
from host.cpu_ep.half_carry import carry_float32
from host.cpu_ep.ops_control import ControlFlowKernel
from host.errors import EpError, EphostError, InvalidArgument, ModelError, PluginLoadError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.plugins.ep import CPU_LOCATION, PluginEp, check_options_without_device
from host.plugins.hostapi import ffi
from host.plugins.loader import negotiate, release_rejected
from host.runtime import compiled, ort_api, profiling, stages, threads, types
from host.runtime.executor import Executor, Plan, PlanNode, compute_frees
from host.runtime.graph_capture import GraphCapture, parse_graph_id
from host.runtime.graphview import GraphView
from host.runtime.model import ValueMeta, build_graph
from host.runtime.options import RunOptions, SessionOptions
from host.runtime.ortvalue import OrtValue, host_array_at
from host.runtime.subgraph import SubgraphRunner, prepare_subgraph, subgraph_eps
from host.runtime.tensor import DeviceTensor, as_device_tensor, tensor_from_pointer
from host.runtime.warn import warn_caller

_log = logging.getLogger("ephost")
CPU_EP = "CPUExecutionProvider"

_DEFAULT_ENV: Environment | None = None
_ENV_LOCK = threading.Lock()


def default_environment() -> Environment:
    """The process-wide Environment used when a session is given none."""
    global _DEFAULT_ENV
    with _ENV_LOCK:
        if _DEFAULT_ENV is None:
            _DEFAULT_ENV = Environment()
        return _DEFAULT_ENV


# Shared by calls that pass no RunOptions: its parsed entries are cached on it (never add to it).
_DEFAULT_RUN_OPTIONS = RunOptions()


def _check_terminate(ro: RunOptions) -> None:
    if ro._values["terminate"]:
        raise EpError("run not started: RunOptions.terminate is True; set it to False to run again")


@dataclass(frozen=True)
class NodeArg:
    """Name, shape (ints, symbolic names or None) and type string of a model input or output."""

    name: str
    shape: list
    type: str


def _type_string(elem_type: int) -> str:
    return type_name(elem_type)


def _string_feed(name: str, value: np.ndarray) -> np.ndarray:
    """A string input as onnxruntime takes it: an object array of str; NumPy text arrays ('<U5') are
    converted, other object arrays must hold str only."""
    if value.dtype.kind == "U":
        return value.astype(object)
    if value.dtype == object and not all(isinstance(s, str) for s in value.flat):
        bad = next(type(s).__name__ for s in value.flat if not isinstance(s, str))
        raise InvalidArgument(f"input '{name}': a tensor(string) input holds Python str only; "
                              f"got an object array holding {bad}")
    return value


def _option_text(ep: str, what: str, key, value) -> str:
    """A provider option key or value as text that reaches the plugin intact (a C string)."""
    text = str(value)
    if "\0" in text:
        raise InvalidArgument(f"{ep} option {str(key)!r}: the {what} contains a NUL character; "
                              "keys and values must be plain text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{ep} option {str(key)!r}: the {what} is not encodable as UTF-8 ({exc.reason})") from None
    return text


def _parse_providers(providers) -> list[tuple[str, dict[str, str]]]:
    out = []
    for p in providers or []:
        if isinstance(p, str):
            out.append((p, {}))
        elif isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], dict):
            out.append((p[0], {_option_text(p[0], "key", k, k): _option_text(p[0], "value", k, v)
                               for k, v in p[1].items()}))
        else:
            raise InvalidArgument(f"a provider must be a name or (name, options dict); got {p!r}")
    return out


class InferenceSession:
    """Runs one ONNX model with plugin EPs in priority order and the CPU EP for the rest."""

    def __init__(self, path_or_bytes, sess_options: SessionOptions | None = None, providers=None,
                 provider_options=None, env: Environment | None = None, **kwargs):
        ort_api.check_session_kwargs(kwargs)
        self.env = env or default_environment()
        self.options = ort_api.session_options(sess_options)  # a copy: later changes do not half-apply
        ort_api.apply_log_severity(self.options)
        self._profiler = (profiling.Profiler(self.options.profile_file_prefix, self.options.logid)
                          if self.options.enable_profiling else profiling.NULL)
        self._profiling = self._profiler.enabled  # the one check the run path makes
        self._threads = threads.POOLS.bounded(threads.resolve(self.options.intra_op_num_threads))  # 0: cores
        self._fallback_enabled = True
        t0 = time.perf_counter_ns()
        self.fallbacks: Counter[str] = Counter()
        self._closed = False
        self._eps: list[PluginEp] = []
        self._regs = []
        self._kernel_list: list = []
        self._partitions: list = []  # compiled partitions (ABI v6), released with the kernels
        self._lock = threading.Lock()
        stages.enter(stages.LOADING)
        with self._profiler.span("model_loading"):
            self.graph = build_graph(self._optimized(path_or_bytes))
        self._view = GraphView(self.graph)
        self.env.track_session(self)  # env.close() closes it first; refused when the env is closed
        try:
            self._provider_list = _parse_providers(
                ort_api.select_providers(providers, provider_options, self.options, self.env))
            self._create_eps(self._provider_list)
            stages.enter(stages.PARTITIONING)
            with self._profiler.span("partitioning"):
                self.plan = self._partition()
            capture_eps = any(ep.graph_capture_enabled() for ep in self.plan.eps)
            self._executor = Executor(self.plan, self._concurrent(), ep_allocates_host=capture_eps)
            self.capture = GraphCapture(self)
        except BaseException:
            self._closed = True
            self._release_eps()
            self.env.forget_session(self)
            raise
        stages.enter(stages.DONE)
        if self._profiling:
            profiling.instrument(self, self._profiler)
            self._profiler.record("session_initialization", "Session", t0, time.perf_counter_ns())
        _log.info("%s: %d nodes on %s", self.options.logid or "session", len(self.plan.nodes), self.get_providers())

    # -- creation -------------------------------------------------------------------------------
    def _create_eps(self, providers: list[tuple[str, dict[str, str]]]) -> None:
        for name, options in providers:
            if name == CPU_EP:
                continue
            reg, factory = self.env.find_factory(name)
            try:
                if factory is None and self.env.ensure_builtin(name):  # a built-in plugin, asked for by name
                    reg, factory = self.env.find_factory(name)
            except PluginLoadError as exc:  # cannot be built or loaded here: onnxruntime falls back too
                warn_caller(f"{name} is not available, its nodes fall back to {CPU_EP}: {exc}")
                self.fallbacks["builtin_unavailable"] += 1
                continue
            if factory is None:
                known = sorted({d.ep_name for d in self.env.ep_devices()} | {CPU_EP})
                raise InvalidArgument(f"execution provider {name!r} is not registered; available: {known}")
            if not factory.devices:
                check_options_without_device(reg, factory, options, self.options.entries)  # mistakes still count
                warn_caller(f"{name} has no device; its nodes fall back to {CPU_EP}")
                self.fallbacks["ep_without_device"] += 1
                continue
            ep = PluginEp(reg, factory, options, self.options.entries)
            reg.acquire()
            self._regs.append(reg)
            self._eps.append(ep)

    def _optimized(self, model):
        """The model after host.optimizer at the session's graph_optimization_level (saved to
        optimized_model_filepath when set); `self.optimization` keeps the optimizer's report."""
        from host import optimizer  # onnxscript loads on first use, not with the session module

        stages.enter(stages.OPTIMIZING)
        with self._profiler.span("optimization", level=int(self.options.graph_optimization_level)):
            model, self.optimization = optimizer.prepare(model, self.options.graph_optimization_level,
                                                         self.options.optimized_model_filepath)
        if self._profiling:
            profiling.record_passes(self._profiler, self.optimization)
        return model

    def _expand_unclaimed(self) -> None:
        """Fused nodes that no plugin EP claims and the CPU EP cannot run go back to their unfused
        subgraphs (host.optimizer.expand_unclaimed); repeated, as an expansion may hold fused ops."""
        from host import optimizer

        for _ in range(3):
            g = self.graph
            candidates = {i for i, n in enumerate(g.nodes) if cpu_ep.lookup(n.domain, n.op_type, n.opset) is None
                          and optimizer.can_expand(n.domain, n.op_type)}
            if not candidates:
                return
            claims = compiled.collect_claims(self._eps, self._view, g, Counter())
            claimed = set(claims.single) | {i for _, group in claims.groups for i in group}
            names = [g.nodes[i].name for i in sorted(candidates - claimed)]
            if not names:
                return
            self.graph = build_graph(optimizer.expand_unclaimed(g.model, names))
            self._view = GraphView(self.graph)

    def _own_opset(self, node) -> int:
        """The opset the user's model declares for the node's domain (the optimizer may have
        converted the graph to a newer one; messages name the model's own)."""
        declared = self.optimization.source_opsets if self.optimization is not None else {}
        return declared.get(node.domain if node.domain != "ai.onnx" else "", node.opset)

    def _partition(self) -> Plan:
        self._expand_unclaimed()
        return self._plan_graph(self.graph, self._view)

    def _plan_graph(self, g, view: GraphView, eps: list[PluginEp] | None = None) -> Plan:
        """Partition one graph (the model's, or a control-flow subgraph's) and plan it among `eps`
        (default: the session's)."""
        ids = view.value_index
        # ABI v6: fused groups become compiled partitions, one plan node each (compiled.py).
        assigned, parts = compiled.claim_and_compile(self._eps if eps is None else eps, view, g, self.fallbacks)
        self._partitions.extend(parts)
        stages.enter(stages.CREATING_KERNELS)
        fused_first = {p.group.nodes[0]: p for p in parts}
        fused = {i for p in parts for i in p.group.nodes}
        objects = frozenset(ids[name] for name, meta in g.values.items() if meta.type is not None and name in ids)
        nodes, unsupported, units, subgraphs = [], [], [], []
        for i, n in enumerate(g.nodes):
            if i in fused:
                part = fused_first.get(i)
                if part is not None:
                    nodes.append(PlanNode(i, part.name, compiled.FUSED_OP_TYPE,
                                          tuple(ids[x] for x in part.group.inputs),
                                          tuple(ids[x] for x in part.group.outputs), part.group.ep, part,
                                          members=part.node_names))
                    units.append(part.group.nodes)
                continue
            ep = assigned.get(i)
            ins = tuple(ids[x] if x else -1 for x in n.inputs)
            outs = tuple(ids[x] if x else -1 for x in n.outputs)
            if ep is not None:
                kernel = self._plugin_kernel(ep, view, i, n)
            else:
                if cpu_ep.lookup(n.domain, n.op_type, n.opset) is None:
                    unsupported.append(f"'{n.name}' ({n.domain or 'ai.onnx'}::{n.op_type}, opset {self._own_opset(n)})")
                    continue
                kernel = cpu_ep.create_kernel(n, g.values)  # declared types: half precision (cpu_ep/half.py)
                kernel.object_outputs = frozenset(j for j, o in enumerate(outs) if o in objects)
                if isinstance(kernel, ControlFlowKernel):
                    subgraphs += self._prepare_subgraphs(kernel, g, n)
            nodes.append(PlanNode(i, n.name, n.op_type, ins, outs, ep, kernel))
            units.append((i,))
        if unsupported:
            raise ModelError(f"no execution provider supports {len(unsupported)} node(s): "
                             + ", ".join(unsupported))
        if parts:
            nodes = [nodes[u] for u in compiled.unit_order(g, units)]
        names = view.value_names
        elem_types = [(g.values.get(nm) or ValueMeta(nm)).elem_type for nm in names]
        # EPs that run nodes here or in a subgraph: they get OnRunStart/OnRunEnd for every run.
        used = {id(pn.ep) for pn in nodes} | {id(ep) for sub in subgraphs for ep in sub.plan.eps}
        plan = Plan(nodes, dict(ids), names, elem_types,
                    {v.name: ids[v.name] for v in g.inputs}, {v.name: ids[v.name] for v in g.outputs},
                    {ids[k]: np.asarray(v, order="C") for k, v in g.initializers.items()},
                    [ep for ep in self._eps if id(ep) in used], objects, subgraphs)
        compute_frees(nodes, set(plan.output_ids.values()) | set(plan.constants))
        carry_float32(nodes, set(plan.output_ids.values()))  # half values kept float32 between CPU nodes
        return plan

    def _prepare_subgraphs(self, kernel: ControlFlowKernel, g, node) -> list[SubgraphRunner]:
        """Each subgraph of a control-flow node, partitioned and planned once (host/runtime/subgraph.py)."""
        outer_names = node.inputs[len(node.inputs) - node.implicit:]
        made = []

        # Bodies go only to EPs computing in host memory for now: values crossing a body's boundary
        # from a device EP reach CPU kernels without a copy (wrong results on the CUDA EP), so device
        # EPs' bodies run on the CPU EP until that boundary is handled (docs/control_flow.md).
        host_eps = subgraph_eps(self._eps)
        if len(host_eps) < len(self._eps):
            self.fallbacks["subgraph_without_device_eps"] += 1

        def planner(attr: str) -> SubgraphRunner:
            runner = prepare_subgraph(node.attrs[attr], g, outer_names,
                                      lambda sub, view: self._plan_graph(sub, view, host_eps))
            made.append(runner)
            return runner

        kernel.prepare(planner)
        return made

    def _plugin_kernel(self, ep: PluginEp, view: GraphView, index: int, node):
        out = ffi.new("EpKernel**")
        hostapi.check(ep.slots.CreateKernel(ep.ptr, view.ptr, index, out),
                      f"{ep.owner}: CreateKernel for node '{node.name}' ({node.op_type})")
        try:
            slots = negotiate("EpKernel", out[0], ep.slots.negotiated, ep.owner)
        except PluginLoadError:
            release_rejected("EpKernel", out[0])  # created, then refused by the host: not leaked
            raise
        self._kernel_list.append(slots)
        return slots

    def _concurrent(self) -> bool:
        ok = all(ep.concurrent_runs for ep in self.plan.eps)
        self.fallbacks["concurrent_runs" if ok else "serialised_runs"] += 1
        return ok

    # -- introspection --------------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(v.name, list(v.shape) if v.shape is not None else None,
                        v.type_text if v.type is not None else _type_string(v.elem_type)) for v in self.graph.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(v.name, list(v.shape) if v.shape is not None else None,
                        v.type_text if v.type is not None else _type_string(v.elem_type)) for v in self.graph.outputs]

    def get_providers(self) -> list[str]:
        return [ep.name for ep in self._eps] + [CPU_EP]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """The options each EP in use was created with, by provider name (the CPU EP takes none)."""
        given = {name: dict(opts) for name, opts in self._provider_list}
        return {name: given.get(name, {}) for name in self.get_providers()}

    def get_session_options(self) -> SessionOptions:
        """The session's own copy of the options it was created with."""
        return self.options

    def get_modelmeta(self) -> ort_api.ModelMetadata:
        return ort_api.model_metadata(self.graph.model)

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Initializers the model also lists as graph inputs (ephost does not take feeds for them)."""
        inits = self.graph.initializers
        return [NodeArg(vi.name, list(inits[vi.name].shape), _type_string(self.graph.values[vi.name].elem_type))
                for vi in self.graph.model.graph.input if vi.name in inits]

    def disable_fallback(self) -> None:
        """Recorded only: ephost never re-creates a session on other providers after a failure."""
        self._fallback_enabled = False

    def enable_fallback(self) -> None:
        """Recorded only (see disable_fallback)."""
        self._fallback_enabled = True

    def end_profiling(self) -> str:
        """Write the profile and stop profiling; returns its path ('' when profiling is off)."""
        if not self._profiling:
            return ""
        self._profiling = False
        return self._profiler.end()

    def get_profiling_start_time_ns(self) -> int:
        """Wall-clock time (ns since the epoch) of the profile's ts=0; 0 when profiling is off."""
        return self._profiler.start_time_ns

    def node_assignment(self) -> dict[str, str]:
        """Which EP runs each node, by node name."""
        return {name: (n.ep.name if n.ep is not None else CPU_EP) for n in self.plan.nodes
                for name in (n.members or (n.name,))}

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    # -- running ----------------------------------------------------------------------------------
    def _check_feed(self, meta: ValueMeta, value) -> object:
        if isinstance(value, OrtValue):
            value = value.value
        if meta.type is not None:  # a sequence, an optional or a map (host/runtime/types.py)
            return types.check_feed(meta.name, meta.type, value)
        dev = value if isinstance(value, DeviceTensor) else as_device_tensor(value)
        if dev is not None:
            arr_dtype, shape = dev.dtype, dev.shape
            value = dev
        else:
            value = np.asarray(value, order="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
            if meta.elem_type == STRING:
                value = _string_feed(meta.name, value)
            arr_dtype, shape = value.dtype, value.shape
        expected = to_numpy(meta.elem_type) if meta.elem_type else None
        if expected is not None and arr_dtype != expected:
            raise InvalidArgument(f"input '{meta.name}': expected dtype {expected} ({type_name(meta.elem_type)}), "
                                  f"got {arr_dtype} ({dtype_type_name(arr_dtype)})")
        if meta.shape is not None:
            if len(shape) != len(meta.shape):
                raise InvalidArgument(f"input '{meta.name}': expected rank {len(meta.shape)} "
                                      f"(shape {list(meta.shape)}), got rank {len(shape)} (shape {list(shape)})")
            for axis, (want, got) in enumerate(zip(meta.shape, shape)):
                if isinstance(want, int) and want > 0 and want != got:
                    raise InvalidArgument(f"input '{meta.name}': dimension {axis} must be {want}, got {got} "
                                          f"(expected shape {list(meta.shape)}, got {list(shape)})")
        return value

    def _feeds(self, feeds: dict) -> dict[int, object]:
        if not isinstance(feeds, dict):
            raise InvalidArgument(f"feeds must be a dict of input name to array; got {type(feeds).__name__}")
        metas = {v.name: v for v in self.graph.inputs}
        unknown = sorted(set(feeds) - set(metas))
        if unknown:
            raise InvalidArgument(f"unknown input name(s) {unknown}; model inputs: {sorted(metas)}")
        missing = sorted(set(metas) - set(feeds))
        if missing:
            raise InvalidArgument(f"missing input(s) {missing}; model inputs: {sorted(metas)}")
        return {self.plan.input_ids[k]: self._check_feed(metas[k], v) for k, v in feeds.items()}

    def _output_ids(self, output_names) -> list[int]:
        names = output_names or [v.name for v in self.graph.outputs]
        bad = [n for n in names if n not in self.plan.output_ids]
        if bad:
            raise InvalidArgument(f"unknown output name(s) {bad}; model outputs: {sorted(self.plan.output_ids)}")
        return [self.plan.output_ids[n] for n in names]

    def run(self, output_names, input_feed: dict, run_options: RunOptions | None = None) -> list[np.ndarray]:
        """Run the model; outputs come back as NumPy arrays (feeds: arrays, device arrays or OrtValues)."""
        if self._profiling:
            with self._profiler.span("model_run"):
                return self._run(output_names, input_feed, run_options)
        return self._run(output_names, input_feed, run_options)

    def _run(self, output_names, feeds: dict, run_options: RunOptions | None) -> list[np.ndarray]:
        self._check_open()
        ids = self._output_ids(output_names)
        fed = self._feeds(feeds)
        ro = run_options or _DEFAULT_RUN_OPTIONS
        _check_terminate(ro)
        parse_graph_id(ro._get("gpu_graph_id"))  # a malformed id is an error here too
        st = self._execute(fed, {}, ro, graph_id="-1" if self.capture.enabled else None)
        to_host = self._executor.to_host
        objects = self.plan.object_ids
        outs = [types.host_value(st.values[i], to_host) if i in objects else to_host(st.values[i]) for i in ids]
        # Views (of EP allocations, feeds or initializers) and feeds passed straight through (an
        # Identity of an input) are copied, so results are the caller's own, as in onnxruntime.
        feed_ids = {id(v) for v in fed.values()}
        return [o if i in objects or not isinstance(o, np.ndarray) or (o.flags.owndata and id(o) not in feed_ids) else o.copy()
                for i, o in zip(ids, outs)]

    def _execute(self, feeds, bound_outputs, ro: RunOptions, graph_id: str | None = None):
        ex = self._executor
        lock = None if ex.concurrent else self._lock
        if lock is not None:
            lock.acquire()
        try:
            st = ex.state()
            st.bound_outputs = bound_outputs
            st.capturing = graph_id not in (None, "-1")  # warm-up or capture of a graph id (v6 frames)
            c_ro = ro.c_struct({"gpu_graph_id": graph_id} if graph_id is not None else None)
            self._on_run_start(c_ro)
            try:
                with self._threads:
                    ex.execute(st, feeds)
            except EphostError as exc:
                self._on_run_end(c_ro, sync=True, failed=True)
                # The failed run's temporaries (device copies in the executor's frames) go now, not
                # when the caller drops the exception, which can be after the plugin is released.
                traceback.clear_frames(exc.__traceback__)
                raise
            except Exception as exc:  # noqa: BLE001 - becomes a typed error naming the node
                self._on_run_end(c_ro, sync=True, failed=True)
                traceback.clear_frames(exc.__traceback__)
                raise EpError(f"run failed: {exc}") from exc
            self._on_run_end(c_ro, sync=ro._get("disable_synchronize_execution_providers") != "1")
            return st
        finally:
            if lock is not None:
                lock.release()

    def _on_run_start(self, c_ro) -> None:
        for ep in self.plan.eps:
            if ep.slots.OnRunStart is not None:
                hostapi.check(ep.slots.OnRunStart(ep.ptr, c_ro), f"{ep.owner}: OnRunStart")

    def _on_run_end(self, c_ro, sync: bool, failed: bool = False) -> None:
        for ep in self.plan.eps:
            if ep.slots.OnRunEnd is not None:
                status = ep.slots.OnRunEnd(ep.ptr, c_ro, int(sync))
                if failed:
                    if status != ffi.NULL:
                        hostapi.STATUSES.release(status)
                    continue
                hostapi.check(status, f"{ep.owner}: OnRunEnd")

    def run_with_iobinding(self, binding: IOBinding, run_options: RunOptions | None = None) -> None:
        self._check_open()
        ro = run_options or _DEFAULT_RUN_OPTIONS
        _check_terminate(ro)
        if self._profiling:
            with self._profiler.span("model_run", iobinding=True):
                self.capture.run(binding, ro)
            return
        self.capture.run(binding, ro)

    def run_with_ort_values(self, output_names, input_dict_ort_values: dict,
                            run_options: RunOptions | None = None) -> list[OrtValue]:
        """run() with OrtValues in and out."""
        return [OrtValue(v) for v in self.run(output_names, input_dict_ort_values, run_options)]

    def run_async(self, output_names, input_feed: dict, callback, user_data=None,
                  run_options: RunOptions | None = None) -> None:
        """Run on a worker thread, then call `callback(outputs, user_data, error_text)` there.

        As in onnxruntime, errors (bad feeds included) reach the callback as text, with no outputs.
        """
        if not callable(callback):
            raise InvalidArgument(f"run_async needs a callable callback(results, user_data, err); got {callback!r}")
        self._check_open()

        def work():
            try:
                outputs = self.run(output_names, input_feed, run_options)
            except Exception as exc:  # noqa: BLE001 - handed to the callback, as onnxruntime does
                callback([], user_data, f"{type(exc).__name__}: {exc}")
                return
            callback(outputs, user_data, "")

        threading.Thread(target=work, name="ephost-run-async", daemon=True).start()

    def _run_bound(self, binding: IOBinding, ro: RunOptions, graph_id: str | None = None) -> None:
        feeds = self._feeds(binding.inputs)
        bound = {self.plan.output_ids[k]: v for k, v in binding.outputs.items() if v is not None}
        st = self._execute(feeds, bound, ro, graph_id)
        results = {}
        for name in binding.output_names():
            value = st.values[self.plan.output_ids[name]]
            target = binding.outputs.get(name)
            if target is not None and value is not target:
                self._copy_into(target, value, name)  # produced elsewhere (e.g. the CPU EP): fill the buffer
                value = target
            results[name] = value
        binding._results = results

    def _copy_into(self, target, value, name: str) -> None:
        if tuple(target.shape) != tuple(value.shape) or target.dtype != value.dtype:
            raise InvalidArgument(f"output '{name}' is bound to a buffer of shape {list(target.shape)} and dtype "
                                  f"{target.dtype}; the model produced shape {list(value.shape)}, dtype {value.dtype}")
        if isinstance(target, np.ndarray):
            np.copyto(target, self._executor.to_host(value))
            return
        moved = self._executor.transfer(value, (target.device_type, target.device_id), None, None)
        dev = moved if isinstance(moved, DeviceTensor) else None
        if dev is None:
            raise EpError(f"output '{name}' could not be copied into its bound device buffer")
        src = ffi.new("EpTensor*")
        dst = ffi.new("EpTensor*")
        st = self._executor.state()
        st.fill(src, dev)
        st.fill(dst, target)
        ep = self._executor._ep_at((target.device_type, target.device_id))
        t = ep.transfer
        hostapi.check(t.CopyTensors(t.ptr, src, dst, ffi.new("EpSyncStream*[1]"), 1), f"{ep.owner}: CopyTensors")

    # -- lifetime ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this InferenceSession is closed")

    def _release_eps(self) -> None:
        """Release kernels, partitions, then EPs, each in reverse order of creation. A failing
        release does not stop the others; the first failure is raised at the end."""
        kernels, self._kernel_list = getattr(self, "_kernel_list", []), []
        partitions, self._partitions = getattr(self, "_partitions", []), []
        eps, self._eps = self._eps, []
        regs, self._regs = self._regs, []
        steps = ([lambda k=k: k.Release(k.ptr) for k in reversed(kernels)]
                 + [p.release for p in reversed(partitions)] + [ep.close for ep in reversed(eps)]
                 + [reg.release for reg in regs])
        first = None
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the rest is still released
                _log.warning("releasing a session object failed: %s", exc)
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Release graphs, run states, kernels, streams and EPs; closing twice is fine. Whatever fails,
        the EPs are still released (the failure is raised afterwards)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.capture.close()
            self._executor.close()
        finally:
            try:
                self._release_eps()
            finally:
                self.env.forget_session(self)

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


_BINDING_SERIALS = itertools.count(1)


class IOBinding:
    """Inputs and outputs bound to fixed buffers (NumPy arrays, device buffers, DLPack objects)."""

    def __init__(self, session: InferenceSession):
        self.session = session
        self.inputs: dict[str, object] = {}
        self.outputs: dict[str, object] = {}
        self._results: dict[str, object] = {}
        self._host_outputs: set[str] = set()  # bound with device_type='cpu' and no buffer
        self.version = 0  # bumped by every bind/clear: replay re-checks buffers only when it moved
        self.serial = next(_BINDING_SERIALS)  # unlike id(), never reused by a later binding

    def bind_input(self, name: str, value=None, device_id: int = 0, element_type=None, shape=None,
                   buffer_ptr: int | None = None, *, device_type: str | None = None) -> None:
        """Bind an array-like, or a device buffer given as (element_type, shape, buffer_ptr).

        onnxruntime's positional form `bind_input(name, device_type, device_id, element_type, shape,
        buffer_ptr)` works too: a string in place of the value is the device type.
        """
        if isinstance(value, str):
            device_type, value = value, None
        metas = {v.name: v for v in self.session.graph.inputs}
        if name not in metas:
            raise InvalidArgument(f"unknown input name {name!r}; model inputs: {sorted(metas)}")
        value = self._value(name, value, device_type, device_id, element_type, shape, buffer_ptr)
        self.inputs[name] = self.session._check_feed(metas[name], value)
        self.version += 1

    def bind_output(self, name: str, value=None, device_id: int = 0, element_type=None, shape=None,
                    buffer_ptr: int | None = None, *, device_type: str | None = None) -> None:
        """Bind an output to a buffer; with no buffer, the EP allocates it on each run.

        onnxruntime's positional form `bind_output(name, device_type='cpu', device_id, element_type,
        shape, buffer_ptr)` works too; `device_type='cpu'` with no buffer hands the output back in
        host memory.
        """
        if isinstance(value, str):
            device_type, value = value, None
        if name not in self.session.plan.output_ids:
            raise InvalidArgument(f"unknown output name {name!r}; model outputs: "
                                  f"{sorted(self.session.plan.output_ids)}")
        self.version += 1
        if device_type == "cpu" and value is None and buffer_ptr is None:
            self._host_outputs.add(name)
        else:
            self._host_outputs.discard(name)
        if value is None and buffer_ptr is None:
            self.outputs[name] = None
            return
        self.outputs[name] = self._value(name, value, device_type, device_id, element_type, shape, buffer_ptr)

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        """Bind a host array (NumPy or array-like) to input `name`."""
        self.bind_input(name, np.asarray(arr_on_cpu))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self.bind_input(name, _ortvalue(ortvalue, "bind_ortvalue_input"))

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """Bind output `name` to the memory of `ortvalue`, which the run fills."""
        self.bind_output(name, _ortvalue(ortvalue, "bind_ortvalue_output"))

    @staticmethod
    def _value(name, value, device_type, device_id, element_type, shape, buffer_ptr):
        if isinstance(value, OrtValue):
            value = value.value
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise InvalidArgument(f"binding {name!r} by pointer needs element_type and shape")
            if device_type == "cpu":
                return host_array_at(int(buffer_ptr), tuple(shape), element_type)
            if device_type not in ("cuda", "gpu"):
                raise InvalidArgument(f"binding {name!r} by pointer: device_type must be 'cuda'; got "
                                      f"{device_type!r} (bind host memory as a NumPy array)")
            return tensor_from_pointer(int(buffer_ptr), tuple(shape), to_onnx(np.dtype(element_type)),
                                       abi.DEVICE_GPU, device_id)
        if isinstance(value, (DeviceTensor, np.ndarray)):
            return value
        dev = as_device_tensor(value)
        if dev is not None:
            return dev
        if hasattr(value, "__dlpack__"):
            return np.from_dlpack(value)
        return np.asarray(value)

    def output_names(self) -> list[str]:
        return list(self.outputs) or [v.name for v in self.session.graph.outputs]

    def get_outputs(self) -> list[OrtValue]:
        """Outputs of the last run as OrtValues (over NumPy arrays or DeviceTensors)."""
        to_host = self.session._executor.to_host
        return [OrtValue(v, to_host) for v in self.get_output_values()]

    def get_output_values(self) -> list:
        """Outputs of the last run: NumPy arrays for host memory, DeviceTensors for device memory."""
        names = self.output_names()
        missing = [n for n in names if n not in self._results]
        if missing:
            if not self._results:
                raise InvalidArgument("IOBinding has no outputs yet: call run_with_iobinding(binding) before "
                                      "get_outputs()")
            raise InvalidArgument(f"output(s) {missing} were bound after the last run_with_iobinding(); "
                                  "run again before get_outputs()")
        values = [self._results[n] for n in names]
        if self._host_outputs:
            to_host = self.session._executor.to_host
            values = [to_host(v) if n in self._host_outputs else v for n, v in zip(names, values)]
        return values

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        ex = self.session._executor
        return [np.array(ex.to_host(v)) for v in self.get_output_values()]

    def clear_binding_inputs(self) -> None:
        self.inputs.clear()
        self.version += 1

    def clear_binding_outputs(self) -> None:
        self.outputs.clear()
        self.version += 1


def _ortvalue(value, where: str):
    if not isinstance(value, OrtValue):
        raise InvalidArgument(f"{where} needs an OrtValue; got {type(value).__name__} (use OrtValue.ortvalue_from_numpy)")
    return value.value


__all__ = ["InferenceSession", "SessionOptions", "RunOptions", "IOBinding", "NodeArg", "OrtValue", "CPU_LOCATION"]
