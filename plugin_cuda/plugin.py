"""The CUDA execution provider plugin: CuPy streams and memory, cuBLAS through cffi, CUDA graphs.

Loaded by build.py's embedding shim; talks to the host only through the tables of ep_abi.h.
Zero devices (no CuPy, no driver, no GPU) is a normal answer: the plugin loads, lists no
device and logs why; sessions that asked for it fall back to the CPU EP.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

import abi
from abi import sdk
from abi.dtypes import ONNX_TO_NUMPY, to_numpy
from abi.sdk import PluginError
from plugin_cuda import kernel_prefetch
from plugin_cuda.device import algo_cache
from plugin_cuda.options import CudaOptions, OptionError, parse_options
from plugin_cuda.plan import saved as saved_context

EP_NAME = "CUDAExecutionProvider"
NVIDIA_VENDOR_ID = 0x10DE
_log = logging.getLogger("ephost.plugin_cuda")


def probe_devices():
    """(cupy module or None, device names, reason when there are none)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no device
        return None, [], f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver raises CUDARuntimeError
        return None, [], f"no CUDA driver or device ({exc})"
    if count == 0:
        return None, [], "the CUDA driver reports no device"
    names = []
    for i in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"]
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return cupy, names, ""


def create_factories(runtime: sdk.Runtime, registration_name: str, logger) -> list:
    return [CudaFactory(runtime, logger)]


class CudaFactory(sdk.FactoryBase):
    ep_name = EP_NAME
    vendor = "ephost"
    plugin_version = "0.1.0"
    stream_aware = True

    def __init__(self, runtime, logger):
        super().__init__(runtime, logger)
        self.cupy, self.device_names, reason = probe_devices()
        if reason:
            self.api.log(logger, abi.header().constants["EP_LOG_WARNING"],
                         f"{EP_NAME}: no CUDA device available: {reason}")
        self.transfer = None

    def supported_devices(self):
        return [sdk.DeviceSpec(abi.DEVICE_GPU, i, NVIDIA_VENDOR_ID, n, "Cuda")
                for i, n in enumerate(self.device_names)]

    def create_ep(self, devices, options, session_options, logger):
        try:
            # With no device (the host's options check for a deviceless EP), all but device_id is checked.
            opts = parse_options(options, len(self.device_names), check_device=bool(devices))
        except OptionError as exc:
            raise PluginError(str(exc), abi.EP_INVALID_ARGUMENT) from None
        if not devices:
            raise PluginError(f"{EP_NAME}: no CUDA device; the options are valid", abi.EP_NOT_FOUND)
        ep = CudaEp(self.runtime, self, opts, logger)
        algo_cache.set_versions(self.cuda_versions())  # its disk file of algorithm choices
        # ABI v7: plans keep their subgraph (weights included) only for a session that saves contexts.
        ep.saves_contexts = self.api.config_entry(session_options, "ep.context_enable") == "1"
        return ep

    def create_allocator(self, spec):
        return None  # allocators are per EP (per session): see CudaEp.CreateAllocator

    def create_data_transfer(self):
        from plugin_cuda.transfer import CudaDataTransfer

        return CudaDataTransfer(self.runtime, self)

    def create_sync_stream(self, spec):
        return None  # streams are per EP: see CudaEp.CreateSyncStreamForDevice

    def validate_compatibility(self, devices, info):
        """ABI v7 (contexts: plan/saved.py, subgraphs kept in the model): another context format, plugin
        version, ABI, architecture or library version plans again; another EP's string is unsupported."""
        fields = sdk.compatibility_fields(info, EP_NAME)
        if fields is None:
            return sdk.COMPILED_MODEL_UNSUPPORTED
        here = {f"cc={self.compute_capability(d.device_id)}" for d in devices}
        same = (fields.get("format") == str(saved_context.FORMAT) and fields.get("plugin") == self.plugin_version
                and fields.get("abi") == str(self.runtime.compiled_version)
                and f"cc={fields.get('cc')}" in here and fields.get("cuda") == self.cuda_versions())
        return sdk.COMPILED_MODEL_SUPPORTED_OPTIMAL if same else sdk.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION

    def compute_capability(self, device_id: int) -> str:
        return str(self.cupy.cuda.Device(device_id).compute_capability)

    def cuda_versions(self) -> str:
        """CuPy and CUDA runtime versions (plans and NVRTC output depend on them)."""
        cp = self.cupy
        return f"{cp.__version__}/{cp.cuda.runtime.runtimeGetVersion()}"


