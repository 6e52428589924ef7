"""The example EP: a Python plugin on the CPU, built at every ABI version from this one source.

It runs a few ops with NumPy through the whole kernel path (kernel context, host-allocated
outputs, its own allocator and sync stream) and records what it did in its runtime's Record
(`abi.sdk.runtime(module).record`): host functions used, slots called, fallbacks taken, live
objects. From v3 it offers graph capture with a *recorded* replay: during the capture run it
records each kernel call, and ReplayGraph runs the recording again on the same buffers.

Faults for tests are chosen with the environment variable EPHOST_TEST_FAULT, read when the
host calls CreateEpFactories: entry_error, entry_null, create_ep_fails, version_low,
version_future, struct_truncated, struct_oversized, null_mandatory, kernel_fails,
eager_slots (every table carries every slot the plugin was built with, whatever the host serves).
EPHOST_TEST_MOCK_DEVICE=1, read at the same time, makes the factory's device a mock GPU (device type
GPU, id 0) whose memory is host memory the host may not read directly: it must copy through this
plugin's data transfer, as for a real device (the host's location is the factory's, so this cannot be
a provider option). Provider options: ops=Add,Relu (claim only these), fail_node=NAME, enable_graph=1,
min_runs=N, null_slots=Sync,OnRunEnd, mock_device=1 (accepted for older tests; the memory moves only
with EPHOST_TEST_MOCK_DEVICE=1), graph_policy=shapes (GRAPH_ALLOW_CPU_FOR_SHAPES),
lie=capture_flag|policy|concurrent_flag|concurrent_silent|concurrent_fails|capability_fails (a broken
answer from IsGraphCaptureEnabled, GetGraphCaptureNodeAssignmentPolicy, IsConcurrentRunSupported or
GetCapability) or
lie=sync_fails_after_capture (Sync fails once a graph is captured), lie=run_start_fails|run_end_fails
(OnRunStart or OnRunEnd fails on every run; OnRunStart records the gpu_graph_id it was given and
OnRunEnd the sync_stream flag, in slot_calls), lie=state_fails (a compiled group's CreateState fails), slow_replay=1 (each replay sleeps
2 ms; replays that overlap on this EP are counted in slot_calls["overlapping_replays"]).

Compiled partitions (ABI v6, option fuse=1 or fuse=runs): every maximal run of consecutive claimed
nodes (a range of the topological order, so never a cycle) is claimed as one fused group (fuse=all: every
claimed node in one group, which the host refuses when a path leaves it and comes back; modes joined by
'+', e.g. fuse=all+all+runs, propose their groups one after the other), and
compile() turns each into a NumPy closure that Compute runs on the call frame: inputs are read
in place, static outputs are written into the host's preallocated buffers, dynamic ones are
allocated through the frame's callback. fail_node=NAME fails inside the closure naming that
node; compile_fails=all (or a node name) makes compile() fail for every group (or the group
holding that node); scratch=N asks the frame for two scratch blocks of N bytes per call, frees
one and leaves the other to the host. Nodes of a fused group are also claimed singly, so a failed compile falls
back to this EP's per-node kernels.

Saved contexts (ABI v7): each compiled group's context() is its program (op types, value ids, node
names) and constants, serialised with np.savez behind a magic header; compile_from_context()
rebuilds the same closure from it. context=0 writes no context (the host keeps the nodes);
context=fail makes GetContext fail (the host keeps the nodes and warns).
compatibility_info() names the plugin version, the ABI it was built for, the context format and
the device; the factory answers: another format or a device it does not have -> unsupported,
another plugin version or ABI -> prefer recompilation, else optimal.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
import weakref
import zipfile

import numpy as np

import abi
from abi import sdk
from abi.dtypes import to_numpy

FAULT_ENV = "EPHOST_TEST_FAULT"
MOCK_DEVICE_ENV = "EPHOST_TEST_MOCK_DEVICE"


@contextlib.contextmanager
def mock_device():
    """EPHOST_TEST_MOCK_DEVICE=1 while inside (plugins registered there get the mock device), restored after."""
    old = os.environ.get(MOCK_DEVICE_ENV)
    os.environ[MOCK_DEVICE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MOCK_DEVICE_ENV)
        else:
            os.environ[MOCK_DEVICE_ENV] = old
EP_NAME = "ExampleEP"

_OPS = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide,
    "Relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "Sigmoid": lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype),
    "MatMul": np.matmul, "Identity": lambda x: x.copy(),
}
_FLOAT_TYPES = (1, 11)  # float32, float64


def _reshape(x, shape):
    """ONNX Reshape (allowzero 0): a 0 keeps the input's dim, a -1 is inferred."""
    return x.reshape([x.shape[i] if d == 0 else int(d) for i, d in enumerate(shape.reshape(-1).tolist())])


