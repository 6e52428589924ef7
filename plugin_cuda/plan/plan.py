"""The compiled plan: built once per fused partition, then `run()` only walks prepacked launches.

Build (once): lower the partition (lower.py), fuse it into steps (fuse.py), generate one CUDA
module for its kernels (codegen.py), compile or load it through the source-hash cache
(device/nvrtc.py), upload the constants once, and plan intermediate memory by liveness
(memory_plan.py).

Per stream, on the first run there (an `_Instance`): one arena of `arena_bytes` from the EP's
stream-ordered pool, and every launch packed once: the CUfunction, grid, block and an argument
array whose cells hold device addresses. Cells of arena buffers and constants never change; the
cells of the partition's inputs and outputs are one array written at the top of each run. So a
run is: write those cells, then `cuLaunchKernel(*prepacked)` per kernel and prepacked cuBLAS
calls. No allocation, no CuPy call, no shape logic on that path. The same launches are what a
graph capture records.

`auto_graph`: with static shapes the plan captures its own launches after `warmup` eager runs on
a stream and from then on replays that graph under plain run() calls, keeping run()'s contract:
inputs are copied into the graph's staging buffers at call time and results copied out to the
caller's (fresh) output buffers, all ordered on the stream.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from plugin_cuda.device import capture, cublas, cublaslt, driver, nvrtc
from plugin_cuda.device.streams import NoScope, stream_scope
from plugin_cuda.kernels import flash_attention
from plugin_cuda.plan import codegen, cudnn_step
from plugin_cuda.plan.errors import DriverError, PlanError
from plugin_cuda.plan.fuse import build_steps
from plugin_cuda.plan.lower import lower
from plugin_cuda.plan.memory_plan import BufferRequest, align_up, lifetimes, plan_memory

ALIGN = 256


class Plan:
    """A partition compiled into prepacked launches; see the module docstring."""

    def __init__(self):
        self.closed = False
        self._instances: dict = {}
        # Reentrant: an instance is made under it and asks epilogue_gemm, which takes it too.
        self._lock = threading.RLock()
        self.stats = {"allocations": 0, "allocated_bytes": 0, "runs": 0, "replays": 0, "captures": 0}
        # cuBLASLt epilogue GEMMs by (variant, step): their algorithm is chosen once per plan, not
        # per stream, so every stream (thread) of a session computes with the same kernels.
        self._lt_gemms: dict = {}

    # -- build -------------------------------------------------------------------------------------
    @classmethod
    def build(cls, graph, ep=None, *, inputs=None, outputs=None, cupy=None, device_id: int | None = None,
              use_tf32: bool | None = None, auto_graph: bool = False, warmup: int = 2,
              capture: bool | None = None, constants=None) -> Plan:
        """Compile `graph` (a GraphSpec; `inputs`/`outputs` name the partition's values when the
        graph does not carry them). `ep`: the CudaEp whose memory, device and cuBLAS handles to use
        (None: CuPy's defaults, for tests and benchmarks).

        `capture` says which variant every run uses, so that one input gives one result on every
        run: True (the plan's launches will be captured: auto_graph, or the host's CUDA graphs) the
        graph variant only, False the eager variant only; None (direct use: tests, benchmarks)
        keeps both, eager runs computing with the eager one and captures recording the graph one.
        The two compute the same function with different GEMM kernels, so their results differ in
        rounding (TF32 cuBLAS against float32 generated kernels).

        `constants`: a signatures.ConstantStore holding the device copies of constants shared with
        other plans of the same partition (its per-shape plans); None: the plan uploads its own."""
        t0 = time.perf_counter()
        self = cls()
        self.ep = ep
        self._store = constants
        cp = cupy if cupy is not None else (ep.cupy if ep is not None else _import_cupy())
        self.cupy = cp
        self.device_id = int(device_id if device_id is not None else (ep.device_id if ep is not None else
                                                                         cp.cuda.runtime.getDevice()))
        self.use_tf32 = bool(use_tf32 if use_tf32 is not None else (ep.opts.use_tf32 if ep is not None else True))
        self.auto_graph = bool(auto_graph)
        self.warmup = max(1, int(warmup))
        self.num_nodes = len(graph.nodes)
        choice = ep.opts.attention_kernel if ep is not None else flash_attention.plan_choice()
        with flash_attention.kernel_choice(choice, self.use_tf32):  # the Attention lowering reads them
            self.prog = prog = lower(graph, inputs, outputs)
        # Two ways to run: eager (mid-size GEMMs as generated kernels: fewest launches) and graph
        # (those GEMMs on cuBLAS: fastest kernels, launches being free in a graph). Often the same.
        if auto_graph or prog.symbols:
            # A plan with symbolic sizes runs its GEMMs on cuBLAS (m, n, k per call) whatever the
            # size: generated GEMV / tiled GEMMs are chosen by size, so the module would change with
            # the shape and be compiled again (plan/symint.py).
            capture = True
        eager_tiled, graph_tiled = capture is not True, capture is False
        eager_steps = build_steps(prog, tiled=eager_tiled, k_major=self.use_tf32)
        seen: dict = {}  # kernel bodies of the module: a graph step's kernel may be an eager one's
        source, eager_specs = codegen.generate(prog, eager_steps, "ep_k", seen=seen)
        if graph_tiled == eager_tiled:
            # One variant (every symbolic plan, auto_graph, any set `capture`): steps and source made once,
            # which halves the host time of a new input-shape signature's plan spent here.
            graph_steps, graph_source = eager_steps, source
        else:
            graph_steps = build_steps(prog, tiled=graph_tiled, k_major=self.use_tf32)
            graph_source, graph_specs = codegen.generate(prog, graph_steps, "ep_k")
        self._resolve_locations()
        self.eager = _Variant("eager", eager_steps, eager_specs)
        if graph_source == source:
            self.graph = self.eager
        else:
            graph_source, graph_specs = codegen.generate(prog, graph_steps, "ep_g", prelude=False, seen=seen)
            source += graph_source
            self.graph = _Variant("graph", graph_steps, graph_specs)
        self.steps, self.specs = eager_steps, eager_specs
        self.source = nvrtc.PROBE + source
        hits = nvrtc.stats["hits"]
        self.module = nvrtc.load(cp, self.source, self.device_id, probe="ep_probe")
        self.cache_hit = nvrtc.stats["hits"] > hits
        # The values of the symbols S0, S1, ... (plan/symint.py): the first arguments of every kernel.
        self._symbol_cells = [driver.ffi.new("int*", int(s)) for s in prog.symbols]
        self.input_shapes = [prog.values[v].shape for v in prog.inputs]
        self.output_shapes = [prog.values[v].shape for v in prog.outputs]
        self.input_names = [prog.values[v].name for v in prog.inputs]
        self.output_names = [prog.values[v].name for v in prog.outputs]
        self._upload_constants()
        for variant in {id(v): v for v in (self.eager, self.graph)}.values():
            variant.memory = self._plan_memory(variant.steps)
        self.arena_bytes = max(self.eager.memory.arena_bytes, self.graph.memory.arena_bytes)
        self.naive_bytes = self.eager.memory.naive_bytes
        self.build_seconds = time.perf_counter() - t0
        return self

    @property
    def num_kernels(self) -> int:
        """Generated kernel launches per run."""
        return sum(1 for s in self.specs if s is not None)

    @property
    def num_cublas(self) -> int:
        """cuBLAS GEMM steps per run."""
        return sum(1 for s in self.specs if s is None)

    def _base(self, vid: int) -> int:
        while vid in self._alias:
            vid = self._alias[vid]
        return vid

    def _resolve_locations(self) -> None:
        prog = self.prog
        self._alias = {op.outputs[0]: op.inputs[0] for op in prog.ops if op.kind == "alias"}
        self._in_index = {v: i for i, v in enumerate(prog.inputs)}
        self._out_index = {v: i for i, v in enumerate(prog.outputs)}

    def location(self, vid: int, variant) -> tuple:
        """Where a value lives: ('in', i) / ('out', j) of the call, ('const', offset), ('arena', offset)."""
        base = self._base(vid)
        if base in self._in_index:
            return ("in", self._in_index[base])
        if base in self._out_index:
            return ("out", self._out_index[base])
        if self.prog.values[base].const is not None:
            return ("const", self._const_offsets[base])
        return ("arena", variant.memory.offset(base))

    def _used_values(self) -> list:
        used = []
        for variant in (self.eager, self.graph):
            for step, spec in zip(variant.steps, variant.specs):
                used.extend(spec.params if spec is not None else step.reads + step.writes)
        return used

    def _upload_constants(self) -> None:
        if self._store is not None:
            self._shared_constants()
            return
        consts, offsets, top = [], {}, 0
        for vid in self._used_values():
            base = self._base(vid)
            c = self.prog.values[base].const
            if c is None or base in offsets or base in self._in_index:
                continue
            offsets[base] = top
            arr = self._const_array(base)
            consts.append((top, arr))
            top += align_up(max(arr.nbytes, 1), ALIGN)
        self._const_offsets = offsets
        self.const_bytes = top
        self._const_mem = None
        if not top:
            self._const_base = 0
            return
        cp = self.cupy
        with cp.cuda.Device(self.device_id):
            self._const_mem = self._malloc(top, None)
            # Each constant straight from its array (a context's are views of its bytes): no host
            # staging buffer of the whole size to fill first (issue 29: 100s of MB for a BERT).
            for off, arr in consts:
                if arr.nbytes:
                    (self._const_mem + off).copy_from_host(arr.ctypes.data, arr.nbytes)
            cp.cuda.runtime.deviceSynchronize()  # the upload is done before any stream reads it
        self._const_base = int(self._const_mem.ptr)

    def _const_array(self, vid: int) -> np.ndarray:
        """A constant's bytes as the kernels read them: contiguous, in its value's type."""
        v = self.prog.values[vid]
        return np.ascontiguousarray(np.asarray(v.const).astype(v.dtype, copy=False))

    def _shared_constants(self) -> None:
        """Constants from the shared store: a location's offset is then the address itself."""
        bases = []
        for vid in self._used_values():
            base = self._base(vid)
            if self.prog.values[base].const is not None and base not in self._in_index and base not in bases:
                bases.append(base)
        items = [(self.prog.values[b].name, self._const_array(b)) for b in bases]
        with self.cupy.cuda.Device(self.device_id):
            addresses = self._store.addresses(items, ALIGN)
        self._const_offsets = dict(zip(bases, addresses))
        self._const_base = 0
        self._const_mem = None
        self.const_bytes = 0

    def _plan_memory(self, steps):
        prog = self.prog
        arena_values = set()
        rows = []
        for step in steps:
            reads = [self._base(v) for v in step.reads]
            writes = [self._base(v) for v in step.writes]
            rows.append((reads, writes))
            for v in reads + writes:
                if v not in self._in_index and v not in self._out_index and prog.values[v].const is None:
                    arena_values.add(v)
        spans = lifetimes([([v for v in r if v in arena_values], [v for v in w if v in arena_values])
                           for r, w in rows])
        requests = [BufferRequest(v, prog.values[v].nbytes, *spans[v]) for v in sorted(arena_values)]
        return plan_memory(requests, ALIGN)

    def _malloc(self, nbytes: int, stream_ptr: int | None):
        """Device memory from the EP's pool (stream-ordered when a stream is given) or CuPy's."""
        self.stats["allocations"] += 1
        self.stats["allocated_bytes"] += nbytes
        cp = self.cupy
        with cp.cuda.Device(self.device_id):
            scope = stream_scope(stream_ptr) if stream_ptr is not None else NoScope()
            with scope:
                if self.ep is not None:
                    return self.ep.memory.malloc(max(nbytes, 1))
                return cp.cuda.alloc(max(nbytes, 1))

    # -- run ---------------------------------------------------------------------------------------------
    def run(self, stream: int, input_ptrs, output_ptrs, capturing: bool = False) -> None:
        """Enqueue the plan on `stream` reading `input_ptrs` and writing `output_ptrs` (device addresses
        in the partition's input / output order). `capturing`: a caller's capture is recording this
        run (then the plan does not capture itself)."""
        inst = self._instances.get(stream)
        if inst is None:
            inst = self._instance(stream)
        if inst.graph is not None:
            inst.replay(input_ptrs, output_ptrs)
            return
        inst.set_io(input_ptrs, output_ptrs)
        if capturing:
            inst.graph_warm = True
            inst.rehearse()
        else:
            if not inst.graph_warm:
                # The graph variant runs once eagerly before any capture, so that its cuBLAS calls
                # have run (and loaded their kernels) before they are recorded. The eager variant
                # then overwrites its results: every eager run answers with the same kernels.
                inst.graph_warm = True
                inst.rehearse()
            inst.launch_all(inst.eager_seq)
        if self.auto_graph and not capturing:
            inst.runs += 1
            if inst.runs >= self.warmup:
                inst.capture()

    def warm(self, stream: int, input_ptrs, output_ptrs) -> None:
        """Run 1's lazy work, done ahead (plan/warmup.py): the instance of `stream` (arena, packed
        launches, cuBLAS handle, cuDNN setups and workspaces), then each variant launched once, so
        that CUDA loads the library kernels they call and the cuDNN steps settle their calls. Not a
        run: auto_graph counts only run() calls, and run() finds the graph variant warm already."""
        inst = self._instances.get(stream)
        if inst is None:
            inst = self._instance(stream)
        inst.set_io(input_ptrs, output_ptrs)
        if inst.graph_seq is not inst.eager_seq:
            inst.rehearse()
        inst.graph_warm = True
        inst.launch_all(inst.eager_seq)
        if any(isinstance(step, cudnn_step.CudnnStep) for step in inst.eager_seq):
            inst.launch_all(inst.eager_seq)  # cuDNN steps run their legacy calls first, their graphs from run 2

    def forget_stream(self, stream: int) -> None:
        """Release what the plan keeps for `stream` (its arena, graph and packed launches, which
        hold that stream's cuBLAS handle). The EP calls it before it destroys a stream: CUDA hands
        a destroyed stream's address to the next stream created, and a plan must not run that
        new stream with a dead one's handle."""
        with self._lock:
            inst = self._instances.pop(stream, None)
        if inst is not None:
            inst.close()

    def epilogue_gemm(self, key, make):
        """The cuBLASLt GEMM of `key` (a variant's step), made once by `make()` and shared by
        every stream's instance: the descriptor and algorithm are read-only at call time."""
        gemm = self._lt_gemms.get(key)
        if gemm is None:
            with self._lock:
                gemm = self._lt_gemms.get(key)
                if gemm is None:
                    gemm = self._lt_gemms[key] = make()
        return gemm

    def _instance(self, stream: int):
        if self.closed:
            raise PlanError("plan is closed; build a new one")
        with self._lock:
            inst = self._instances.get(stream)
            if inst is None:
                inst = self._instances[stream] = _Instance(self, stream)
            return inst

    def describe(self) -> dict:
        """Counts and sizes for reports (ephost bench, the benchmarks)."""
        return {"nodes": self.num_nodes, "steps": len(self.steps), "kernels": self.num_kernels,
                "cublas": self.num_cublas, "graph_kernels": sum(1 for s in self.graph.specs if s is not None),
                "graph_cublas": sum(1 for s in self.graph.specs if s is None), "arena_bytes": self.arena_bytes, "naive_bytes": self.naive_bytes,
                "const_bytes": self.const_bytes, "build_seconds": self.build_seconds, "cache_hit": self.cache_hit}

    def close(self) -> None:
        """Release every stream's arena, graph and cuBLAS handle; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for inst in list(self._instances.values()):
            inst.close()
        self._instances.clear()
        for gemm in self._lt_gemms.values():
            gemm.close()
        self._lt_gemms.clear()
        self._const_mem = None

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Variant:
    """One way to run the plan: its steps, their kernels (None: cuBLAS) and its memory plan."""

    def __init__(self, name: str, steps: list, specs: list):
        self.name = name
        self.steps = steps
        self.specs = specs
        self.memory = None


def _import_cupy():
    import cupy

    return cupy


class _Instance:
    """A plan bound to one stream: its arena, its packed launches, its cuBLAS handle."""

    def __init__(self, plan: Plan, stream_ptr: int):
        ffi = driver.ffi
        self.plan = plan
        self.stream_ptr = stream_ptr
        self.stream = driver.stream(stream_ptr)
        self.cu = driver.lib()
        self.runs = 0
        self.graph = None
        self._own_handle = None
        self._stage_mem = None
        n_in, n_out = len(plan.prog.inputs), len(plan.prog.outputs)
        self.n_in, self.n_out = n_in, n_out
        self.ext = ffi.new("unsigned long long[]", max(n_in + n_out, 1))
        self.arena_mem = plan._malloc(plan.arena_bytes, stream_ptr) if plan.arena_bytes else None
        self.arena = int(self.arena_mem.ptr) if self.arena_mem is not None else 0
        self._keep = []
        self._handle = None
        self.eager_seq = self._pack(plan.eager)
        self.graph_seq = self.eager_seq if plan.graph is plan.eager else self._pack(plan.graph)
        self.graph_warm = plan.graph is plan.eager
        # True while the graph variant runs for a capture or its rehearsal: cuDNN steps then make the
        # calls whose kernels a replay runs fastest (cudnn_step.py).
        self.recording = False
        self._variant_of = {id(self.eager_seq): plan.eager, id(self.graph_seq): plan.graph}

    def _pack(self, variant) -> list:
        seq = []
        for step, spec in zip(variant.steps, variant.specs):
            if spec is not None:
                seq.append(self._pack_kernel(spec, variant))
            elif step.kind == cudnn_step.KIND:
                seq.append(cudnn_step.CudnnStep(self, step, variant))
            else:
                if self._handle is None:
                    self._handle = self._cublas_handle()
                seq.append(_CublasStep(self, step, self._handle, variant))
        return seq

    def address(self, vid: int, variant) -> tuple:
        """(ext index or None, fixed address)."""
        kind, where = self.plan.location(vid, variant)
        if kind == "in":
            return where, 0
        if kind == "out":
            return self.n_in + where, 0
        if kind == "const":
            return None, self.plan._const_base + where
        return None, self.arena + where

    def _pack_kernel(self, spec, variant) -> tuple:
        ffi = driver.ffi
        cells = list(self.plan._symbol_cells)
        for vid in spec.params:
            j, addr = self.address(vid, variant)
            if j is not None:
                cells.append(self.ext + j)
            else:
                cell = ffi.new("unsigned long long*", addr)
                self._keep.append(cell)
                cells.append(cell)
        args = ffi.new("void*[]", cells)
        self._keep.append(args)
        fn = driver.function(self.plan.module.function(spec.name))
        return (fn, *spec.grid, *spec.block, 0, self.stream, args, driver.NULL)

    def _cublas_handle(self):
        ep = self.plan.ep
        if ep is not None:
            state = ep.streams.get(self.stream_ptr)
            if state is not None:
                return state.cublas
        with self.plan.cupy.cuda.Device(self.plan.device_id):
            self._own_handle = cublas.CublasHandle(self.stream_ptr, use_tf32=self.plan.use_tf32)
        return self._own_handle

    def set_io(self, input_ptrs, output_ptrs) -> None:
        n_in = self.n_in
        ext = self.ext
        if len(input_ptrs) != n_in or len(output_ptrs) != self.n_out:
            raise PlanError(f"plan run got {len(input_ptrs)} inputs and {len(output_ptrs)} outputs; "
                            f"the plan has {n_in} inputs ({', '.join(self.plan.input_names)}) and "
                            f"{len(self.plan.output_names)} outputs")
        ext[0:n_in] = input_ptrs
        ext[n_in:n_in + self.n_out] = output_ptrs

    def rehearse(self) -> None:
        """Launch the graph variant as a capture records it (the capture itself, or the eager run
        before the first capture)."""
        self.recording = True
        try:
            self.launch_all(self.graph_seq)
        finally:
            self.recording = False

    def launch_all(self, seq: list) -> None:
        launch = self.cu.cuLaunchKernel
        for item in seq:
            if item.__class__ is tuple:
                code = launch(*item)
                if code:
                    self._failed(code, item, seq)
            else:
                item()

    def _failed(self, code: int, item: tuple, seq: list) -> None:
        if code == driver.CUDA_ERROR_INVALID_CONTEXT:
            # A thread that never touched the device: make the primary context current, retry once.
            self.plan.cupy.cuda.runtime.setDevice(self.plan.device_id)
            code = self.cu.cuLaunchKernel(*item)
            if not code:
                return
        index = seq.index(item)
        step = self._variant_of[id(seq)].steps[index]
        raise DriverError(f"cuLaunchKernel of plan step {index} ({step.kind}: {step.name}) failed: "
                          f"{driver.error_name(code)} ({code})", code)

    # -- auto graph ----------------------------------------------------------------------------------
    def capture(self) -> None:
        plan = self.plan
        values = plan.prog.values
        in_bytes = [values[v].nbytes for v in plan.prog.inputs]
        out_bytes = [values[v].nbytes for v in plan.prog.outputs]
        sizes = [align_up(max(n, 1), ALIGN) for n in in_bytes + out_bytes]
        self._stage_mem = plan._malloc(sum(sizes), self.stream_ptr)
        base = int(self._stage_mem.ptr)
        addrs = []
        for size in sizes:
            addrs.append(base)
            base += size
        self.in_stage = list(zip(addrs[:len(in_bytes)], in_bytes))
        self.out_stage = list(zip(addrs[len(in_bytes):], out_bytes))
        self.ext[0:len(addrs)] = addrs
        self.graph = capture.Graph.capture(self.stream, self.rehearse)
        plan.stats["captures"] += 1

    def replay(self, input_ptrs, output_ptrs) -> None:
        cu, st = self.cu, self.stream
        copy = cu.cuMemcpyAsync
        for (dst, n), src in zip(self.in_stage, input_ptrs):
            code = copy(dst, src, n, st)
            if code:  # the first attempt's error: a copy is never re-run to read it
                driver.check(code, "cuMemcpyAsync (plan input to graph staging)")
        code = cu.cuGraphLaunch(self.graph.exec_handle, st)
        if code:
            driver.check(code, "cuGraphLaunch (plan auto graph)")
        for (src, n), dst in zip(self.out_stage, output_ptrs):
            code = copy(dst, src, n, st)
            if code:
                driver.check(code, "cuMemcpyAsync (graph staging to plan output)")

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None
        if self._own_handle is not None:
            self._own_handle.close()
            self._own_handle = None
        self.eager_seq = self.graph_seq = []
        self._keep = []
        self.arena_mem = None
        self._stage_mem = None


def epilogue_gemm(plan, step, bias_ptr: int, compute: int, data_type: int):
    """The cuBLASLt GEMM of a step with an epilogue (made by the step's first run, or ahead of it by
    prechoose.py: one place, so both make it under the same algo_cache key)."""
    op = step.op
    a_shape, b_shape = plan.prog.values[op.inputs[0]].shape, plan.prog.values[op.inputs[1]].shape
    trans_b = bool(op.attrs["trans_b"])
    n, k = b_shape if trans_b else b_shape[::-1]
    return cublaslt.EpilogueGemm(plan.device_id, math.prod(a_shape[:-1]), n, k, float(op.attrs["alpha"]), bias_ptr,
                                 op.attrs["epilogue"], compute, f"plan step '{step.name}'", data_type,
                                 cublas.WORKSPACE_BYTES, trans_b)


def _pointer_table(g, bases: list, sizes) -> np.ndarray:
    """(3, calls x batch) uint64 addresses of every A, B and C matrix of `g`'s strided calls, call-major.
    In NumPy over plain ints: a symbolic plan's sizes are SymInts, whose every operation also builds its
    C expression (BERT-base at 8x128 spent 122 ms of a new shape's first run in this table that way)."""
    offsets = np.array([[int(o) for o in call] for call in g.calls], np.int64)  # (calls, 3)
    strides = np.array([int(g.stride_a), int(g.stride_b), int(g.stride_c)], np.int64)
    within = np.arange(int(g.batch), dtype=np.int64)
    elements = offsets[:, None, :] + within[None, :, None] * strides  # (calls, batch, 3)
    table = np.array(bases, np.uint64) + (elements * np.array([int(x) for x in sizes], np.int64)).astype(np.uint64)
    return np.ascontiguousarray(table.reshape(-1, 3).T)


class _CublasStep:
    """One GEMM step through the plugin's cuBLAS handle, with every argument prepared at build."""

    def __init__(self, inst: _Instance, step, handle, variant):
        self.inst = inst
        self.handle = handle
        self.name = step.name
        op = step.op
        prog = inst.plan.prog
        self.lib = cublas.load_library()
        self.raw = handle.raw
        ffi = cublas.ffi
        self._vp = cublas.void_ptr
        a_shape, b_shape = prog.values[op.inputs[0]].shape, prog.values[op.inputs[1]].shape
        # Each operand in its value's type (A and B alike; C float32 or theirs: Attention's scores);
        # half operands accumulate in float32 (CUBLAS_COMPUTE_32F, tensor cores).
        operands = [prog.values[v] for v in (op.inputs[0], op.inputs[1], op.outputs[0])]
        ta, tb, tc = (cublas.gemm_types(v.dtype, inst.plan.use_tf32)[0] for v in operands)
        compute = cublas.gemm_types(operands[0].dtype, inst.plan.use_tf32)[1]
        sa, sb, sc = (v.itemsize for v in operands)
        self.alpha = ffi.new("float *", float(op.attrs.get("alpha", 1.0)))
        zero = cublas.ZERO
        ptrs = [inst.address(v, variant) for v in (op.inputs[0], op.inputs[1], op.outputs[0])]
        self.calls = []  # (function, args template, [(arg position, ext index, byte offset)])
        self.lt = None  # (cublaslt.EpilogueGemm, operand addresses) instead of calls
        if op.kind == "bgemm":  # a batched layout computed at lowering (Attention)
            g = op.attrs["gemm"]
            if self._pointer_batched(g, (ta, tb, tc), compute, (sa, sb, sc), ptrs):
                return
            for oa, ob, oc in g.calls:
                args = [self.raw, g.transa, cublas.CUBLAS_OP_N, g.m, g.n, g.k,
                        self.alpha, (0, oa * sa), ta, g.lda, g.stride_a,
                        (1, ob * sb), tb, g.ldb, g.stride_b,
                        zero, (2, oc * sc), tc, g.ldc, g.stride_c,
                        g.batch, compute, cublas.CUBLAS_GEMM_DEFAULT]
                self._add(self.lib.cublasGemmStridedBatchedEx, args, ptrs)
            return
        if "epilogue" in op.attrs:  # bias (and ReLU) in the GEMM's epilogue (fuse.cublaslt_epilogues)
            self._cublaslt(step, a_shape, b_shape, compute, variant, ta)
            return
        trans_a, trans_b = op.attrs["trans_a"], op.attrs["trans_b"]
        if trans_a or trans_b:
            # A transposed is a 2-D Gemm's; B transposed alone (fuse.k_major_weights) takes any A as its
            # M = prod(leading dims) rows
            m, k = (a_shape[1], a_shape[0]) if trans_a else (math.prod(a_shape[:-1]), a_shape[-1])
            n = b_shape[0] if trans_b else b_shape[1]
            args = [self.raw, cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N,
                    cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N, n, m, k,
                    self.alpha, (1, 0), tb, b_shape[1], (0, 0), ta, a_shape[-1],
                    zero, (2, 0), tc, n, compute, cublas.CUBLAS_GEMM_DEFAULT]
            self._add(self.lib.cublasGemmEx, args, ptrs)
            return
        plan = cublas.matmul_plan(tuple(a_shape), tuple(b_shape))
        if plan.empty or plan.k_zero:
            raise PlanError(f"MatMul '{step.name}' has an empty operand ({a_shape} x {b_shape}); "
                            "a compiled plan needs non-empty GEMMs")
        m, n, k = plan.m, plan.n, plan.k
        for oa, ob, oc in plan.offsets:
            if plan.batch == 1:
                args = [self.raw, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k,
                        self.alpha, (1, ob * sb), tb, n, (0, oa * sa), ta, k,
                        zero, (2, oc * sc), tc, n, compute, cublas.CUBLAS_GEMM_DEFAULT]
                self._add(self.lib.cublasGemmEx, args, ptrs)
            else:
                args = [self.raw, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k,
                        self.alpha, (1, ob * sb), tb, n, plan.stride_b,
                        (0, oa * sa), ta, k, plan.stride_a,
                        zero, (2, oc * sc), tc, n, plan.stride_c,
                        plan.batch, compute, cublas.CUBLAS_GEMM_DEFAULT]
                self._add(self.lib.cublasGemmStridedBatchedEx, args, ptrs)

    def _pointer_batched(self, g, types, compute, sizes, ptrs) -> bool:
        """One cublasGemmBatchedEx over every matrix of `g`'s calls, through arrays of their addresses built
        here in device memory; False (the strided calls then) where `g` is one call already, an operand's
        address changes per run (a call input or output), or the stream is capturing (no upload then).
        The 3-D Attention layout (batch, sequence, heads * size) needs one strided call per batch item:
        BERT-base at batch 8 made 8 calls of 12 heads each, 40-52 us on the H200 against 9 us for one
        call over the 96 matrices (PyTorch's bmm)."""
        if len(g.calls) < 2 or any(ptrs[i][0] is not None for i in range(3)):
            return False
        inst = self.inst
        cp = inst.plan.cupy
        try:
            if cp.cuda.runtime.streamIsCapturing(inst.stream_ptr):
                return False
        except cp.cuda.runtime.CUDARuntimeError:  # the legacy stream asked during another's capture
            return False
        table = _pointer_table(g, [ptrs[i][1] for i in range(3)], sizes)
        mem = inst.plan._malloc(table.nbytes, inst.stream_ptr)
        with cp.cuda.Device(inst.plan.device_id):
            # From pageable memory the copy returns once `table` is staged; it is kept all the same.
            cp.cuda.runtime.memcpyAsync(int(mem.ptr), table.ctypes.data, table.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, inst.stream_ptr)
        self.tables, self._table_source = mem, table  # the GEMM reads the device copy at every launch
        base, count = int(mem.ptr), table.shape[1]
        ta, tb, tc = types
        args = [self.raw, g.transa, cublas.CUBLAS_OP_N, g.m, g.n, g.k,
                self.alpha, self._vp(base), ta, g.lda, self._vp(base + 8 * count), tb, g.ldb,
                cublas.ZERO, self._vp(base + 16 * count), tc, g.ldc, count, compute, cublas.CUBLAS_GEMM_DEFAULT]
        self.calls.append((self.lib.cublasGemmBatchedEx, args, ()))
        return True

    def _cublaslt(self, step, a_shape, b_shape, compute, variant, data_type: int) -> None:
        inst = self.inst
        op = step.op
        ext_index, bias = inst.address(op.inputs[2], variant)
        if ext_index is not None:  # fuse folds only constant biases: their address never changes
            raise PlanError(f"GEMM '{self.name}': its epilogue bias is a call input; expected a constant")
        plan = inst.plan
        gemm = plan.epilogue_gemm((variant.name, id(step)),
                                  lambda: epilogue_gemm(plan, step, bias, compute, data_type))
        if self.handle.workspace_bytes < gemm.workspace_bytes:
            raise PlanError(f"GEMM '{self.name}': the stream's cuBLAS workspace has {self.handle.workspace_bytes} "
                            f"bytes; its cuBLASLt algorithm was chosen for {gemm.workspace_bytes}")
        self.lt = (gemm, [inst.address(v, variant) for v in (op.inputs[0], op.inputs[1], op.outputs[0])])

    def _run_lt(self) -> None:
        gemm, operands = self.lt
        ext = self.inst.ext
        a, b, out = (addr if j is None else ext[j] for j, addr in operands)
        # The workspace the stream's cuBLAS calls use: the plan's steps run in that stream's order.
        gemm(a, b, out, self.inst.stream_ptr, self.handle.workspace_ptr)

    def _add(self, fn, args: list, ptrs: list) -> None:
        """Replace (operand, byte offset) placeholders: fixed addresses now, call inputs/outputs per run."""
        dynamic = []
        for pos, a in enumerate(args):
            if isinstance(a, tuple):
                operand, offset = a
                j, addr = ptrs[operand]
                if j is None:
                    args[pos] = self._vp(addr + offset)
                else:
                    args[pos] = None
                    dynamic.append((pos, j, offset))
        self.calls.append((fn, args, tuple(dynamic)))

    def __call__(self) -> None:
        if self.lt is not None:
            self._run_lt()
            return
        ext = self.inst.ext
        vp = self._vp
        for fn, args, dynamic in self.calls:
            if dynamic:
                args = list(args)
                for pos, j, offset in dynamic:
                    args[pos] = vp(ext[j] + offset)
            status = fn(*args)
            if status:
                cublas.check(status, f"cuBLAS GEMM of plan step '{self.name}'")
