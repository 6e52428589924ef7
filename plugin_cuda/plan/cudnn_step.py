"""Compiled-plan convolutions on cuDNN: the lowering's choice, the ReLU / residual folding, the step.

Lowering (lower_conv.py) emits a `cudnn_conv` op instead of the generated direct `conv` when the
convolution is large enough for cuDNN to win (wants_cudnn; docs/compiled_plan.md has the figures)
and cuDNN loads. `fold_epilogues` then takes a ReLU that alone reads the result (and an Add of a
same-shape value before it: ResNet's residual) into the op: cudnnConvolutionBiasActivationForward
computes relu(conv(x, w) + z + bias) in one call. The op has no generated kernel, so its step is
packed by the plan as a CudnnStep: its descriptors and algorithm are made once per plan (shared
by every stream), its workspace once per stream instance; a run reads the operands' addresses
from the plan's cells and makes its cuDNN calls (no allocation: capturable).

Two ways to make the calls, chosen per run (docs/cuda_ops.md has the measurements):
- eager runs execute a graph-API plan (device/cudnn_graph.py, built with the step): 6-34 µs of
  host time per convolution where the legacy calls take 60-180 µs, which made eager runs of
  ResNet-50 host-bound. cuDNN fuses no pointwise tail onto NCHW convolutions there, so the bias,
  residual and ReLU follow as legacy calls;
- captures (and the rehearsal run before one) and the first run make the legacy calls, whose
  fused bias + residual + ReLU kernel is the fastest for a replay, where host time is not paid.
`EPHOST_CUDNN_GRAPH=0` keeps the legacy calls for every run.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np

from plugin_cuda.device import cudnn, cudnn_conv, cudnn_graph
from plugin_cuda.plan.program import Op, Program

KIND = "cudnn_conv"
# Multiply-adds from which a convolution runs on cuDNN rather than as a generated direct kernel.
CUDNN_MIN_MACS = 1 << 24
RELU = "ep_relu({0})"
_probe_lock = threading.Lock()
ADD = "({0} + {1})"


def wants_cudnn(x_shape, w_shape, out_shape, begin, end, group: int = 1, strides=(1, 1), dilations=(1, 1),
                dtype=np.float32) -> bool:
    """Whether a plan's 2-D convolution goes to cuDNN: big enough, symmetric pads, cuDNN usable here
    (cudnn.usable) and taking its descriptors in `dtype` (host-side calls: a geometry cuDNN refuses
    stays a generated kernel)."""
    macs = math.prod(out_shape) * math.prod(w_shape[1:])
    if macs < CUDNN_MIN_MACS or tuple(begin) != tuple(end) or not cudnn.usable():
        return False
    return descriptors_ok(cudnn_conv.forward_geometry(x_shape, w_shape, out_shape, group, begin, end, strides,
                                                      dilations), dtype)


def descriptors_ok(geo, dtype=np.float32) -> bool:
    """Whether cuDNN takes the descriptors of `geo` and its heuristic names an algorithm with its
    workspace size (host-side calls, no device work)."""
    try:
        setup = cudnn_conv.ConvSetup(cudnn.load_library(), "forward", geo, dtype, False)
        handle = cudnn.probe_handle()
        if handle is not None:
            with _probe_lock:  # one handle, sessions built on several threads
                cudnn_conv.choose(handle, setup, "HEURISTIC")
    except cudnn.CudnnError:
        return False
    return True


def _only_reader(users: dict, prog: Program, vid: int, expr: str):
    readers = users.get(vid, [])
    if len(readers) != 1 or vid in prog.outputs:
        return None
    op = readers[0]
    if op.kind != "ew" or op.attrs.get("expr") != expr or prog.values[op.outputs[0]].shape != prog.values[vid].shape:
        return None
    return op


def fold_epilogues(prog: Program) -> Program:
    """`prog` with each cudnn_conv that has a bias and is followed by ReLU (optionally Add of a
    same-shape tensor, then ReLU) as one op writing the ReLU's output. `prog` is not changed."""
    users: dict = {}
    for op in prog.ops:
        for v in op.inputs:
            users.setdefault(v, []).append(op)
    replace: dict = {}
    for op in prog.ops:
        if op.kind != KIND or len(op.inputs) < 3:
            continue
        out = op.outputs[0]
        add = _only_reader(users, prog, out, ADD)
        residual = None
        if add is not None:
            other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
            if other == out or prog.values[other].shape != prog.values[out].shape:
                add = None
            else:
                residual = other
        relu = _only_reader(users, prog, add.outputs[0] if add is not None else out, RELU)
        # Two convolutions meeting in one Add (a ResNet block with a downsample): the first folds.
        if relu is None or id(relu) in replace or (add is not None and id(add) in replace):
            continue
        for dropped in (op, add):
            if dropped is not None:
                replace[id(dropped)] = None
        inputs = op.inputs[:3] + ([residual] if residual is not None else [])
        replace[id(relu)] = Op(KIND, op.node, inputs, [relu.outputs[0]], {**op.attrs, "relu": True})
    if not replace:
        return prog
    ops = [replace.get(id(op), op) for op in prog.ops]
    return Program(prog.values, [op for op in ops if op is not None], prog.inputs, prog.outputs)