# Ops claimed only when the "ops" option names them, per node (never fused); their shape input is
# read on the host (abi/host_inputs.py), so tests see where the host delivers it.
_OPT_IN = {"Reshape": _reshape, "Gather": lambda data, idx: np.take(data, idx, axis=0)}


@sdk.count_slot_calls  # tests assert on how often each slot was called
def create_factories(runtime: sdk.Runtime, registration_name: str, logger) -> list:
    fault = os.environ.get(FAULT_ENV, "")
    if fault == "entry_error":
        raise sdk.PluginError("injected failure in CreateEpFactories", abi.EP_FAIL)
    if fault == "entry_null":
        return [runtime.ffi.NULL]
    factory = ExampleFactory(runtime, logger, fault)
    return [_expose_factory(runtime, factory, fault)]


def _expose_factory(runtime: sdk.Runtime, factory, fault: str):
    ffi = runtime.ffi
    if fault == "version_low":
        return runtime.expose("EpFactory", factory, declared_version=0)
    if fault == "version_future":
        return runtime.expose("EpFactory", factory, declared_version=abi.ABI_NEXT_GENERATION + 1)
    if fault == "struct_truncated":
        return runtime.expose("EpFactory", factory, struct_size=ffi.offsetof("EpFactory", "GetName"))
    if fault == "struct_oversized":
        return runtime.expose("EpFactory", factory, struct_size=ffi.sizeof("EpFactory") + 64)
    return runtime.expose("EpFactory", factory)


class ExampleFactory(sdk.FactoryBase):
    ep_name = EP_NAME
    vendor = "ephost-tests"
    plugin_version = "1.0.0"
    stream_aware = True

    def __init__(self, runtime, logger, fault: str):
        super().__init__(runtime, logger)
        self.fault = fault
        self.mock_device = os.environ.get(MOCK_DEVICE_ENV, "0") == "1"
        self.eps: weakref.WeakSet = weakref.WeakSet()
        if fault == "null_mandatory":
            self.null_slots = ("GetSupportedDevices",)
        if fault == "eager_slots":
            # A test double for the host's gate alone: every table this factory makes (and what its
            # EPs make) carries every slot the plugin was built with, whatever the host serves.
            self.abi_version = runtime.compiled_version

    def supported_devices(self):
        if self.mock_device:
            return [sdk.DeviceSpec(abi.DEVICE_GPU, 0, 0, "example-mock-gpu", "MockGpu")]
        return [sdk.DeviceSpec(abi.DEVICE_CPU, 0, 0, DEVICE_NAME, "Cpu")]

    def validate_compatibility(self, devices, info):
        fields = sdk.compatibility_fields(info, EP_NAME)
        if fields is None or fields.get("format") != str(CONTEXT_FORMAT) \
                or fields.get("device") not in {d.name for d in devices}:
            return sdk.COMPILED_MODEL_UNSUPPORTED
        if fields.get("plugin") != self.plugin_version or fields.get("abi") != str(self.runtime.compiled_version):
            return sdk.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION
        return sdk.COMPILED_MODEL_SUPPORTED_OPTIMAL

    def create_ep(self, devices, options, session_options, logger):
        if self.fault == "create_ep_fails":
            raise sdk.PluginError("injected failure in CreateEp", abi.EP_FAIL)
        ep = ExampleEp(self.runtime, self, options, logger)
        self.eps.add(ep)
        return ep

    def create_allocator(self, spec):
        # A factory allocator serves every EP of the factory: it asks them which one is capturing.
        alloc = ExampleAllocator(self.runtime, self, spec)
        alloc.factory_eps = self.eps
        return alloc

    def create_data_transfer(self):
        return ExampleDataTransfer(self.runtime, self)

    def create_sync_stream(self, spec):
        return ExampleStream(self.runtime, self)


