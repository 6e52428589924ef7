"""Forward convolutions through cuDNN's graph (backend) API: an execution plan built once, one
`cudnnBackendExecute` per call.

Why (docs/cuda_ops.md, "Convolutions through cuDNN"): cuDNN 9 implements the legacy calls
(`cudnnConvolutionForward`, `cudnnConvolutionBiasActivationForward`) on top of this API and pays
for it on the host at every call: about 190 µs per ResNet-50 convolution on an H200, more than
the GPU needs for most of them, so eager runs were host-bound. An execution plan made at build
time leaves a call with one variant pack (the operands' addresses, made once per address set and
kept) and one execute.

One graph: x, w -> conv (float32 accumulation) [-> + bias] [-> + z] [-> relu] -> y; the
intermediate values are virtual float32 tensors that never reach memory. The engine is the first
of cuDNN's heuristic list (mode A, then its fallback list) whose numerical notes fit the math
(strict float32 refuses tensor-core and down-converting engines, as PyTorch does), whose
workspace is within the limit and whose plan finalizes; `EXHAUSTIVE` times the first few such
plans on scratch tensors and keeps the fastest. Graphs are memoised per (geometry, dtype, math,
search, epilogue, device) and read-only afterwards; variant packs belong to their caller.

Not every epilogue has an engine (cuDNN fuses pointwise tails with runtime-compiled engines,
which may be missing for a layout or type): `build` raises CudnnError and the caller makes the
convolution alone here and the tail with the legacy calls, or the legacy calls throughout.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from plugin_cuda.device import cudnn, cudnn_conv
from plugin_cuda.device.cudnn import CudnnError, check, ffi

__all__ = ["ConvGraph", "Epilogue", "build", "clear", "stats"]

# Enum values from cudnn_graph_v9.h (append-only since cuDNN 8).
D_POINTWISE, D_CONVOLUTION, D_ENGINE, D_ENGINECFG, D_ENGINEHEUR, D_EXECUTION_PLAN = 0, 1, 2, 3, 4, 5
D_OP_CONV_FORWARD, D_OP_POINTWISE, D_OPERATION_GRAPH, D_VARIANT_PACK, D_TENSOR = 10, 13, 15, 16, 17
T_HANDLE, T_DATA_TYPE, T_BOOLEAN, T_INT64, T_FLOAT, T_VOID_PTR = 0, 1, 2, 3, 4, 6
T_CONV_MODE, T_HEUR_MODE, T_NUMERICAL_NOTE, T_POINTWISE_MODE, T_DESCRIPTOR = 7, 8, 11, 14, 15
A_PW_MODE, A_PW_MATH_PREC = 0, 1
A_CONV_COMP_TYPE, A_CONV_MODE, A_CONV_DILATIONS, A_CONV_STRIDES = 100, 101, 102, 103
A_CONV_POST_PADDINGS, A_CONV_PRE_PADDINGS, A_CONV_SPATIAL_DIMS = 104, 105, 106
A_HEUR_MODE, A_HEUR_GRAPH, A_HEUR_RESULTS = 200, 201, 202
A_CFG_ENGINE = 300
A_PLAN_HANDLE, A_PLAN_CONFIG, A_PLAN_WORKSPACE = 400, 401, 402
A_FWD_ALPHA, A_FWD_BETA, A_FWD_CONV, A_FWD_W, A_FWD_X, A_FWD_Y = 700, 701, 702, 703, 704, 705
A_PWOP_DESC, A_PWOP_X, A_PWOP_B, A_PWOP_Y = 750, 751, 752, 753
A_GRAPH_HANDLE, A_GRAPH_OPS = 800, 801
A_T_ALIGNMENT, A_T_DATA_TYPE, A_T_DIMS, A_T_STRIDES, A_T_UID, A_T_VIRTUAL = 900, 901, 902, 903, 906, 907
A_VP_UIDS, A_VP_POINTERS, A_VP_WORKSPACE = 1000, 1001, 1003
A_ENGINE_NUMERICAL_NOTE = 1303
HEUR_MODE_FALLBACK, HEUR_MODE_A = 2, 3
PW_ADD, PW_RELU = 0, 100
NOTE_TENSOR_CORE, NOTE_DOWN_CONVERT_INPUTS = 0, 1

# Operands' unique ids, in the order of ConvGraph.uids; virtual tensors count on from 100.
UID_X, UID_W, UID_Y, UID_BIAS, UID_Z = 1, 2, 3, 4, 5
# What the real tensors' addresses are promised to be aligned to (checked per variant pack).
ALIGNMENT = 16
WORKSPACE_LIMIT = 256 << 20
EXHAUSTIVE_CANDIDATES = 6
stats = {"built": 0, "refused": 0, "packs": 0}


@dataclass(frozen=True)
class Epilogue:
    """What follows the convolution inside the graph: + bias (per output channel), + z (y's shape), relu."""

    bias: bool = False
    residual: bool = False
    relu: bool = False


class Descriptors(cudnn_conv.Descriptors):
    """Backend descriptors made, set and finalized together, destroyed with this object."""

    def make(self, kind: int):
        box = ffi.new("cudnnBackendDescriptor_t *")
        check(self.lib.cudnnBackendCreateDescriptor(kind, box), f"cudnnBackendCreateDescriptor({kind})")
        self._owned.append(("cudnnBackendDestroyDescriptor", box[0]))
        return box[0]

    def set(self, desc, attr: int, kind: int, ctype: str, values) -> None:
        values = list(values)
        array = ffi.new(f"{ctype}[]", values)
        check(self.lib.cudnnBackendSetAttribute(desc, attr, kind, len(values), array),
              f"cudnnBackendSetAttribute({attr})")

    def finalize(self, desc, what: str) -> None:
        check(self.lib.cudnnBackendFinalize(desc), f"cudnnBackendFinalize ({what})")

    def close(self) -> None:
        self._finalizer()


def _tensor(d: Descriptors, uid: int, shape, code: int, virtual: bool = False):
    t = d.make(D_TENSOR)
    d.set(t, A_T_DATA_TYPE, T_DATA_TYPE, "int", [code])
    d.set(t, A_T_DIMS, T_INT64, "int64_t", shape)
    d.set(t, A_T_STRIDES, T_INT64, "int64_t", cudnn_conv.packed_strides(shape))
    d.set(t, A_T_UID, T_INT64, "int64_t", [uid])
    d.set(t, A_T_ALIGNMENT, T_INT64, "int64_t", [ALIGNMENT])
    if virtual:
        d.set(t, A_T_VIRTUAL, T_BOOLEAN, "bool", [True])
    d.finalize(t, f"tensor {uid} {tuple(shape)}")
    return t


def _convolution(d: Descriptors, geo):
    c = d.make(D_CONVOLUTION)
    n = len(geo.pads)
    d.set(c, A_CONV_COMP_TYPE, T_DATA_TYPE, "int", [cudnn.CUDNN_DATA_FLOAT])
    d.set(c, A_CONV_MODE, T_CONV_MODE, "int", [cudnn.CUDNN_CROSS_CORRELATION])
    d.set(c, A_CONV_SPATIAL_DIMS, T_INT64, "int64_t", [n])
    d.set(c, A_CONV_DILATIONS, T_INT64, "int64_t", geo.dilations)
    d.set(c, A_CONV_STRIDES, T_INT64, "int64_t", geo.strides)
    d.set(c, A_CONV_PRE_PADDINGS, T_INT64, "int64_t", geo.pads)
    d.set(c, A_CONV_POST_PADDINGS, T_INT64, "int64_t", geo.pads)
    d.finalize(c, f"convolution {geo}")
    return c


def _conv_op(d: Descriptors, x, w, y, conv):
    op = d.make(D_OP_CONV_FORWARD)
    d.set(op, A_FWD_X, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [x])
    d.set(op, A_FWD_W, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [w])
    d.set(op, A_FWD_Y, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [y])
    d.set(op, A_FWD_CONV, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [conv])
    d.set(op, A_FWD_ALPHA, T_FLOAT, "float", [1.0])
    d.set(op, A_FWD_BETA, T_FLOAT, "float", [0.0])
    d.finalize(op, "convolution forward operation")
    return op


def _pointwise(d: Descriptors, mode: int, x, y, b=None):
    pw = d.make(D_POINTWISE)
    d.set(pw, A_PW_MODE, T_POINTWISE_MODE, "int", [mode])
    d.set(pw, A_PW_MATH_PREC, T_DATA_TYPE, "int", [cudnn.CUDNN_DATA_FLOAT])
    d.finalize(pw, f"pointwise mode {mode}")
    op = d.make(D_OP_POINTWISE)
    d.set(op, A_PWOP_DESC, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [pw])
    d.set(op, A_PWOP_X, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [x])
    if b is not None:
        d.set(op, A_PWOP_B, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [b])
    d.set(op, A_PWOP_Y, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [y])
    d.finalize(op, f"pointwise operation mode {mode}")
    return op


def operations(d: Descriptors, geo, dtype, epilogue: Epilogue) -> tuple:
    """(operation descriptors, uids of the real tensors in operand order) of the graph."""
    code = cudnn.data_type(dtype)
    x = _tensor(d, UID_X, geo.x_shape, code)
    w = _tensor(d, UID_W, geo.w_shape, code)
    y = _tensor(d, UID_Y, geo.y_shape, code)
    tail = [(PW_ADD, UID_BIAS, (1, geo.y_shape[1]) + (1,) * (len(geo.y_shape) - 2))] if epilogue.bias else []
    if epilogue.residual:
        tail.append((PW_ADD, UID_Z, geo.y_shape))
    if epilogue.relu:
        tail.append((PW_RELU, None, None))
    virtual = iter(range(100, 100 + len(tail)))

    def result(last: bool):
        return y if last else _tensor(d, next(virtual), geo.y_shape, cudnn.CUDNN_DATA_FLOAT, virtual=True)

    cur = result(not tail)
    ops = [_conv_op(d, x, w, cur, _convolution(d, geo))]
    for i, (mode, uid, shape) in enumerate(tail):
        out = result(i == len(tail) - 1)
        b = None if uid is None else _tensor(d, uid, shape, code)
        ops.append(_pointwise(d, mode, cur, out, b))
        cur = out
    return ops, _uids(epilogue)


def _graph(d: Descriptors, handle_raw, ops):
    g = d.make(D_OPERATION_GRAPH)
    d.set(g, A_GRAPH_HANDLE, T_HANDLE, "cudnnHandle_t", [handle_raw])
    d.set(g, A_GRAPH_OPS, T_DESCRIPTOR, "cudnnBackendDescriptor_t", ops)
    d.finalize(g, "operation graph")
    return g


def _get_descriptors(d: Descriptors, desc, attr: int, count: int, kind: int) -> list:
    """`count` new descriptors of `kind` filled by cudnnBackendGetAttribute(desc, attr)."""
    out = [d.make(kind) for _ in range(count)]
    got = ffi.new("int64_t *")
    array = ffi.new("cudnnBackendDescriptor_t[]", out)
    check(d.lib.cudnnBackendGetAttribute(desc, attr, T_DESCRIPTOR, count, got, array),
          f"cudnnBackendGetAttribute({attr})")
    return out[:int(got[0])]


def engine_configs(d: Descriptors, graph) -> list:
    """cuDNN's engine configurations for `graph`: heuristic mode A's list, then its fallback list."""
    configs = []
    for mode in (HEUR_MODE_A, HEUR_MODE_FALLBACK):
        heur = d.make(D_ENGINEHEUR)
        d.set(heur, A_HEUR_GRAPH, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [graph])
        d.set(heur, A_HEUR_MODE, T_HEUR_MODE, "int", [mode])
        if d.lib.cudnnBackendFinalize(heur):
            continue  # this mode has nothing for the graph: the other may
        count = ffi.new("int64_t *")
        check(d.lib.cudnnBackendGetAttribute(heur, A_HEUR_RESULTS, T_DESCRIPTOR, 0, count, ffi.NULL),
              "cudnnBackendGetAttribute(heuristic results count)")
        if count[0]:
            configs += _get_descriptors(d, heur, A_HEUR_RESULTS, int(count[0]), D_ENGINECFG)
    return configs


def numerical_notes(d: Descriptors, config) -> set:
    engine = _get_descriptors(d, config, A_CFG_ENGINE, 1, D_ENGINE)
    if not engine:
        return set()
    notes = ffi.new("int[]", 16)
    got = ffi.new("int64_t *")
    if d.lib.cudnnBackendGetAttribute(engine[0], A_ENGINE_NUMERICAL_NOTE, T_NUMERICAL_NOTE, 16, got, notes):
        return set()
    return set(notes[0:int(got[0])])


def math_allows(notes: set, dtype, use_tf32: bool) -> bool:
    """Strict float32 refuses tensor-core and down-converting engines (TF32); half types take any."""
    if np.dtype(dtype).name == "float32" and not use_tf32:
        return not notes & {NOTE_TENSOR_CORE, NOTE_DOWN_CONVERT_INPUTS}
    return True


def _plan(d: Descriptors, handle_raw, config):
    """(execution plan, workspace bytes), or None when cuDNN cannot finalize it."""
    plan = d.make(D_EXECUTION_PLAN)
    d.set(plan, A_PLAN_HANDLE, T_HANDLE, "cudnnHandle_t", [handle_raw])
    d.set(plan, A_PLAN_CONFIG, T_DESCRIPTOR, "cudnnBackendDescriptor_t", [config])
    if d.lib.cudnnBackendFinalize(plan):
        return None
    size = ffi.new("int64_t[1]")
    got = ffi.new("int64_t *")
    check(d.lib.cudnnBackendGetAttribute(plan, A_PLAN_WORKSPACE, T_INT64, 1, got, size),
          "cudnnBackendGetAttribute(workspace size)")
    return plan, int(size[0])


def candidates(d: Descriptors, handle_raw, graph, dtype, use_tf32: bool, limit: int):
    """Finalized (plan, workspace, numerical notes) in cuDNN's order, at most `limit`."""
    found = []
    for config in engine_configs(d, graph):
        notes = numerical_notes(d, config)
        if not math_allows(notes, dtype, use_tf32):
            continue
        made = _plan(d, handle_raw, config)
        if made is not None and made[1] <= WORKSPACE_LIMIT:
            found.append((*made, notes))
            if len(found) >= limit:
                break
    return found


class ConvGraph:
    """A finalized execution plan with what a call needs: uids, workspace size (see the module doc)."""

    def __init__(self, descriptors: Descriptors, plan, workspace_bytes: int, uids: tuple, epilogue: Epilogue,
                 seconds: float = 0.0, notes: frozenset = frozenset()):
        self.descriptors = descriptors
        self.lib = descriptors.lib
        self.plan = plan
        self.workspace_bytes = workspace_bytes
        self.uids = uids
        self.epilogue = epilogue
        self.build_seconds = seconds
        self.notes = notes  # the engine's numerical notes (NOTE_TENSOR_CORE, ...)

    def pack(self, pointers, workspace: int) -> Descriptors | None:
        """A variant pack binding `pointers` (one per uid) and the workspace, owned by the caller;
        None when an address is not aligned as promised (the caller runs the legacy calls)."""
        return variant_pack(self.lib, self.uids, pointers, workspace)

    def execute(self, handle_raw, pack: Descriptors) -> int:
        """The status of cudnnBackendExecute (0: launched on the handle's stream)."""
        return self.lib.cudnnBackendExecute(handle_raw, self.plan, pack.raw)


def _scratch(geo, dtype, epilogue: Epilogue, workspace: int) -> tuple:
    import cupy

    item = np.dtype(dtype).itemsize
    shapes = [geo.x_shape, geo.w_shape, geo.y_shape]
    if epilogue.bias:
        shapes.append((geo.y_shape[1],))
    if epilogue.residual:
        shapes.append(geo.y_shape)
    arrays = [cupy.zeros(math.prod(s) * item, np.uint8) for s in shapes]
    return arrays, cupy.empty(max(workspace, 1), np.uint8)


def _fastest(handle, found, geo, dtype, epilogue: Epilogue):
    """The candidate with the least time over three runs on scratch tensors (synchronises: build time
    only, never while capturing)."""
    import cupy

    arrays, ws = _scratch(geo, dtype, epilogue, max(f[1] for f in found))
    pointers = [int(a.data.ptr) for a in arrays]
    best, best_ms = found[0], float("inf")
    stream = cupy.cuda.ExternalStream(handle.stream_ptr or 0)
    for candidate in found:
        plan = candidate[0]
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        try:
            pack = variant_pack(handle.lib, _uids(epilogue), pointers, int(ws.data.ptr))
            if pack is None:  # CuPy's blocks are aligned: not expected
                continue
            for i in range(4):
                if i == 1:
                    start.record(stream)
                check(handle.lib.cudnnBackendExecute(handle.raw, plan, pack.raw), "cudnnBackendExecute (search)")
            end.record(stream)
            end.synchronize()
        except CudnnError:
            continue
        ms = cupy.cuda.get_elapsed_time(start, end)
        if ms < best_ms:
            best, best_ms = candidate, ms
    return best


def variant_pack(lib, uids: tuple, pointers, workspace: int) -> Descriptors | None:
    """The variant pack of ConvGraph.pack (its `raw` descriptor), or None for an unaligned address."""
    if any(p % ALIGNMENT for p in pointers):
        return None
    d = Descriptors(lib)
    vp = d.make(D_VARIANT_PACK)
    d.set(vp, A_VP_UIDS, T_INT64, "int64_t", uids)
    d.set(vp, A_VP_POINTERS, T_VOID_PTR, "void *", [ffi.cast("void *", p) for p in pointers])
    d.set(vp, A_VP_WORKSPACE, T_VOID_PTR, "void *", [ffi.cast("void *", workspace)])
    d.finalize(vp, "variant pack")
    d.raw = vp
    stats["packs"] += 1
    return d


def _uids(epilogue: Epilogue) -> tuple:
    uids = [UID_X, UID_W, UID_Y]
    if epilogue.bias:
        uids.append(UID_BIAS)
    if epilogue.residual:
        uids.append(UID_Z)
    return tuple(uids)


def make(handle, geo, dtype, epilogue: Epilogue, search: str | None = None) -> ConvGraph:
    """A new ConvGraph (not memoised; `build` is); CudnnError when no engine takes the graph."""
    start = time.perf_counter()
    lib = handle.lib
    search = search or handle.algo_search
    d = Descriptors(lib)
    ops, uids = operations(d, geo, dtype, epilogue)
    graph = _graph(d, handle.raw, ops)
    exhaustive = search == "EXHAUSTIVE" and not cudnn_conv.capturing(handle.stream_ptr or 0)
    found = candidates(d, handle.raw, graph, dtype, handle.use_tf32, EXHAUSTIVE_CANDIDATES if exhaustive else 1)
    if not found:
        stats["refused"] += 1
        raise CudnnError(f"cuDNN has no engine for convolution {geo} {np.dtype(dtype).name} with {epilogue} "
                         f"(tf32={handle.use_tf32})")
    plan, workspace, notes = _fastest(handle, found, geo, dtype, epilogue) if exhaustive and len(found) > 1 else found[0]
    stats["built"] += 1
    return ConvGraph(d, plan, workspace, uids, epilogue, time.perf_counter() - start, frozenset(notes))


_graphs: dict = {}
_lock = threading.Lock()
_LIMIT = 1024


def build(handle, geo, dtype, epilogue: Epilogue) -> ConvGraph:
    """The memoised ConvGraph of (geometry, dtype, the handle's math and search, epilogue, device);
    a refusal is remembered too (CudnnError each time, without asking cuDNN again)."""
    import cupy

    key = (geo, np.dtype(dtype).name, handle.use_tf32, handle.algo_search, epilogue, cupy.cuda.runtime.getDevice())
    got = _graphs.get(key)
    if got is None:
        with _lock:
            got = _graphs.get(key)
            if got is None:
                try:
                    got = make(handle, geo, dtype, epilogue)
                except CudnnError as e:
                    got = e
                if len(_graphs) >= _LIMIT:  # dynamic shapes must not grow this without bound
                    _graphs.clear()
                _graphs[key] = got
    if isinstance(got, CudnnError):
        raise CudnnError(str(got), got.status)
    return got


def clear() -> None:
    with _lock:
        _graphs.clear()