def geometry(prog: Program, op: Op) -> cudnn_conv.ConvGeometry:
    a = op.attrs
    x, w, y = (prog.values[v].shape for v in (op.inputs[0], op.inputs[1], op.outputs[0]))
    return cudnn_conv.forward_geometry(x, w, y, a["group"], a["pads"], a["pads"], a["strides"], a["dilations"])


def _handle(inst):
    """The EP stream's cuDNN handle, or one of the instance's own (plans built without an EP)."""
    plan = inst.plan
    if plan.ep is not None:
        state = plan.ep.streams.get(inst.stream_ptr)
        if state is not None and state.cudnn is not None:
            return state.cudnn
    own = inst.__dict__.get("_cudnn_handle")
    if own is None:
        search = plan.ep.opts.cudnn_conv_algo_search if plan.ep is not None else "HEURISTIC"
        own = inst._cudnn_handle = cudnn.CudnnHandle(inst.stream_ptr, plan.use_tf32, search)
    return own


def graph_enabled() -> bool:
    """Whether plan convolutions use cuDNN's graph API (EPHOST_CUDNN_GRAPH=0: the legacy calls only)."""
    return os.environ.get("EPHOST_CUDNN_GRAPH", "1") != "0"


def _graph_for(handle, geo, dtype, epilogue: cudnn_graph.Epilogue):
    """The graph with the whole epilogue, else the convolution alone (the tail then runs as legacy
    calls), else None (the legacy calls throughout)."""
    if not graph_enabled():
        return None
    for wanted in (epilogue, cudnn_graph.Epilogue()):
        try:
            return cudnn_graph.build(handle, geo, dtype, wanted)
        except cudnn.CudnnError:
            continue
    return None