_FUSE_MODES = ("runs", "all")
DEVICE_NAME = "example-cpu"
CONTEXT_FORMAT = 1
CONTEXT_MAGIC = b"EXAMPLE-EP-CONTEXT\0"


def _fuse_modes(text: str) -> list[str]:
    """fuse=0 (none), 1 (= runs), all, or modes joined by '+', proposed in that order (all+all+runs)."""
    if text == "0":
        return []
    modes = ["runs" if m == "1" else m for m in text.split("+")]
    bad = [m for m in modes if m not in _FUSE_MODES]
    if bad:
        raise sdk.PluginError(f"option fuse={text!r}: unknown mode(s) {bad}; expected 0, 1, or modes of "
                              f"{list(_FUSE_MODES)} joined by '+'", abi.EP_INVALID_ARGUMENT)
    return modes


def _consecutive_runs(nodes: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in nodes:
        if groups and i == groups[-1][-1] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class ExampleEp(sdk.EpBase):
    name = EP_NAME

    def __init__(self, runtime, factory, options: dict[str, str], logger):
        super().__init__(runtime, factory)
        allowed = {"ops", "fail_node", "enable_graph", "min_runs", "null_slots", "mock_device", "fuse",
                   "compile_fails", "scratch", "lie", "slow_replay", "context", "graph_policy"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise sdk.PluginError(f"unknown option(s) {unknown} for {EP_NAME}; allowed: {sorted(allowed)}",
                                  abi.EP_INVALID_ARGUMENT)
        self.ops = set(options["ops"].split(",")) if options.get("ops") else set(_OPS)
        self.fail_node = options.get("fail_node", "")
        self.graph_enabled = options.get("enable_graph", "0") == "1"
        min_runs = options.get("min_runs", "2")
        if not (min_runs.isascii() and min_runs.isdigit()):
            raise sdk.PluginError(f"option min_runs={min_runs!r}: expected a decimal integer >= 0",
                                  abi.EP_INVALID_ARGUMENT)
        self.min_runs = int(min_runs)
        self.null_slots = tuple(s for s in options.get("null_slots", "").split(",") if s)
        self.lie = options.get("lie", "")
        # graph_policy=shapes: GRAPH_ALLOW_CPU_FOR_SHAPES (CPU shape computations beside a capture).
        self.policy = abi.GRAPH_ALLOW_CPU_FOR_SHAPES if options.get("graph_policy") == "shapes" \
            else abi.GRAPH_ALL_NODES_ON_EP
        self.slow_replay = options.get("slow_replay", "0") == "1"
        self.replaying = 0
        self.mock_device = options.get("mock_device", "0") == "1"
        self.fuse_modes = _fuse_modes(options.get("fuse", "0"))
        self.compile_fails = options.get("compile_fails", "")
        self.scratch_bytes = int(options.get("scratch", "0"))
        self.write_context = options.get("context", "1") == "1"
        self.context_fails = options.get("context") == "fail"  # GetContext answers EP_FAIL
        self.last_output_ptrs: list[int] = []
        self.last_compiled: list = []
        self.lock = threading.Lock()
        self.run_counts: dict[int, int] = {}
        self.capturing: int | None = None
        self.recording: list = []
        self.graphs: dict[int, list] = {}
        self.graph_memory: dict[int, list] = {}
        self.capture_allocations: list = []
        self.logger = logger

    # -- capability and kernels --------------------------------------------------------
    def claim(self, graph):
        if self.lie == "capability_fails":
            raise sdk.PluginError("injected failure in GetCapability", abi.EP_FAIL)
        chosen = []
        for node in graph.nodes:
            types = [graph.values[i].elem_type for i in node.inputs if i >= 0]
            if node.domain in ("", "ai.onnx") and node.op_type in self.ops and node.op_type in _OPT_IN \
                    and types[0] in _FLOAT_TYPES and node.attrs.get("axis", 0) == 0:
                chosen.append(node.index)
            elif node.domain in ("", "ai.onnx") and node.op_type in self.ops and node.op_type in _OPS \
                    and types and all(t in _FLOAT_TYPES for t in types):
                chosen.append(node.index)
        return chosen

    def create_kernel(self, graph, node):
        return ExampleKernel(self.runtime, self, node)

    # -- compiled partitions (v6) --------------------------------------------------------
    def claim_fused(self, graph):
        if not self.fuse_modes:
            return []
        chosen = [i for i in self.claim(graph) if graph.nodes[i].op_type not in _OPT_IN]
        groups: list[list[int]] = []
        for mode in self.fuse_modes:
            groups += _consecutive_runs(chosen) if mode == "runs" else [list(chosen)] if chosen else []
        return groups

    def compile(self, fused):
        for fg in fused:
            names = {n.name for n in fg.graph.nodes}
            if self.compile_fails == "all" or self.compile_fails in names:
                raise sdk.PluginError(f"injected compile failure for fused node '{fg.name}'", abi.EP_FAIL)
        self.last_compiled = [ExampleCompute.from_graph(self, fg) for fg in fused]
        return self.last_compiled

    # -- saved contexts (v7) --------------------------------------------------------------
    def compile_from_context(self, fused, blob):
        compute = ExampleCompute.from_context(self, fused, blob)
        self.last_compiled = [compute]
        return compute

    def compatibility_info(self):
        return sdk.compatibility_string(EP_NAME, plugin=self.factory.plugin_version, abi=self.runtime.compiled_version,
                                        format=CONTEXT_FORMAT, device=DEVICE_NAME)

    def CreateAllocator(self, info, out):
        alloc = ExampleAllocator(self.runtime, self.factory, self.factory._spec(info))
        alloc.ep = self
        out[0] = self.runtime.expose("EpAllocator", alloc)

    # -- v2 ----------------------------------------------------------------------------
    def Sync(self):
        if self.lie == "sync_fails_after_capture" and self.graphs:
            raise sdk.PluginError("injected failure in Sync", abi.EP_FAIL)
        self.runtime.record.fallbacks["ep_device_sync"] += 1

    def IsConcurrentRunSupported(self, supported):
        if self.lie == "concurrent_fails":
            raise sdk.PluginError("injected failure in IsConcurrentRunSupported", abi.EP_FAIL)
        if self.lie == "concurrent_silent":
            return  # OK without writing the answer: the host must read its own initial "no"
        supported[0] = 3 if self.lie == "concurrent_flag" else 0 if self.graph_enabled else 1

    # -- runs and graphs (v3..v5) --------------------------------------------------------
    def OnRunStart(self, run_options):
        seen = self.run_options(run_options).get("gpu_graph_id")
        self.runtime.record.slot_calls[f"OnRunStart gpu_graph_id={seen}"] += 1  # what the host passed on
        if self.lie == "run_start_fails":
            raise sdk.PluginError("injected failure in OnRunStart", abi.EP_FAIL)
        if not self.graph_enabled:
            return
        gid = int(seen or "0")
        if gid == -1 or gid in self.graphs:
            return
        with self.lock:
            count = self.run_counts[gid] = self.run_counts.get(gid, 0) + 1
            if count > self.min_runs:
                self.capturing, self.recording, self.capture_allocations = gid, [], []

    def OnRunEnd(self, run_options, sync_stream):
        self.runtime.record.slot_calls[f"OnRunEnd sync_stream={sync_stream}"] += 1
        with self.lock:
            if self.capturing is not None:
                self.graphs[self.capturing] = self.recording
                self.graph_memory[self.capturing] = self.capture_allocations
                self.capturing = None
        if self.lie == "run_end_fails":
            raise sdk.PluginError("injected failure in OnRunEnd", abi.EP_FAIL)

    def IsGraphCaptureEnabled(self):
        return 2 if self.lie == "capture_flag" else int(self.graph_enabled)

    def IsGraphCaptured(self, graph_id):
        return int(graph_id in self.graphs)

    def GetGraphCaptureNodeAssignmentPolicy(self):
        return 7 if self.lie == "policy" else self.policy

    def ReplayGraph(self, graph_id):
        self._replay(graph_id)

    def ReleaseCapturedGraph(self, graph_id):
        self.graphs.pop(graph_id, None)
        self.graph_memory.pop(graph_id, None)
        self.run_counts.pop(graph_id, None)

    def ReplayGraphWithSync(self, graph_id, sync):
        self._replay(graph_id)
        if sync:
            self.runtime.record.fallbacks["ep_stream_sync"] += 1

    def _replay(self, graph_id: int) -> None:
        steps = self.graphs.get(graph_id)
        if steps is None:
            raise sdk.PluginError(f"graph {graph_id} was not captured", abi.EP_INVALID_ARGUMENT)
        self.runtime.record.slot_calls["replayed_steps"] += len(steps)
        with self.lock:
            self.replaying += 1
            if self.replaying > 1:  # another thread is inside a replay of this EP (it declared no concurrent runs)
                self.runtime.record.slot_calls["overlapping_replays"] += 1
        try:
            if self.slow_replay:
                time.sleep(0.002)  # widens the window in which an unserialised replay would overlap
            self._replay_steps(steps)
        finally:
            with self.lock:
                self.replaying -= 1

    def _replay_steps(self, steps) -> None:
        for step in steps:
            if callable(step):  # a compiled partition: re-run its closure on the captured buffers
                step()
                continue
            fn, inputs, out = step
            out[...] = fn(*inputs)

    def close(self):
        self.graphs.clear()
        self.graph_memory.clear()


def _view(ffi, t) -> np.ndarray:
    shape = tuple(t.shape[i] for i in range(t.ndim))
    dtype = to_numpy(t.elem_type)
    if t.nbytes == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(ffi.buffer(t.data, t.nbytes), dtype=dtype).reshape(shape)


def _read_context(blob: bytes):
    """(header, program, constants) of an ExampleCompute context; raises ValueError on any damage."""
    if not blob.startswith(CONTEXT_MAGIC):
        raise ValueError("no ExampleEP context header")
    start = len(CONTEXT_MAGIC) + 4
    size = int.from_bytes(blob[len(CONTEXT_MAGIC):start], "little")
    if start + size > len(blob):
        raise ValueError(f"truncated: the header needs {size} bytes, {len(blob) - start} follow")
    head = json.loads(blob[start:start + size])
    if head.get("format") != CONTEXT_FORMAT:
        raise ValueError(f"context format {head.get('format')!r}; this plugin reads {CONTEXT_FORMAT}")
    with np.load(io.BytesIO(blob[start + size:]), allow_pickle=False) as arrays:
        constants = {int(k[1:]): arrays[k] for k in arrays.files}
    return head, head["program"], constants


def _array_at(ffi, ptr: int, dtype: int, shape: tuple) -> np.ndarray:
    """A NumPy view of `shape` elements of ONNX type `dtype` at host address `ptr`."""
    dt = to_numpy(dtype)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count == 0:
        return np.zeros(shape, dt)
    return np.frombuffer(ffi.buffer(ffi.cast("void*", ptr), count * dt.itemsize), dtype=dt).reshape(shape)


class ExampleCompute:
    """A fused group compiled into a NumPy closure: one ABI crossing per run for the whole group."""

    def __init__(self, ep: ExampleEp, name: str, program: list[tuple], constants: dict[int, np.ndarray],
                 input_ids, output_ids, output_types):
        self.ep = ep
        self.ffi = ep.ffi
        self.name = name
        self.record = ep.runtime.record
        self.program = program  # (op_type, input ids, output id, node index, node name) per node
        self.constants = constants
        self.steps = [(_OPS[op], ins, out, index, node == ep.fail_node) for op, ins, out, index, node in program]
        self.input_ids, self.output_ids = tuple(input_ids), tuple(output_ids)
        self.output_types = list(output_types)
        self.fused: sdk.FusedGraph | None = None  # what the host showed compile() or compile_from_context()

    @classmethod
    def from_graph(cls, ep: ExampleEp, fused: sdk.FusedGraph) -> ExampleCompute:
        g = fused.graph
        program = [(n.op_type, tuple(n.inputs), n.outputs[0], n.index, n.name) for n in g.nodes]
        constants = {i: v.constant for i, v in enumerate(g.values) if v.constant is not None}
        compute = cls(ep, fused.name, program, constants, g.input_ids, g.output_ids, [v.dtype for v in g.outputs])
        compute.fused = fused
        return compute

    @classmethod
    def from_context(cls, ep: ExampleEp, fused: sdk.FusedGraph, blob: bytes) -> ExampleCompute:
        """The closure context() described; a blob this EP did not write, or a damaged one, is refused."""
        try:
            head, program, constants = _read_context(bytes(blob))  # its contexts are small: a copy
            compute = cls(ep, fused.name, [(op, tuple(ins), out, index, node) for op, ins, out, index, node in program],
                          constants, head["inputs"], head["outputs"], head["output_types"])
        except (ValueError, KeyError, TypeError, OSError, EOFError, zipfile.BadZipFile) as exc:  # a damaged blob
            raise sdk.PluginError(f"context of fused node '{fused.name}' cannot be read ({len(blob)} bytes): "
                                  f"{type(exc).__name__}: {exc}", abi.EP_INVALID_GRAPH) from None
        g = fused.graph
        if (len(g.inputs), len(g.outputs)) != (len(compute.input_ids), len(compute.output_ids)):
            raise sdk.PluginError(f"context of fused node '{fused.name}' has {len(compute.input_ids)} inputs and "
                                  f"{len(compute.output_ids)} outputs; the node has {len(g.inputs)} and "
                                  f"{len(g.outputs)}", abi.EP_INVALID_GRAPH)
        compute.fused = fused
        return compute

    def context(self) -> bytes | None:
        """The program and constants as bytes (None with option context=0: no context saved)."""
        if self.ep.context_fails:
            raise sdk.PluginError(f"context of fused node '{self.fused.name}' refused (option context=fail)")
        if not self.ep.write_context:
            return None
        head = {"format": CONTEXT_FORMAT, "program": [list(step) for step in self.program],
                "inputs": list(self.input_ids), "outputs": list(self.output_ids), "output_types": self.output_types}
        arrays = io.BytesIO()
        np.savez(arrays, **{f"c{k}": v for k, v in self.constants.items()})
        text = json.dumps(head).encode()
        return CONTEXT_MAGIC + len(text).to_bytes(4, "little") + text + arrays.getvalue()

    def create_state(self):
        if self.ep.lie == "state_fails":
            raise sdk.PluginError(f"injected CreateState failure for fused node '{self.name}'", abi.EP_FAIL)
        return {"runs": 0}

    def release_state(self, state):
        self.record.live["compute_state_released"] += 1

    def _evaluate(self, inputs: list[np.ndarray]) -> dict[int, np.ndarray]:
        env = dict(self.constants)
        env.update(zip(self.input_ids, inputs))
        for fn, ins, out, index, fail in self.steps:
            if fail:
                raise sdk.NodeError(f"injected failure in node {index} of '{self.name}'", index)
            env[out] = np.asarray(fn(*(env[i] for i in ins)))
        return env

    def compute(self, state, frame):
        state["runs"] += 1
        rec = self.record
        if frame.capturing:
            rec.fallbacks["frame_capturing"] += 1
        inputs = [_array_at(self.ffi, t.ptr, t.dtype, t.shape) for t in frame.inputs]
        if self.ep.scratch_bytes:
            self._use_scratch(frame, self.ep.scratch_bytes)
        env = self._evaluate(inputs)
        targets = []
        for j, (vid, t) in enumerate(zip(self.output_ids, frame.outputs)):
            result = env[vid]
            ptr = t.ptr
            if ptr == 0:
                rec.host_calls["AllocateOutput"] += 1
                ptr = frame.allocate_output(j, result.shape)
            else:
                rec.fallbacks["frame_preallocated"] += 1
            target = _array_at(self.ffi, ptr, self.output_types[j], result.shape)
            target[...] = result
            targets.append(target)
        self.ep.last_output_ptrs = frame.output_ptrs()
        if self.ep.capturing is not None:
            self.ep.recording.append(lambda: self._replay(inputs, targets))

    def _use_scratch(self, frame, nbytes: int) -> None:
        kept, freed = frame.scratch(nbytes), frame.scratch(nbytes)
        for ptr in (kept, freed):
            _array_at(self.ffi, ptr, 2, (nbytes,))[...] = 7  # uint8: the memory is writable
        frame.free_scratch(freed)
        self.record.host_calls["scratch"] += 2

    def _replay(self, inputs, targets) -> None:
        env = self._evaluate(inputs)
        for vid, target in zip(self.output_ids, targets):
            target[...] = env[vid]


class ExampleKernel(sdk.KernelBase):
    def __init__(self, runtime, ep: ExampleEp, node):
        super().__init__(runtime, ep)
        self.ep = ep
        self.node = node
        self.fn = _OPS.get(node.op_type) or _OPT_IN[node.op_type]
        self.fail = ep.fail_node == node.name or ep.factory.fault == "kernel_fails"
        self._get_io, self._get_output = self.api.get_io, self.api.get_output
        self._record = runtime.record

    def Compute(self, context):
        ffi = self.ffi
        rec = self._record.host_calls
        io = ffi.new("const EpKernelIO**")
        rec["KernelContext_GetIO"] += 1
        self.api.check(self._get_io(context, io))
        if self.fail:
            raise sdk.PluginError(f"injected kernel failure in node '{self.node.name}'")
        # The framework stream tags scratch memory (seed 000); older hosts take the fallback.
        self.api.sync_stream(context)
        inputs = [_view(ffi, io[0].inputs[i]) for i in range(io[0].num_inputs)]
        for i in range(io[0].num_inputs):
            self._record.input_devices[io[0].inputs[i].device_type] += 1
        result = np.asarray(self.fn(*inputs))
        out = ffi.new("EpTensor**")
        rec["KernelContext_GetOutput"] += 1
        self.api.check(self._get_output(context, 0, ffi.new("int64_t[]", result.shape),
                                                result.ndim, out))
        target = _view(ffi, out[0])
        target[...] = result
        if self.ep.capturing is not None:
            self.ep.recording.append((self.fn, inputs, target))


class ExampleAllocator(sdk.AllocatorBase):
    """Host memory from NumPy; while a graph is captured, frees are held by the graph."""

    def __init__(self, runtime, factory, spec):
        super().__init__(runtime, factory, spec)
        self.blocks: dict[int, np.ndarray] = {}
        self.ep: ExampleEp | None = None
        self.factory_eps = ()
        self.total_allocs = 0

    def alloc(self, size: int, stream) -> int:
        block = np.empty(max(size, 1), np.uint8)
        ptr = block.ctypes.data
        self.blocks[ptr] = block
        self.total_allocs += 1
        self.runtime.record.live["allocation"] += 1
        if stream is not None:
            self.runtime.record.host_calls["stream_tagged_alloc"] += 1
        return ptr

    def free(self, ptr: int) -> None:
        block = self.blocks.pop(ptr, None)
        if block is None:
            return
        self.runtime.record.live["allocation"] -= 1
        eps = [self.ep] if self.ep is not None else list(self.factory_eps)
        capturing = next((ep for ep in eps if ep.capturing is not None), None)
        if capturing is not None:
            # A captured graph replays into this memory: the graph owns it from now on.
            capturing.capture_allocations.append(block)

    def close(self):
        self.runtime.record.live["allocation"] -= len(self.blocks)
        self.blocks.clear()


class ExampleStream(sdk.SyncStreamBase):
    """A CPU stream: work is done when the kernel returns, so waits are immediate."""

    def create_notification(self):
        return ExampleNotification(self.runtime, self)


class ExampleNotification(sdk.NotificationBase):
    def WaitOnDevice(self, consumer):
        self.runtime.record.host_calls["notification_wait_device"] += 1

    def WaitOnHost(self):
        self.runtime.record.host_calls["notification_wait_host"] += 1


class ExampleDataTransfer(sdk.Impl):
    table = "EpDataTransfer"

    def __init__(self, runtime, factory: ExampleFactory):
        super().__init__(runtime, factory)
        self.factory = factory

    def CanCopy(self, src, dst):
        # A mock device's memory is host memory: every pair of its locations is one memmove.
        kinds = (abi.DEVICE_CPU, abi.DEVICE_GPU) if self.factory.mock_device else (abi.DEVICE_CPU,)
        return int(src.device_type in kinds and dst.device_type in kinds)

    def CopyTensors(self, src, dst, streams, count):
        for i in range(count):
            self.runtime.record.host_calls[f"copy {src[i].device_type}->{dst[i].device_type}"] += 1
            self.ffi.memmove(dst[i].data, src[i].data, src[i].nbytes)

    def Release(self):
        self.runtime.forget(self._c_table, "EpDataTransfer")