class StreamState:
    """One CUDA stream the EP computes on, with its cuBLAS handle."""

    def __init__(self, ep: CudaEp, stream, owned: bool):
        self.ep = ep
        self.stream = stream
        self.owned = owned
        self.ptr = int(stream.ptr)
        self._cublas = None
        self._cudnn = False  # False: not asked yet; None: cuDNN is not available
        self._event = None

    def after_default_stream(self) -> None:
        """Order this stream after work queued on CuPy's default stream (how callers usually fill
        bound device buffers): without it a non-blocking stream may read them before they are
        written. Skipped for a caller's own stream, where the caller orders its work."""
        if not self.owned:
            return
        rt = self.ep.cupy.cuda.runtime
        # The steady state: nothing left on the default stream, so no event and no cross-stream
        # wait (which also delays the graph's start on the GPU). 0 is cudaSuccess: all its work is done.
        if rt.streamQuery(0) == 0:
            return
        if self._event is None:
            self._event = self.ep.cupy.cuda.Event(disable_timing=True)
        # Raw runtime calls: Event.record/Stream.wait_event cost µs of Python each on the replay path.
        rt.eventRecord(self._event.ptr, 0)
        rt.streamWaitEvent(self.ptr, self._event.ptr, 0)

    @property
    def cublas(self):
        if self._cublas is None:
            with self.ep.using_memory():
                self._cublas = self.ep.take_cublas(self.ptr)
        return self._cublas

    @property
    def cudnn(self):
        """This stream's cuDNN handle (device/cudnn.py), None when cuDNN cannot be loaded."""
        if self._cudnn is False:
            self._cudnn = self.ep.cudnn_handles.take(self.ptr)
        return self._cudnn

    def close(self) -> None:
        """The stream's work is done (its thread ended, or the EP closes): its cuBLAS handle goes
        back to the EP for the next stream. Destroying it here would synchronise the device,
        which invalidates a capture another thread may have under way."""
        if self._cudnn:
            handle, self._cudnn = self._cudnn, False
            self.ep.cudnn_handles.give_back(handle)  # unbound from the stream at the next take
        if self._cublas is not None:
            handle, self._cublas = self._cublas, None
            try:
                self.stream.synchronize()  # no GEMM of ours still reads the handle's workspace
                handle.release_workspace()
            except Exception:  # noqa: BLE001 - a broken stream: its handle is not reused
                handle.close()
                return
            self.ep.give_back_cublas(handle)