class CudnnStep:
    """One cudnn_conv step of a plan instance (see the module docstring)."""

    PACKS = 8  # variant packs kept per step (one per set of the run's own input/output addresses)

    def __init__(self, inst, step, variant):
        op = step.op
        plan = inst.plan
        self.inst = inst
        self.name = step.name
        self.handle = _handle(inst)
        geo = geometry(plan.prog, op)
        dtype = plan.prog.values[op.inputs[0]].dtype
        self.relu = bool(op.attrs.get("relu"))
        bias = op.inputs[2] if len(op.inputs) > 2 else None
        residual = op.inputs[3] if len(op.inputs) > 3 else None
        with plan.cupy.cuda.Device(plan.device_id):
            # The data type is the input's (float32, float16 or bfloat16, as the per-node cuDNN path).
            self.setup = cudnn_conv.setup(self.handle, "forward", geo, dtype)
            # A variant that only captures record never runs eagerly: it needs no graph.
            captured_only = variant is plan.graph and plan.graph is not plan.eager
            self.graph = None if captured_only else _graph_for(
                self.handle, geo, dtype, cudnn_graph.Epilogue(bias is not None, residual is not None, self.relu))
        nbytes = max(self.setup.workspace_bytes, self.graph.workspace_bytes if self.graph else 0)
        self._ws_mem = plan._malloc(nbytes, inst.stream_ptr) if nbytes else None
        self.workspace = int(self._ws_mem.ptr) if nbytes else 0
        self.operands = [inst.address(v, variant) if v is not None else (None, 0)
                         for v in (op.inputs[0], op.inputs[1], op.outputs[0], bias, residual)]
        self.calls = None  # the legacy calls, prepared after their first run (which settles setup.fused_ok)
        self.tail = None  # the legacy calls after a graph of the convolution alone
        self.packs: dict = {}
        self._graph_ran = False
        if self.graph is not None:
            ep = self.graph.epilogue
            # The graph's operands in uid order: x, w, y, then the bias and z where the graph has them.
            self._graph_operands = self.operands[:3] + [self.operands[i] for i, on in ((3, ep.bias),
                                                                                      (4, ep.residual)) if on]
            self._dynamic = [j for j, _ in self._graph_operands if j is not None]
            if ep == cudnn_graph.Epilogue() and self._has_tail():
                self.tail = self._tail_calls()

    def __call__(self) -> None:
        graph = self.graph
        # Eager runs take the graph; captures (and their rehearsal) and the very first run take the
        # legacy calls, whose fused bias + residual + ReLU kernel a replay runs fastest.
        if graph is not None and self.calls is not None and not self.inst.recording:
            ext = self.inst.ext
            key = tuple([ext[j] for j in self._dynamic])
            pack = self.packs.get(key) or self._new_pack(key)
            if pack is not None:
                status = graph.execute(self.handle.raw, pack)
                if status:
                    self._graph_failed(status)
                    return
                self._graph_ran = True
                if self.tail:
                    self._run(self.tail)
                return
        if self.calls is None:
            self._first_run()
        else:
            self._run(self.calls)

    def _run(self, calls) -> None:
        ext = self.inst.ext
        cast = cudnn.ffi.cast
        for fn, args, dynamic in calls:
            if dynamic:
                args = list(args)
                for pos, j in dynamic:
                    args[pos] = cast("void *", ext[j])
            status = fn(*args)
            if status:
                self._failed(status)

    def _has_tail(self) -> bool:
        return self.relu or self.operands[3] != (None, 0) or self.operands[4] != (None, 0)

    def _new_pack(self, key: tuple):
        """The variant pack for this run's addresses (None: one is not aligned; the legacy calls run)."""
        values = iter(key)
        pointers = [next(values) if j is not None else addr for j, addr in self._graph_operands]
        pack = self.graph.pack(pointers, self.workspace)
        if pack is not None:
            if len(self.packs) >= self.PACKS:
                self.packs.pop(next(iter(self.packs)))  # the oldest; its descriptors are destroyed with it
            self.packs[key] = pack
        return pack

    def _graph_failed(self, status: int) -> None:
        """A graph that cuDNN refuses at its first execution is dropped (the legacy calls run, now and
        after: nothing was launched); a failure after it has run is an error."""
        if self._graph_ran:
            self._failed(status)
        self.graph = None
        self.packs.clear()
        self.tail = None
        self()

    def _first_run(self) -> None:
        ext = self.inst.ext
        x, w, y, b, z = (addr if j is None else ext[j] for j, addr in self.operands)
        try:
            cudnn_conv.forward(self.handle, self.setup, x, w, y, self.workspace, bias=b, relu=self.relu, z=z)
        except cudnn.CudnnError as e:
            e.add_note(f"in plan step '{self.name}' (cuDNN convolution)")
            raise
        self.calls = self._prepare()

    def _args(self):
        """(named operand arguments x, w, y, b, z; the ext slots of the named ones)."""
        ffi = cudnn.ffi
        slots = {}

        def arg(name, index):
            j, addr = self.operands[index]
            if j is None:
                return ffi.cast("void *", addr)
            slots.setdefault(name, []).append(j)
            return name

        return [arg(n, i) for i, n in enumerate("xwybz")], slots

    @staticmethod
    def _with_slots(raw_calls, slots) -> list:
        calls = []
        for fn, args in raw_calls:
            dynamic = [(pos, slots[a][0]) for pos, a in enumerate(args) if isinstance(a, str)]
            calls.append((fn, args, dynamic))
        return calls

    def _tail_raw(self, y, b, z) -> list:
        """bias, residual and ReLU after a plain convolution, as legacy calls in place on y."""
        s, lib, raw = self.setup, self.handle.lib, self.handle.raw
        one, zero = cudnn.ONE, cudnn.ZERO
        calls = []
        if self.operands[3] != (None, 0):
            calls.append((lib.cudnnAddTensor, [raw, one, s.bias, b, one, s.y, y]))
        if self.operands[4] != (None, 0):
            calls.append((lib.cudnnAddTensor, [raw, one, s.y, z, one, s.y, y]))
        if self.relu:
            calls.append((lib.cudnnActivationForward, [raw, s.relu(), one, s.y, y, zero, s.y, y]))
        return calls

    def _tail_calls(self) -> list:
        (_, _, y, b, z), slots = self._args()
        return self._with_slots(self._tail_raw(y, b, z), slots)

    def _prepare(self) -> list:
        """The legacy cuDNN calls of a run with every argument fixed but the call's own inputs/outputs:
        [(function, args, [(position, ext index)])], the same calls cudnn_conv.forward makes."""
        s, lib, raw = self.setup, self.handle.lib, self.handle.raw
        one, zero = cudnn.ONE, cudnn.ZERO
        ws = cudnn.ffi.cast("void *", self.workspace) if self.workspace else cudnn.NULL
        (x, w, y, b, z), slots = self._args()
        has_z = self.operands[4] != (None, 0)
        if self.relu and s.fused_ok:
            raw_calls = [(lib.cudnnConvolutionBiasActivationForward,
                          [raw, one, s.x, x, s.w, w, s.conv, s.algo, ws, s.workspace_bytes, one if has_z else zero,
                           s.y, z if has_z else y, s.bias, b, s.relu(), s.y, y])]
        else:
            raw_calls = [(lib.cudnnConvolutionForward,
                          [raw, one, s.x, x, s.w, w, s.conv, s.algo, ws, s.workspace_bytes, zero, s.y, y])]
            raw_calls += self._tail_raw(y, b, z)
        return self._with_slots(raw_calls, slots)

    def _failed(self, status: int) -> None:
        try:
            cudnn.check(status, "cuDNN convolution")
        except cudnn.CudnnError as e:
            e.add_note(f"in plan step '{self.name}' (cuDNN convolution)")
            raise
