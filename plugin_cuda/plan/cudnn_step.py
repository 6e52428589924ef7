"""Compiled-plan convolutions on cuDNN: the lowering's choice, the ReLU / residual folding, the step.

Lowering (lower_conv.py) emits a `cudnn_conv` op instead of the generated direct `conv` when the
convolution is large enough for cuDNN to win (wants_cudnn; docs/compiled_plan.md has the figures)
and cuDNN loads. `fold_epilogues` then takes a ReLU that alone reads the result (and an Add of a
same-shape value before it: ResNet's residual) into the op: cudnnConvolutionBiasActivationForward
computes relu(conv(x, w) + z + bias) in one call. The op has no generated kernel, so its step is
packed by the plan as a CudnnStep: its descriptors and algorithm are made once per plan (shared
by every stream), its workspace once per stream instance; a run reads the operands' addresses
from the plan's cells and makes one or two cuDNN calls (no allocation: capturable).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from plugin_cuda.device import cudnn, cudnn_conv
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


class CudnnStep:
    """One cudnn_conv step of a plan instance (see the module docstring)."""

    def __init__(self, inst, step, variant):
        op = step.op
        plan = inst.plan
        self.inst = inst
        self.name = step.name
        self.handle = _handle(inst)
        geo = geometry(plan.prog, op)
        with plan.cupy.cuda.Device(plan.device_id):
            # The data type is the input's (float32, float16 or bfloat16, as the per-node cuDNN path).
            self.setup = cudnn_conv.setup(self.handle, "forward", geo, plan.prog.values[op.inputs[0]].dtype)
        nbytes = self.setup.workspace_bytes
        self._ws_mem = plan._malloc(nbytes, inst.stream_ptr) if nbytes else None
        self.workspace = int(self._ws_mem.ptr) if nbytes else 0
        self.relu = bool(op.attrs.get("relu"))
        bias = op.inputs[2] if len(op.inputs) > 2 else None
        residual = op.inputs[3] if len(op.inputs) > 3 else None
        self.operands = [inst.address(v, variant) if v is not None else (None, 0)
                         for v in (op.inputs[0], op.inputs[1], op.outputs[0], bias, residual)]
        self.calls = None  # prepared after the first run (which settles setup.fused_ok)

    def __call__(self) -> None:
        calls = self.calls
        if calls is None:
            self._first_run()
            return
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

    def _first_run(self) -> None:
        ext = self.inst.ext
        x, w, y, b, z = (addr if j is None else ext[j] for j, addr in self.operands)
        try:
            cudnn_conv.forward(self.handle, self.setup, x, w, y, self.workspace, bias=b, relu=self.relu, z=z)
        except cudnn.CudnnError as e:
            e.add_note(f"in plan step '{self.name}' (cuDNN convolution)")
            raise
        self.calls = self._prepare()

    def _prepare(self) -> list:
        """The cuDNN calls of a run with every argument fixed but the call's own inputs/outputs:
        [(function, args, [(position, ext index)])], the same calls cudnn_conv.forward makes."""
        s, lib, raw = self.setup, self.handle.lib, self.handle.raw
        ffi, one, zero = cudnn.ffi, cudnn.ONE, cudnn.ZERO
        ws = ffi.cast("void *", self.workspace) if self.workspace else cudnn.NULL
        slots = {}

        def arg(name, index):
            j, addr = self.operands[index]
            if j is None:
                return ffi.cast("void *", addr)
            slots.setdefault(name, []).append(j)
            return name

        x, w, y, b, z = (arg(n, i) for i, n in enumerate("xwybz"))
        has_bias, has_z = self.operands[3] != (None, 0), self.operands[4] != (None, 0)
        if self.relu and s.fused_ok:
            raw_calls = [(lib.cudnnConvolutionBiasActivationForward,
                          [raw, one, s.x, x, s.w, w, s.conv, s.algo, ws, s.workspace_bytes, one if has_z else zero,
                           s.y, z if has_z else y, s.bias, b, s.relu(), s.y, y])]
        else:
            raw_calls = [(lib.cudnnConvolutionForward,
                          [raw, one, s.x, x, s.w, w, s.conv, s.algo, ws, s.workspace_bytes, zero, s.y, y])]
            if has_bias:
                raw_calls.append((lib.cudnnAddTensor, [raw, one, s.bias, b, one, s.y, y]))
            if has_z:
                raw_calls.append((lib.cudnnAddTensor, [raw, one, s.y, z, one, s.y, y]))
            if self.relu:
                raw_calls.append((lib.cudnnActivationForward, [raw, s.relu(), one, s.y, y, zero, s.y, y]))
        calls = []
        for fn, args in raw_calls:
            dynamic = [(pos, slots[a][0]) for pos, a in enumerate(args) if isinstance(a, str)]
            calls.append((fn, args, dynamic))
        return calls

    def _failed(self, status: int) -> None:
        try:
            cudnn.check(status, "cuDNN convolution")
        except cudnn.CudnnError as e:
            e.add_note(f"in plan step '{self.name}' (cuDNN convolution)")
            raise