class CudaEp(sdk.EpBase):
    name = EP_NAME

    def __init__(self, runtime, factory: CudaFactory, opts: CudaOptions, logger):
        super().__init__(runtime, factory)
        from plugin_cuda.device.memory import DeviceMemory
        from plugin_cuda.graphs import GraphManager

        self.cupy = cp = factory.cupy
        self.opts = opts
        self.logger = logger
        self.device_id = opts.device_id
        self.device = cp.cuda.Device(opts.device_id)
        self.memory = DeviceMemory(cp, self.ffi, opts, opts.device_id)
        self.streams: dict[int, StreamState] = {}
        self.blocks: dict[int, object] = {}
        self.stats = {"copies_default_stream": 0, "copies_compute_stream": 0, "copies_captured": 0, "tagged_scratch": 0,
                      "untagged_scratch": 0, "capture_allocations": 0}
        self._views: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.unified = None
        if opts.unified_stream:
            with self.device:
                stream = (cp.cuda.ExternalStream(opts.user_compute_stream, opts.device_id)
                          if opts.has_user_compute_stream else cp.cuda.Stream(non_blocking=True))
            self.unified = StreamState(self, stream, owned=not opts.has_user_compute_stream)
            self.streams[self.unified.ptr] = self.unified
        self._spare_cublas: list = []  # handles of released streams, for the next streams
        self._first: StreamState | None = None  # made at creation for the first run (first_stream)
        self._first_taken = False  # the host has asked for its first stream
        from plugin_cuda.device.cudnn import HandlePool

        self.cudnn_handles = HandlePool(opts.use_tf32, opts.cudnn_conv_algo_search)
        self._closed = False
        self.graphs = GraphManager(self)
        self.run_streams = threading.local()  # .state: the stream this thread's run computed on
        self.warm_recipes: dict = {}  # per-node warm-ups done, for a saved context (kernel_prefetch.py)
        self.warm_payloads: dict = {}  # CuPy's compiled kernels for them (cupy_cache.py)
        self.prefetch = kernel_prefetch.Prefetch(self)
        self._set_alloc, self._get_alloc = _thread_allocator_functions(cp)

    # -- cuBLAS handles ----------------------------------------------------------------------
    def take_cublas(self, stream_ptr: int):
        """A cuBLAS handle bound to `stream_ptr`: a released stream's handle when one is spare,
        else a new one. Handles are not thread-safe; each is bound to one stream at a time."""
        from plugin_cuda.device.cublas import CublasHandle

        with self._lock:
            handle = self._spare_cublas.pop() if self._spare_cublas else None
        if handle is None:
            return CublasHandle(stream_ptr, use_tf32=self.opts.use_tf32)
        handle.set_stream(stream_ptr)
        return handle

    def give_back_cublas(self, handle) -> None:
        with self._lock:
            if not self._closed:
                self._spare_cublas.append(handle)
                return
        handle.close()

    # -- memory ------------------------------------------------------------------------------
    def using_memory(self):
        return self.cupy.cuda.using_allocator(self.memory.allocator)

    def alloc_block(self, size: int, stream_state: StreamState | None) -> int:
        stream = stream_state.stream if stream_state is not None else self.cupy.cuda.Stream.null
        # The pool picks its per-stream arena from the current stream; the device context is
        # entered only when needed (entering it costs a driver query per allocation).
        if self.cupy.cuda.runtime.getDevice() == self.device_id:
            with stream:
                mem = self.memory.malloc(max(size, 1), self.graphs.malloc())
        else:
            with self.device, stream:
                mem = self.memory.malloc(max(size, 1), self.graphs.malloc())
        ptr = int(mem.ptr)
        self.blocks[ptr] = mem  # dict updates are atomic under the GIL
        return ptr

    def free_block(self, ptr: int) -> None:
        mem = self.blocks.pop(ptr, None)
        if mem is None:
            return
        if len(self._views) > 4096:
            self._views.clear()
        del mem  # back to its pool, ordered on the stream it was allocated on

    def view(self, ptr: int, shape: tuple, dtype):
        """A CuPy array over device memory the host handed us (cached: building one costs µs)."""
        key = (ptr, shape, dtype)
        arr = self._views.get(key)
        if arr is None:
            cp = self.cupy
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            mem = cp.cuda.UnownedMemory(ptr, max(nbytes, 1), None, self.device_id)
            arr = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))
            self._views[key] = arr
        return arr

    # -- streams -----------------------------------------------------------------------------
    def first_stream(self) -> StreamState | None:
        """The stream the session's first run computes on (the host asks for it at that run), made
        now so that compiled plans can do their per-stream work at session creation (plan/warmup.py);
        None once the host has it (a run has started: nothing is made ahead any more)."""
        if self.unified is not None:
            return self.unified
        with self._lock:
            if self._first_taken:
                return None
            if self._first is None:
                self._first = self._new_stream()
            return self._first

    def _new_stream(self) -> StreamState:
        with self.device:
            state = StreamState(self, self.cupy.cuda.Stream(non_blocking=True), owned=True)
        self.streams[state.ptr] = state
        return state

    def CreateSyncStreamForDevice(self, info, out):
        if self.unified is not None:
            state = self.unified
        else:
            with self._lock:
                state, self._first, self._first_taken = self._first, None, True
            if state is None:
                state = self._new_stream()
        out[0] = self.runtime.expose("EpSyncStream", CudaSyncStream(self.runtime, self, state))

    def forget_stream(self, state: StreamState) -> None:
        """Drop what plans and graphs keep for a stream about to be destroyed (its thread ended):
        CUDA reuses a destroyed stream's address, and the next stream at that address must not
        find a dead stream's cuBLAS handle, arena or graphs."""
        for fn in self.__dict__.get("plan_functions", ()):
            fn.forget_stream(state.ptr)
        self.graphs.forget_state(state)

    def stream_state(self, handle) -> StreamState | None:
        return self.streams.get(int(self.ffi.cast("uintptr_t", handle)))

    def CreateAllocator(self, info, out):
        out[0] = self.runtime.expose("EpAllocator", CudaAllocator(self.runtime, self, self.factory._spec(info)))

    # -- capability and kernels -----------------------------------------------------------------
    def claim(self, graph):
        from plugin_cuda import kernels
        from plugin_cuda.plan.partition import host_shape_values

        shape_values = host_shape_values(graph)
        chosen = []
        for node in graph.nodes:
            if node.domain not in ("", "ai.onnx", kernels.EPHOST_DOMAIN, kernels.MS_DOMAIN):
                continue
            outputs = [v for v in node.outputs if v >= 0]
            if outputs and all(v in shape_values for v in outputs):
                continue  # shape arithmetic stays on the host (ALLOW_CPU_FOR_SHAPES)
            dtypes = [graph.values[v].elem_type or None if v >= 0 else None for v in node.inputs]
            count = max((i + 1 for i, v in enumerate(node.outputs) if v >= 0), default=0)
            if not kernels.claimable(node.op_type, node.attrs, dtypes, node.opset, domain=node.domain,
                                     num_outputs=count):
                continue
            # Shapes and axes are read on the host: claim the node only when they are constants
            # or values the host computes and hands over in host memory (VALUE_HOST_COMPUTED, its
            # shape program); the kernel then reads NumPy arrays (a device read would synchronise).
            host_inputs = kernels.lookup(node.op_type, node.opset, node.domain).host_inputs
            if all(i >= len(node.inputs) or node.inputs[i] < 0 or graph.values[node.inputs[i]].constant is not None
                   or graph.values[node.inputs[i]].host_computed for i in host_inputs):
                chosen.append(node.index)
        return chosen

    def create_kernel(self, graph, node):
        return CudaKernelAdapter(self.runtime, self, graph, node)

    # -- compiled partitions (ABI v6): plugin_cuda/plan ------------------------------------------------
    def claim_fused(self, graph):
        """Connected nodes a compiled plan can run (float32; static shapes, or symbolic ones with
        plan_dynamic_shapes: a plan per input-shape signature), grouped without cycles."""
        if not self.opts.compiled_plan:
            return []
        from plugin_cuda.plan.partition import fusable_groups, host_shape_values

        shape_values = host_shape_values(graph)

        def accept(node):  # shape arithmetic stays on the host (ALLOW_CPU_FOR_SHAPES)
            outs = [v for v in node.outputs if v >= 0]
            return not (outs and all(v in shape_values for v in outs))

        return fusable_groups(graph, accept, dynamic=self.opts.plan_dynamic_shapes)

    def compile(self, fused):
        """One plan per fused graph (plugin_cuda/plan/compute.py), or one per input-shape signature
        where the graph's inputs have symbolic dims; closed with the EP."""
        from plugin_cuda.plan.compute import make_function

        functions = [make_function(self, fg) for fg in fused]
        self.__dict__.setdefault("plan_functions", []).extend(functions)
        for fn in functions:  # the host learns plan sizes through its logger, never from our objects
            d = fn.describe()
            if d.get("dynamic"):
                self.api.log(self.logger, 1, f"compiled partition '{fn.name}': {d['nodes']} nodes with symbolic "
                                             "dims, planned per input-shape signature at run time")
                continue
            self.api.log(self.logger, 1, f"compiled partition '{fn.name}': {d['nodes']} nodes -> {d['kernels']} "
                                         f"kernels + {d['cublas']} cuBLAS calls, arena {d['arena_bytes']} bytes, "
                                         f"built in {d['build_seconds'] * 1e3:.0f} ms")
        return functions

    # -- saved contexts (ABI v7) -----------------------------------------------------------------------
    def compile_from_context(self, fused, blob):
        """A saved context's partition, planned without NVRTC or searches (plan/compute.py)."""
        from plugin_cuda.plan.compute import subgraph_from_context

        return self.compile([sdk.FusedGraph(fused.name, subgraph_from_context(self, fused.name, blob))])[0]

    def compatibility_info(self):
        f = self.factory
        return sdk.compatibility_string(EP_NAME, plugin=f.plugin_version, abi=self.runtime.compiled_version,
                                        format=saved_context.FORMAT, cc=f.compute_capability(self.device_id),
                                        cuda=f.cuda_versions())

    # -- v2 ------------------------------------------------------------------------------------------
    def Sync(self):
        self.prefetch.join()  # a context's per-node kernels compiled too (kernel_prefetch.py)
        with self.device:
            self.cupy.cuda.runtime.deviceSynchronize()

    def IsConcurrentRunSupported(self, supported):
        # Seed 000: only with stream-tagged scratch (host >= v4) and a stream per thread.
        ok = self.api.has("KernelContext_GetSyncStream") and not self.opts.unified_stream
        if not self.api.has("KernelContext_GetSyncStream"):
            self.runtime.record.fallbacks["no_concurrent_run_claim"] += 1
        supported[0] = int(ok)

    # -- runs and graphs (v3..v5) ----------------------------------------------------------------------
    def OnRunStart(self, run_options):
        self.prefetch.join()  # a context's per-node kernels compiled before run 1 (kernel_prefetch.py)
        self.graphs.on_run_start(self.run_options(run_options))

    def OnRunEnd(self, run_options, sync_stream):
        launched = self.graphs.on_run_end()
        state = self.run_streams.__dict__.get("state") or launched
        self.leave_run()
        if sync_stream:
            # Outputs left in device memory are ready when run() returns, unless the caller
            # asked otherwise (disable_synchronize_execution_providers): one synchronisation per
            # stream the run used (a capture run's graph launch included).
            for s in {id(x): x for x in (state, launched) if x is not None}.values():
                s.stream.synchronize()

    def enter_run(self, state: StreamState) -> None:
        """Make the run's allocator current on this thread until OnRunEnd (the host runs nothing
        but kernels on this thread in between, and switching it per kernel costs µs), and order
        the run's stream after the caller's work on CuPy's default stream."""
        run = self.run_streams
        if run.__dict__.get("state") is not None:
            self.leave_run()
        run.prev_alloc = self._get_alloc() if self._get_alloc is not None else None
        state.after_default_stream()
        if self._set_alloc is not None:
            self._set_alloc(self.graphs.malloc())
        else:
            run.alloc_ctx = self.using_memory()
            run.alloc_ctx.__enter__()
        run.state = state

    def leave_run(self) -> None:
        run = self.run_streams
        if run.__dict__.get("state") is None:
            return
        run.state = None
        if self._set_alloc is not None:
            self._set_alloc(run.prev_alloc)
        else:
            run.alloc_ctx.__exit__(None, None, None)

    def IsGraphCaptureEnabled(self):
        return int(self.opts.enable_cuda_graph)

    def IsGraphCaptured(self, graph_id):
        return int(self.graphs.captured(graph_id))

    def GetGraphCaptureNodeAssignmentPolicy(self):
        return abi.GRAPH_ALLOW_CPU_FOR_SHAPES

    def ReplayGraph(self, graph_id):
        self.graphs.replay(graph_id, sync=False)

    def ReleaseCapturedGraph(self, graph_id):
        self.graphs.release(graph_id)

    def ReplayGraphWithSync(self, graph_id, sync):
        self.graphs.replay(graph_id, sync=bool(sync))

    def close(self):
        self.prefetch.join()  # its thread uses the streams and memory closed below
        for fn in self.__dict__.pop("plan_functions", ()):
            fn.close()  # plans hold arenas from self.memory: release them first
        self.graphs.close()
        self._views.clear()
        for s in list(self.streams.values()):
            s.close()
        self.streams.clear()
        self._first = None  # closed above with the others when no run took it
        with self._lock:
            self._closed = True
            spare, self._spare_cublas = self._spare_cublas, []
        for handle in spare:
            handle.close()
        self.cudnn_handles.close()
        self.blocks.clear()
        self.memory.close()


