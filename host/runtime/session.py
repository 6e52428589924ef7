"""InferenceSession, SessionOptions, RunOptions and IOBinding, shaped like onnxruntime's."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import numpy as np

from abi.dtypes import STRING, dtype_type_name, to_numpy, type_name
from host.cpu_ep import heap
from host.errors import EpError, EphostError, InvalidArgument, PluginLoadError
from host.plugins.environment import Environment
from host.plugins.ep import CPU_LOCATION, PluginEp, check_options_without_device
from host.runtime import (
    bucket_graphs,
    buckets,
    epcontext,
    epcontext_save,
    first_run,
    ort_api,
    profiling,
    range_lengths,
    shape_graphs,
    shape_program,
    stages,
    symbolic_shapes,
    threads,
    types,
)
from host.runtime.executor import Executor
from host.runtime.graph_capture import GraphCapture, run_flags
from host.runtime.iobinding import IOBinding
from host.runtime.model import ValueMeta, build_graph, load_model
from host.runtime.options import RunOptions, SessionOptions
from host.runtime.ortvalue import OrtValue
from host.runtime.partition import Partitioner
from host.runtime.plain_feeds import plain_inputs
from host.runtime.plain_run import PlainRun
from host.runtime.tensor import DeviceTensor, as_device_tensor
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


def _check_shape(meta: ValueMeta, shape: tuple) -> None:
    if len(shape) != len(meta.shape):
        raise InvalidArgument(f"input '{meta.name}': expected rank {len(meta.shape)} "
                              f"(shape {list(meta.shape)}), got rank {len(shape)} (shape {list(shape)})")
    for axis, (want, got) in enumerate(zip(meta.shape, shape)):
        if isinstance(want, int) and want > 0 and want != got:
            raise InvalidArgument(f"input '{meta.name}': dimension {axis} must be {want}, got {got} "
                                  f"(expected shape {list(meta.shape)}, got {list(shape)})")


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
    """Runs one ONNX model with plugin EPs in priority order and the CPU EP for the rest.

    The onnxruntime-shaped front: arguments, options, feeds and outputs. The graph is optimized
    (host/optimizer), partitioned into a plan (host/runtime/partition), and run by the executor's
    steps (host/runtime/executor.py, host/runtime/steps); graph capture is host/runtime/graph_capture.py.
    """

    _plain_run = None  # run()'s plain path (host/runtime/plain_run.py), set with the executor

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
        if self.options.enable_cpu_mem_arena:
            heap.keep_freed_memory()  # freed activations stay in the heap for the next run (cpu_ep/heap.py)
        self._fallback_enabled = True
        t0 = time.perf_counter_ns()
        self.fallbacks: Counter[str] = Counter()
        self._closed = False
        self._eps: list[PluginEp] = []
        self._regs = []
        self._partitioner: Partitioner | None = None
        self._lock = threading.Lock()
        stages.enter(stages.LOADING)
        with self._profiler.span("model_loading"):
            model = self._optimized(path_or_bytes)
            self.graph = build_graph(model, owned=model is not path_or_bytes,  # not the caller's ModelProto
                                     arrays=self.contexts.mapped if self.contexts is not None else None)
        self.env.track_session(self)  # env.close() closes it first; refused when the env is closed
        try:
            self._provider_list = _parse_providers(
                ort_api.select_providers(providers, provider_options, self.options, self.env))
            self._create_eps(self._provider_list)
            stages.enter(stages.PARTITIONING)
            with self._profiler.span("partitioning"):
                opsets = self.optimization.source_opsets if self.optimization is not None else {}
                self._partitioner = Partitioner(self._eps, self.fallbacks, opsets,
                                                shape_program.capacity(self.options.entries), self.contexts)
                self.graph, self.plan = self._partitioner.partition(self.graph)
                self.shape_program = self._partitioner.shape_program
            self.context_model = epcontext_save.save_if_enabled(self, path_or_bytes)  # ABI v7: ep.context_enable
            self._make_executor()
        except BaseException:
            self._closed = True
            self._release_eps()
            self.env.forget_session(self)
            raise
        stages.enter(stages.DONE)
        if self._profiling:
            self._profiler.record("session_initialization", "Session", t0, time.perf_counter_ns())
        _log.info("%s: %d nodes on %s", self.options.logid or "session", len(self.plan.nodes), self.get_providers())

    # -- creation -------------------------------------------------------------------------------
    def _make_executor(self) -> None:
        """The executor of the plan (its steps observed when profiling) and the capture driver."""
        self.input_metas = {v.name: v for v in self.graph.inputs}
        self._plain_inputs = plain_inputs(self.input_metas, self.plan.input_ids)
        self._all_output_ids = [self.plan.output_ids[v.name] for v in self.graph.outputs]
        capture_eps = any(ep.graph_capture_enabled() for ep in self.plan.eps)
        bounds_blas = threads.plan_calls_blas(self.plan)
        if not bounds_blas:
            self._threads = contextlib.nullcontext()  # nothing to bound: no threadpoolctl calls per run
        first_run.prepare(self.plan, bounds_blas)  # one-time work of run 1, done now (issue 29)
        observer = profiling.StepObserver.create(self._profiler, self.plan) if self._profiling else None
        self.executor = Executor(self.plan, self._concurrent(), ep_allocates_host=capture_eps, observer=observer,
                                 transfer_eps=self._eps, program_capacity=getattr(
                                     self.shape_program, "capacity", shape_program.DEFAULT_CAPACITY))
        self.executor.upload_constants()  # per-node kernels' weights on their device before run 1 (issue 29)
        self.capture = GraphCapture(self._eps, self.plan, self.fallbacks, self._run_bound,
                                    None if self.executor.concurrent else self._lock,
                                    shape_graphs.capacity(self.options.entries))
        self.capture.keep_copies = self.executor.keeping_copies
        self.bucket_graphs = None
        if self.buckets is not None:
            self.buckets.bind(self.plan.input_ids, self.plan.output_ids)
            self.bucket_graphs = bucket_graphs.BucketGraphs.create(self)  # run() replays a graph per bucket
        self._plain_run = PlainRun.of(self, _DEFAULT_RUN_OPTIONS)

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
        from host.optimizer import cache  # the optimized-model cache (docs/cli.md#start-up-time)

        model, self.contexts = epcontext.SavedContexts.split(model)  # ABI v7: a saved context model
        if self.contexts is not None:  # was optimized before it was saved
            self.optimization = None
            self.buckets = buckets.Buckets.for_model(load_model(model), self.options.entries)
            return model
        stages.enter(stages.OPTIMIZING)
        # Dims ONNX inference misses, and the shape values they make constant (docs/dynamic_shapes.md).
        fold = int(self.options.graph_optimization_level) > 0  # DISABLE_ALL changes no node
        if symbolic_shapes.enabled(self.options.entries):
            model = symbolic_shapes.annotate(load_model(model), fold=fold)
        else:
            model = range_lengths.annotate(load_model(model))
        self.buckets = buckets.Buckets.for_model(model, self.options.entries)  # opt-in padding, checked here
        with self._profiler.span("optimization", level=int(self.options.graph_optimization_level)):
            model, self.optimization = optimizer.prepare(model, self.options.graph_optimization_level,
                                                         self.options.optimized_model_filepath,
                                                         cache=cache.enabled(self.options.entries))
        if self._profiling:
            profiling.record_passes(self._profiler, self.optimization)
        return model

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
        return self.plan.node_assignment()

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    # -- running ----------------------------------------------------------------------------------
    def check_feed(self, meta: ValueMeta, value) -> object:
        """`value` as a run takes it for input `meta` (an array, a device tensor, a list...), or a
        typed error naming what was expected."""
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
            _check_shape(meta, shape)
        return value

    def _feeds(self, feeds: dict) -> dict[int, object]:
        if not isinstance(feeds, dict):
            raise InvalidArgument(f"feeds must be a dict of input name to array; got {type(feeds).__name__}")
        metas = self.input_metas
        if feeds.keys() != metas.keys():
            unknown = sorted(set(feeds) - set(metas))
            if unknown:
                raise InvalidArgument(f"unknown input name(s) {unknown}; model inputs: {sorted(metas)}")
            missing = sorted(set(metas) - set(feeds))
            raise InvalidArgument(f"missing input(s) {missing}; model inputs: {sorted(metas)}")
        input_ids, plain = self.plan.input_ids, self._plain_inputs
        out = {}
        for k, v in feeds.items():
            fast = plain.get(k)
            if fast is not None and fast.accepts(v):
                out[fast.vid] = v  # what check_feed would return, without its conversions
            else:
                out[input_ids[k]] = self.check_feed(metas[k], v)
        return out

    def _output_ids(self, output_names) -> list[int]:
        if not output_names:
            return self._all_output_ids
        bad = [n for n in output_names if n not in self.plan.output_ids]
        if bad:
            raise InvalidArgument(f"unknown output name(s) {bad}; model outputs: {sorted(self.plan.output_ids)}")
        return [self.plan.output_ids[n] for n in output_names]

    def run(self, output_names, input_feed: dict, run_options: RunOptions | None = None) -> list[np.ndarray]:
        """Run the model; outputs come back as NumPy arrays (feeds: arrays, device arrays or OrtValues)."""
        if run_options is None and not output_names and self._plain_run is not None:
            outs = self._plain_run(input_feed)  # host/runtime/plain_run.py; None: the general path below
            if outs is not None:
                return outs
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
        run_flags(ro)  # a malformed gpu_graph_id is an error here too (parsed once per RunOptions)
        outs = None
        if self.buckets is not None:
            fed, real = self.buckets.pad(fed)  # shape buckets: padded here, cut back below
            if self.bucket_graphs is not None:
                outs = self.bucket_graphs.run(fed, ids, ro)  # None: this run goes eagerly
        objects = self.plan.object_ids
        if outs is None:
            st = self._execute(fed, {}, ro, graph_id="-1" if self.capture.enabled else None)
            to_host, vals, ndarray = self.executor.to_host, st.values, np.ndarray
            outs = [types.host_value(vals[i], to_host) if i in objects
                    else vals[i] if type(vals[i]) is ndarray else to_host(vals[i]) for i in ids]
        if self.buckets is not None:
            outs = self.buckets.unpad(outs, ids, real)
        # Views (of EP allocations, feeds or initializers) and feeds passed straight through (an
        # Identity of an input) are copied, so results are the caller's own, as in onnxruntime.
        feed_ids = {id(v) for v in fed.values()}
        return [o if i in objects or not isinstance(o, np.ndarray) or (o.flags.owndata and id(o) not in feed_ids) else o.copy()
                for i, o in zip(ids, outs)]

    def _execute(self, feeds, bound_outputs, ro: RunOptions, graph_id: str | None = None):
        feeds = self.shape_program.with_values(feeds)  # this input-shape signature's shape values
        ex = self.executor
        lock = None if ex.concurrent else self._lock
        if lock is not None:
            lock.acquire()
        try:
            st = ex.state()
            st.bound_outputs = bound_outputs
            st.capturing = graph_id not in (None, "-1")  # warm-up or capture of a graph id (v6 frames)
            # Only plugin EPs read the C run options (OnRunStart/OnRunEnd): a CPU-only plan skips them.
            c_ro = ro.c_struct({"gpu_graph_id": graph_id} if graph_id is not None else None) if ex.plan.eps else None
            if c_ro is not None:
                ex.on_run_start(c_ro)
            try:
                with self._threads:
                    ex.execute(st, feeds)
            except EphostError as exc:
                ex.on_run_end(c_ro, sync=True, failed=True)
                # The failed run's temporaries (device copies in the executor's frames) go now, not
                # when the caller drops the exception, which can be after the plugin is released.
                traceback.clear_frames(exc.__traceback__)
                raise
            except Exception as exc:  # noqa: BLE001 - becomes a typed error naming the node
                ex.on_run_end(c_ro, sync=True, failed=True)
                traceback.clear_frames(exc.__traceback__)
                raise EpError(f"run failed: {exc}") from exc
            ex.on_run_end(c_ro, sync=run_flags(ro)[1])
            return st
        finally:
            if lock is not None:
                lock.release()

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
        """One eager run of `binding` (GraphCapture calls it for warm-up and capture runs too)."""
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
            np.copyto(target, self.executor.to_host(value))
            return
        self.executor.copy_into(target, value, name)

    # -- lifetime ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this InferenceSession is closed")

    def _release_eps(self) -> None:
        """Release kernels, partitions, then EPs, each in reverse order of creation. A failing
        release does not stop the others; the first failure is raised at the end."""
        made = self._partitioner.release_steps() if self._partitioner is not None else []
        eps, self._eps = self._eps, []
        regs, self._regs = self._regs, []
        steps = made + [ep.close for ep in reversed(eps)] + [reg.release for reg in regs]
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
            if self.bucket_graphs is not None:
                self.bucket_graphs.close()
            self.capture.close()
            self.executor.close()
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


__all__ = ["InferenceSession", "SessionOptions", "RunOptions", "IOBinding", "NodeArg", "OrtValue", "CPU_LOCATION"]