def _thread_allocator_functions(cp):
    """CuPy's thread-local allocator setter/getter (what `using_allocator` uses), or None."""
    mem = cp.cuda.memory
    setter = getattr(mem, "_set_thread_local_allocator", None)
    getter = getattr(mem, "_get_thread_local_allocator", None)
    return setter, getter


class KernelCall:
    """What a kernel of plugin_cuda.kernels sees during compute (see kernels/base.py)."""

    __slots__ = ("inputs", "num_outputs", "cublas", "cudnn", "_adapter", "_context", "_state", "_outs")

    def wants(self, index: int) -> bool:
        """Whether the node has output `index` (an optional output left out has an empty name)."""
        present = self._adapter.present
        return index < len(present) and present[index]

    def __init__(self, adapter, context, inputs, state: StreamState, num_outputs: int = 1):
        self._outs = {}
        self.num_outputs = num_outputs
        self.inputs = inputs
        self._adapter = adapter
        self._context = context
        self._state = state
        self.cublas = state.cublas if adapter.needs_cublas else None
        self.cudnn = state.cudnn if adapter.needs_cudnn else None

    def output(self, index: int, shape, dtype):
        # Memoised: a kernel re-run after a failed capture must write to the same buffers.
        arr = self._outs.get(index)
        if arr is None:
            arr = self._outs[index] = self._adapter.output(self._context, index, tuple(int(d) for d in shape),
                                                           np.dtype(dtype))
        return arr

    def scratch(self, nbytes: int):
        return self._adapter.scratch(self._context, nbytes, self._state)


class CudaKernelAdapter(sdk.KernelBase):
    def __init__(self, runtime, ep: CudaEp, graph, node):
        super().__init__(runtime, ep)
        from plugin_cuda import kernels

        self.ep = ep
        self.node = node
        cls = kernels.lookup(node.op_type, node.opset, node.domain)
        self.kernel = cls(node.attrs, node.opset, node.name)
        self.kernel.options = ep.opts  # kernels with a choice read it (Attention: attention_kernel)
        self.needs_cublas = cls.needs_cublas
        self.needs_cudnn = cls.needs_cudnn
        self.constants = {i: graph.values[v].constant for i, v in enumerate(node.inputs)
                          if v >= 0 and i in cls.host_inputs}
        self.dtypes = [to_numpy(graph.values[v].elem_type) if v >= 0 and graph.values[v].elem_type else None
                       for v in node.outputs]
        self.present = tuple(v >= 0 for v in node.outputs)
        self._io = threading.local()
        self._get_io, self._get_output = self.api.get_io, self.api.get_output
        from plugin_cuda import kernel_warmup

        kernel_warmup.warm_up(ep, graph, node, self)  # its CuPy code compiled now, not in run 1 (issue 29)

    def _read_inputs(self, kio) -> list:
        ffi, ep = self.ffi, self.ep
        out = []
        for i in range(kio.num_inputs):
            const = self.constants.get(i)
            if const is not None:
                out.append(const)
                continue
            t = kio.inputs[i]
            ndim = t.ndim
            if ndim < 0 and t.data == ffi.NULL:
                out.append(None)
                continue
            shape = tuple(t.shape[0:ndim]) if ndim else ()
            dtype = ONNX_TO_NUMPY[t.elem_type]
            if t.device_type == abi.DEVICE_CPU:
                out.append(np.frombuffer(ffi.buffer(t.data, t.nbytes), dtype).reshape(shape))
            else:
                out.append(ep.view(int(ffi.cast("uintptr_t", t.data)), shape, dtype))
        return out

    def Compute(self, context):
        ffi, ep = self.ffi, self.ep
        io = ffi.new("const EpKernelIO**")
        self.api.check(self._get_io(context, io))
        kio = io[0]
        state = ep.stream_state(kio.gpu_compute_stream) if kio.gpu_compute_stream != ffi.NULL else None
        if state is None:
            raise PluginError(f"node '{self.node.name}': the host gave no CUDA stream of this EP")
        inputs = self._read_inputs(kio)
        if ep.run_streams.__dict__.get("state") is not state:
            ep.enter_run(state)
        call = KernelCall(self, context, inputs, state, kio.num_outputs)
        try:
            ep.graphs.before_kernel(state)  # may begin a capture (and fail it, when debugging)
            self.launch_recorded(call, state)
        except Exception as exc:
            if not ep.graphs.capturing():
                raise
            ep.graphs.abort_capture(exc)  # re-runs the kernels recorded so far, eagerly
            self.launch_recorded(call, state)
            return
        ep.graphs.record(self, call, state)

    def launch_recorded(self, call: KernelCall, state: StreamState) -> None:
        # The allocator is current for the whole run (CudaEp.enter_run); the stream is entered
        # per kernel: measured on CuPy 14, making it current once per run with Stream.use() gave
        # wrong results under capture and on an ExternalStream, while this form is exact.
        with state.stream:
            self.kernel.compute(call)

    def output(self, context, index: int, shape: tuple, dtype):
        declared = self.dtypes[index] if index < len(self.dtypes) else None
        if declared is not None and dtype != declared:  # the host allocated the declared type's bytes
            raise PluginError(f"node '{self.node.name}' ({self.node.op_type}): the kernel writes output {index} as "
                              f"{dtype}; the graph declares {declared}")
        ffi = self.ffi
        out = ffi.new("EpTensor**")
        self.api.check(self._get_output(context, index, ffi.new("int64_t[]", shape or (0,)), len(shape), out))
        t = out[0]
        return self.ep.view(int(ffi.cast("uintptr_t", t.data)), shape, dtype)

    def scratch(self, context, nbytes: int, state: StreamState):
        """Temporary memory tagged with the framework stream (seed 000), untagged on old hosts."""
        framework = self.api.sync_stream(context)
        ep = self.ep
        if framework is None:
            ep.stats["untagged_scratch"] += 1
            with ep.device, ep.cupy.cuda.Stream.null:
                return ep.memory.malloc(nbytes, ep.graphs.malloc())
        owner = self.runtime.obj(framework)
        tagged = owner.state if isinstance(owner, CudaSyncStream) else state
        ep.stats["tagged_scratch"] += 1
        with ep.device, tagged.stream:
            return ep.memory.malloc(nbytes, ep.graphs.malloc())


class CudaAllocator(sdk.AllocatorBase):
    """The EP's device allocator: blocks from its DeviceMemory, tagged with a stream when given."""

    def __init__(self, runtime, ep: CudaEp, spec):
        super().__init__(runtime, ep.factory, spec)
        self.ep = ep

    def alloc(self, size: int, stream) -> int:
        state = None
        if stream is not None:
            owner = self.runtime.obj(stream)
            state = owner.state if isinstance(owner, CudaSyncStream) else None
        return self.ep.alloc_block(size, state)

    def free(self, ptr: int) -> None:
        self.ep.free_block(ptr)


class CudaSyncStream(sdk.SyncStreamBase):
    def __init__(self, runtime, ep: CudaEp, state: StreamState):
        super().__init__(runtime, ep)
        self.ep = ep
        self.state = state

    def handle(self) -> int:
        return self.state.ptr

    def create_notification(self):
        return CudaNotification(self.runtime, self)

    def close(self):
        if self.state.owned and self.state is not self.ep.unified:
            self.ep.forget_stream(self.state)
            self.ep.streams.pop(self.state.ptr, None)
            self.state.close()
            # The pool keeps freed blocks per stream: a released stream's would never be reused.
            self.ep.memory.free_stream_blocks(self.state.stream)


class CudaNotification(sdk.NotificationBase):
    def __init__(self, runtime, stream: CudaSyncStream):
        super().__init__(runtime, stream)
        self.stream = stream
        self.event = None

    def Activate(self):
        cp = self.stream.ep.cupy
        self.event = cp.cuda.Event(disable_timing=True)
        self.event.record(self.stream.state.stream)

    def WaitOnDevice(self, consumer):
        owner = self.runtime.obj(consumer)
        if isinstance(owner, CudaSyncStream) and self.event is not None:
            owner.state.stream.wait_event(self.event)
        elif self.event is not None:
            self.event.synchronize()

    def WaitOnHost(self):
        if self.event is not None:
            self.event.synchronize()
