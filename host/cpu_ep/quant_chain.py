"""Quantized nodes in a row run as one compiled call (fusion.py's chains; native/kernels_quant_chain.c).

A model quantized by onnxruntime's quantizer runs, at one row, a few microseconds of arithmetic per node and
several more of Python around it (the run loop's step, the parameter memo, cffi pointers, the output array).
A run of consecutive quantized nodes whose inner values nothing else reads (QuantizeLinear -> QLinearConv ->
MaxPool -> ... -> DequantizeLinear) becomes one step: at its first run for an input shape the nodes run one
by one, as before, and their values' shapes and types, with each kernel's own bound parameters, are written
into a program of records; later runs of that shape are one call of `ep_quant_chain`, which does each node's
NumPy-path operations in their order and precision (the same bits). A node the program cannot express for
that shape (a per-axis activation, a 16-bit type, a product beyond the compiled bounds) makes the whole chain
run its nodes one by one for that shape, as does a call that declines (a NaN or an infinity reaching
DynamicQuantizeLinear) for that run.

quantize_dynamic's graphs put float32 ops between the integer ones (Cast, Mul by the scales, Add of the bias,
Relu, MaxPool, Softmax): a chain takes those too, but only around quantized nodes (a run of them alone is left
to fusion.py's float chains). Only parameters that are initializers are written into a program (a node with a
fed scale is not joined).
"""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.fusion import _fused, run_one_by_one
from host.cpu_ep.ops_quant import COMPILED_MAX_MACS, F32, Saturate, centered_int16, columns, compiled_requant
from host.cpu_ep.ops_quant_ms import add_operands, compiled_operands

QC_WORDS, QC_FLOATS = 32, 8  # kernels_quant_chain.c's record
(QUANTIZE, DEQUANTIZE, CONV, MAXPOOL, ADD, GLOBAL_AVG, MATMUL, SOFTMAX, COPY, DYNAMIC_QUANTIZE, BINARY, RELU, CAST,
 SOFTMAX_F32, DYNAMIC_MATMUL, MAXPOOL_F32) = range(1, 17)
_SLOT_SHIFT = 56
_IN_SLOTS, _OUT_SLOT, _SCRATCH_SLOT = 4, 4, 5  # the call's buffers: inputs 0..3, the output, the inner values
_BYTE_KINDS = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1}
# A convolution's multiply-adds up to which the chain takes it: beyond, the NumPy path's BLAS-backed kernel is as
# fast (the 64x64 CNN's first layer, 0.9M: 230 us a run either way here) and its nodes run one by one.
CONV_MAX_MACS = 1 << 19
_ALIGN = 64

ENABLED = True  # False: no chain is joined (tests compare against the nodes one by one)


class _Program:
    """The records of one chain for one input signature, and the arrays their addresses point into."""

    def __init__(self, places: dict):
        self.places = places  # value id -> reference (slot or address) of every value the chain reads
        self.words: list[list[int]] = []
        self.floats: list[list[float]] = []
        self.held: list = []  # arrays (and pointers) whose addresses the records hold

    def ref(self, vid: int) -> int:
        return self.places[vid]

    def address(self, array: np.ndarray) -> int:
        """The address of a constant contiguous array, kept alive with the program."""
        array = np.ascontiguousarray(array)
        pointer = native.ptr(array)
        self.held.append(pointer)
        return int(native.ffi.cast("intptr_t", pointer))

    def pointer(self, pointer) -> int:
        """The address behind a cffi pointer a kernel made (it keeps its array alive)."""
        self.held.append(pointer)
        return int(native.ffi.cast("intptr_t", pointer))

    def emit(self, code: int, words, floats=()) -> bool:
        self.words.append([code, *(int(w) for w in words)])
        self.floats.append([float(f) for f in floats])
        return True


def _slot(slot: int, offset: int = 0) -> int:
    return (slot + 1) << _SLOT_SHIFT | offset


def _data_ref(prog: _Program, vid: int, array: np.ndarray, constants: dict) -> int:
    return prog.address(constants[vid]) if vid in constants else prog.ref(vid)


def _scalar_zp(sat: Saturate) -> float | None:
    """The output zero point as a float, or None where it is not one value."""
    zp = sat.zero_point
    if zp is not None and zp.ndim:
        return None
    return 0.0 if zp is None else float(zp)


# -- per op: records for one node at its first run's values (False: the chain does not take it) --------------


def _quantize(prog, node, args, outs, constants) -> bool:
    kernel, (x, y_scale, y_zp) = node.kernel, (list(args) + [None])[:3]
    if x.dtype != F32 or y_scale.dtype != F32:
        return False
    fast = kernel.derived((1, 2), (y_scale, y_zp), kernel._per_tensor)
    if fast is None or fast[1].kind is None or _scalar_zp(fast[1]) is None:
        return False
    scale, sat = fast
    return prog.emit(QUANTIZE, (prog.ref(node.inputs[0]), prog.ref(node.outputs[0]), x.size, sat.kind),
                     (scale, _scalar_zp(sat), sat.lo, sat.hi))


def _dequantize(prog, node, args, outs, constants) -> bool:
    kernel, (x, x_scale, x_zp) = node.kernel, (list(args) + [None])[:3]
    kind = _BYTE_KINDS.get(x.dtype)
    fast = kernel.derived((1, 2), (x_scale, x_zp), kernel._per_tensor) if kind is not None else None
    if fast is None:
        return False
    return prog.emit(DEQUANTIZE, (prog.ref(node.inputs[0]), kind, x.size, prog.ref(node.outputs[0])), fast)


def _conv(prog, node, args, outs, constants) -> bool:
    """QLinearConv: the exact product, the bias, the requantization."""
    kernel = node.kernel
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias = (list(args) + [None] * 9)[:9]
    if bias is not None and (bias.dtype != np.int32 or bias.size != w.shape[0]):
        return False
    geometry = _conv_geometry(kernel.conv, x, x_zp, w)
    if geometry is None:
        return False
    m = w.shape[0]
    _, requant = kernel.output_params(x_scale, w_scale, y_scale, y_zp, bias, x.ndim)
    sat = requant.saturate
    if sat.kind not in (0, 1) or _scalar_zp(sat) is None or requant.multiplier.size not in (1, m):
        return False
    centered = _centered_filters(w, w_zp)
    if centered is None:
        return False
    x_zp_value = 0 if x_zp is None else int(np.asarray(x_zp).reshape(()))
    words = (prog.ref(node.inputs[0]), _BYTE_KINDS[x.dtype], x_zp_value, prog.address(centered),
             0 if bias is None else prog.address(bias.astype(np.int32)), prog.address(columns(requant.multiplier, m)),
             prog.ref(node.outputs[0]), sat.kind, *geometry, 0)
    return prog.emit(CONV, words, (_scalar_zp(sat), sat.lo, sat.hi))


def _conv_integer(prog, node, args, outs, constants) -> bool:
    """ConvInteger: the exact int32 product; x's zero point an initializer or a value of the chain."""
    x, w, x_zp, w_zp = (list(args) + [None] * 4)[:4]
    geometry = _conv_geometry(node.kernel.conv, x, x_zp, w)
    centered = _centered_filters(w, w_zp) if geometry is not None else None
    if centered is None or outs[0].dtype != np.int32 or (x_zp is not None and x_zp.dtype != x.dtype):
        return False
    zp_vid = node.inputs[2] if len(node.inputs) > 2 else -1
    in_chain = zp_vid >= 0 and zp_vid not in constants
    x_zp_value = 0 if x_zp is None or in_chain else int(np.asarray(x_zp).reshape(()))
    words = (prog.ref(node.inputs[0]), _BYTE_KINDS[x.dtype], x_zp_value, prog.address(centered), 0, 0,
             prog.ref(node.outputs[0]), 4, *geometry, prog.ref(zp_vid) if in_chain else 0)
    return prog.emit(CONV, words)


def _conv_geometry(conv, x, x_zp, w) -> tuple | None:
    """(N, C, H, W, M, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW, G) of a 2-D convolution of 8-bit x by 8-bit w
    that the chain's loops take (a per-tensor x zero point, an int32 accumulator, at most CONV_MAX_MACS), else
    None."""
    if (x.dtype not in _BYTE_KINDS or w.dtype not in _BYTE_KINDS or x.ndim != 4 or w.ndim != 4
            or np.size(x_zp) > 1):
        return None
    g, strides, dilations = conv._params(x, w.shape[2:])
    group = conv.group
    n, c, h, wd = x.shape
    m, k = w.shape[0], math.prod(w.shape[1:])
    if c != w.shape[1] * group or m % group or k * 255 * 255 >= 1 << 31:
        return None
    if m * k * math.prod(g.out) * n > CONV_MAX_MACS:
        return None
    return (n, c, h, wd, m, *w.shape[2:], *strides, *g.begin, *dilations, *g.out, group)


def _centered_filters(w: np.ndarray, w_zp) -> np.ndarray | None:
    """The (M, K) filters minus their per-tensor or per-output-channel zero point, as int16 (exact)."""
    m = w.shape[0]
    zp = np.zeros(1, np.int16) if w_zp is None else np.asarray(w_zp)
    if zp.size not in (1, m):
        return None
    return (w.reshape(m, -1).astype(np.int16) - zp.reshape(-1, 1).astype(np.int16)).astype(np.int16)


def _maxpool(prog, node, args, outs, constants) -> bool:
    """MaxPool of 8-bit codes, or of float32 values in the kernel's own order of maxima (its tiling decision)."""
    kernel, x = node.kernel, args[0]
    kind = _BYTE_KINDS.get(x.dtype, 4 if x.dtype == F32 else None)
    if kind is None or x.ndim != 4 or len(outs) != 1 or kernel.want_indices or len(kernel.kernel_shape) != 2:
        return False
    g, strides, dilations = kernel._params(x, kernel.kernel_shape)
    n, c, h, w = x.shape
    words = (prog.ref(node.inputs[0]), kind, n * c, h, w, *kernel.kernel_shape, *strides, *g.begin, *dilations,
             *g.out, prog.ref(node.outputs[0]))
    if kind == 4:
        return prog.emit(MAXPOOL_F32, (*words, int(kernel._tiles(x))))
    return prog.emit(MAXPOOL, words)


def _add(prog, node, args, outs, constants) -> bool:
    kernel = node.kernel
    a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp = (list(args) + [None] * 8)[:8]
    ratio_a, ratio_b, fixed, sat = kernel.derived((1, 2, 4, 5, 6, 7), (a_scale, a_zp, b_scale, b_zp, c_scale, c_zp),
                                                  kernel._params)
    if c_zp is None and sat.dtype != a.dtype:
        sat = Saturate(None, a.dtype)
    kinds = add_operands(a, b, sat)
    if kinds is None:
        return False
    a_kind, b_kind, period = kinds
    words = (prog.ref(node.inputs[0]), a_kind, a.size, _data_ref(prog, node.inputs[3], b, constants), b_kind,
             period, prog.ref(node.outputs[0]), sat.kind)
    return prog.emit(ADD, words, (ratio_a, ratio_b, fixed, sat.lo, sat.hi))


def _global_avg(prog, node, args, outs, constants) -> bool:
    kernel = node.kernel
    x, x_scale, x_zp, y_scale, y_zp = (list(args) + [None] * 5)[:5]
    kind = _BYTE_KINDS.get(x.dtype)
    if kind is None or kernel.channels_last or x.ndim < 3 or np.size(x_zp) > 1:
        return False
    size = math.prod(x.shape[2:])
    zp_sum, requant = kernel.size_params(x_scale, x_zp, y_scale, y_zp, size, x.dtype)
    sat = requant.saturate
    if sat.kind not in (0, 1) or _scalar_zp(sat) is None or requant.multiplier.ndim:
        return False
    words = (prog.ref(node.inputs[0]), kind, x.shape[0] * x.shape[1], size, int(zp_sum), prog.ref(node.outputs[0]),
             sat.kind)
    return prog.emit(GLOBAL_AVG, words, (requant.multiplier, _scalar_zp(sat), sat.lo, sat.hi))


def _matmul(prog, node, args, outs, constants) -> bool:
    kernel = node.kernel
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = args[:8]
    kind = _BYTE_KINDS.get(a.dtype)
    if kind is None or not a.ndim or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        return False
    k, n = b.shape
    m = a.size // k if k else 0
    if not m or m * k * n > COMPILED_MAX_MACS:
        return False
    out = kernel.derived((3, 5, 1, 2, 4, 6, 7), (b, b_zp, a_scale, a_zp, b_scale, y_scale, y_zp), compiled_requant)
    if out is None:
        return False
    centered, a_zp_value, mult, y_zp_value, sat = out
    words = (prog.ref(node.inputs[0]), kind, m, k, a_zp_value, prog.pointer(centered), n, prog.pointer(mult),
             prog.ref(node.outputs[0]), sat.kind, 0)
    return prog.emit(MATMUL, words, (y_zp_value, sat.lo, sat.hi))


def _gemm(prog, node, args, outs, constants) -> bool:
    kernel = node.kernel
    a, a_scale, a_zp, b, b_scale, b_zp, c, y_scale, y_zp = (list(args) + [None] * 9)[:9]
    kind = _BYTE_KINDS.get(a.dtype)
    if kind is None or y_scale is None or kernel.trans_a or a.ndim != 2 or b.ndim != 2 or np.size(a_zp) > 1:
        return False
    bt = b.T if kernel.trans_b else b
    (m, k), n = a.shape, bt.shape[1]
    if bt.shape[0] != k or not m or m * k * n > COMPILED_MAX_MACS:
        return False
    if c is not None and (c.dtype != np.int32 or c.size != n or c.shape[-1] != n or c.ndim > 2):
        return False
    _, _, requant = kernel.derived((1, 4, 6, 7, 8), (a_scale, b_scale, c, y_scale, y_zp), kernel._output)
    sat = requant.saturate
    centered = centered_int16(np.ascontiguousarray(bt), None if b_zp is None else np.asarray(b_zp).reshape(-1))
    if centered is None or sat.kind not in (0, 1) or _scalar_zp(sat) is None or requant.multiplier.size not in (1, n):
        return False
    a_zp_value = 0 if a_zp is None else int(np.asarray(a_zp).reshape(()))
    words = (prog.ref(node.inputs[0]), kind, m, k, a_zp_value, prog.address(centered), n,
             prog.address(columns(requant.multiplier, n)), prog.ref(node.outputs[0]), sat.kind,
             0 if c is None else prog.address(c.reshape(-1)))
    return prog.emit(MATMUL, words, (_scalar_zp(sat), sat.lo, sat.hi))


def _softmax(prog, node, args, outs, constants) -> bool:
    kernel = node.kernel
    x, x_scale, x_zp, y_scale, y_zp = (list(args) + [None] * 5)[:5]
    kind = _BYTE_KINDS.get(x.dtype)
    if kind is None or not x.ndim or not x.size:
        return False
    axis = kernel.axis % x.ndim if -x.ndim <= kernel.axis < x.ndim else None
    if axis is None or (axis != x.ndim - 1 and not kernel.flatten):
        return False
    n = math.prod(x.shape[axis:])
    _, steps, sat, table_ptr = kernel.derived((1, 2, 3, 4), (x_scale, x_zp, y_scale, y_zp), kernel._params)
    if y_zp is None and sat.dtype != x.dtype:
        sat = Saturate(None, x.dtype)
    if table_ptr is None or sat.kind not in (0, 1) or _scalar_zp(sat) is None:
        return False
    words = (prog.ref(node.inputs[0]), kind, x.size // n, n, prog.pointer(table_ptr), prog.ref(node.outputs[0]),
             sat.kind)
    return prog.emit(SOFTMAX, words, (steps, _scalar_zp(sat), sat.lo, sat.hi))


def _dynamic_quantize(prog, node, args, outs, constants) -> bool:
    x = args[0]
    if x.dtype != F32 or len(node.outputs) != 3 or min(node.outputs) < 0:
        return False
    y, scale, zp = node.outputs
    return prog.emit(DYNAMIC_QUANTIZE, (prog.ref(node.inputs[0]), x.size, prog.ref(y), prog.ref(scale), prog.ref(zp)))


def _binary(code: int):
    """Add (1) or Mul (2) of two float32 operands broadcast to the output's shape (rank <= 6)."""

    def record(prog, node, args, outs, constants) -> bool:
        (a, b), y = args[:2], outs[0]
        if a.dtype != F32 or b.dtype != F32 or y.dtype != F32 or y.ndim > 6:
            return False
        refs = [_data_ref(prog, v, arr, constants) for v, arr in zip(node.inputs, (a, b))]
        dims = (1,) * (6 - y.ndim) + y.shape
        strides = [_element_strides(arr, dims) for arr in (a, b)]
        return prog.emit(BINARY, (code, *refs, prog.ref(node.outputs[0]), *dims, *strides[0], *strides[1]))

    return record


def _element_strides(array: np.ndarray, dims: tuple) -> tuple:
    """The element strides of a contiguous `array` broadcast to `dims` (0 along the axes it repeats on)."""
    shape = (1,) * (len(dims) - array.ndim) + array.shape
    strides, step = [0] * len(dims), 1
    for axis in range(len(dims) - 1, -1, -1):
        strides[axis] = step if shape[axis] != 1 else 0
        step *= shape[axis]
    return tuple(strides)


def _relu(prog, node, args, outs, constants) -> bool:
    if args[0].dtype != F32:
        return False
    return prog.emit(RELU, (prog.ref(node.inputs[0]), prog.ref(node.outputs[0]), args[0].size))


_CAST_KINDS = {**_BYTE_KINDS, np.dtype(np.int32): 4}


def _cast(prog, node, args, outs, constants) -> bool:
    kind = _CAST_KINDS.get(args[0].dtype)
    if kind is None or outs[0].dtype != F32:
        return False
    return prog.emit(CAST, (prog.ref(node.inputs[0]), kind, args[0].size, prog.ref(node.outputs[0])))


def _softmax_f32(prog, node, args, outs, constants) -> bool:
    """Softmax where its kernel takes ep_softmax (float32 rows over the last axis, or the opset < 13 tail)."""
    kernel, x = node.kernel, args[0]
    if x.dtype != F32 or not x.size or not -x.ndim <= kernel.axis < x.ndim:
        return False
    axis = kernel.axis % x.ndim
    n = math.prod(x.shape[axis:])
    if n >= 1 << 31 or (axis != x.ndim - 1 and not kernel.legacy):
        return False
    return prog.emit(SOFTMAX_F32, (prog.ref(node.inputs[0]), prog.ref(node.outputs[0]), x.size // n, n))


def _dynamic_matmul(prog, node, args, outs, constants) -> bool:
    """DynamicQuantizeMatMul where its kernel takes ep_dynamic_qmatmul (ops_quant_ms: the same conditions)."""
    kernel = node.kernel
    a, b, b_scale, b_zp, bias = (list(args) + [None] * 5)[:5]
    if a.dtype != F32 or not a.ndim or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        return False
    k, n = b.shape
    m = a.size // k if k else 0
    if not m or m * k * n > COMPILED_MAX_MACS:
        return False
    operands = kernel.derived((1, 2, 3, 4), (b, b_scale, b_zp, bias), compiled_operands)
    if operands is None:
        return False
    centered, scales, column_bias = operands
    words = (prog.ref(node.inputs[0]), m, k, prog.pointer(centered), n, prog.pointer(scales),
             prog.pointer(column_bias), prog.ref(node.outputs[0]))
    return prog.emit(DYNAMIC_MATMUL, words)


def _alias(prog, node, args, outs, constants) -> bool:
    """Flatten, Reshape: the same bytes under another shape."""
    return outs[0].dtype == args[0].dtype and outs[0].size == args[0].size


MS = "com.microsoft"
# (domain, op) -> (recorder, the input positions that may be values; every other input must be an initializer)
OPS = {
    ("", "QuantizeLinear"): (_quantize, (0,)),
    ("", "DequantizeLinear"): (_dequantize, (0,)),
    ("", "QLinearConv"): (_conv, (0,)),
    ("", "QLinearMatMul"): (_matmul, (0,)),
    ("", "MaxPool"): (_maxpool, (0,)),
    ("", "Flatten"): (_alias, (0,)),
    ("", "Reshape"): (_alias, (0,)),
    ("", "DynamicQuantizeLinear"): (_dynamic_quantize, (0,)),
    ("", "ConvInteger"): (_conv_integer, (0, 2)),
    ("", "Cast"): (_cast, (0,)),
    ("", "Add"): (_binary(1), (0, 1)),
    ("", "Mul"): (_binary(2), (0, 1)),
    ("", "Relu"): (_relu, (0,)),
    ("", "Softmax"): (_softmax_f32, (0,)),
    (MS, "DynamicQuantizeMatMul"): (_dynamic_matmul, (0,)),
    (MS, "QLinearAdd"): (_add, (0, 3)),
    (MS, "QLinearGlobalAveragePool"): (_global_avg, (0,)),
    (MS, "QGemm"): (_gemm, (0,)),
    (MS, "QLinearSoftmax"): (_softmax, (0,)),
}


# Ops a chain takes only around quantized ones: a run of these alone is a float model's business (fusion.py).
_PASSENGERS = {("", "Flatten"), ("", "Reshape"), ("", "Cast"), ("", "Add"), ("", "Mul"), ("", "Relu"),
               ("", "Softmax"), ("", "MaxPool")}


def _op(node) -> tuple[str, str]:
    domain = node.kernel.node.domain
    return ("" if domain in ("", "ai.onnx") else domain), node.op_type


class QuantChain:
    """The kernel of a joined chain (a FusedNode's): `_run(values, ())` returns the last node's output."""

    arg_ids = ()  # reads its inputs from the values itself

    def __init__(self, nodes, external: tuple[int, ...], constants: dict):
        self.nodes = nodes
        self.external = external  # the value ids read from outside the chain (at most four)
        self.constants = constants
        self.output = nodes[-1].outputs[0]
        self.name, self.op_type = nodes[0].name, nodes[0].op_type
        self._runs: dict = {}  # input signature -> (lib, compiled run or False)

    def failure(self, exc):
        return self.nodes[0].kernel.failure(exc)

    def _run(self, values, args):
        ext = [values[v] for v in self.external]
        key = tuple((a.shape, a.dtype) if type(a) is np.ndarray and a.flags.c_contiguous else None for a in ext)
        lib = native.LIB
        entry = self._runs.get(key)
        if lib is not None and entry is not None and entry[0] is lib and entry[1]:
            y = entry[1](ext)
            if y is not None:
                return (y,)
        local = self._one_by_one(values)
        if lib is not None and (entry is None or entry[0] is not lib) and None not in key:
            if len(self._runs) >= 16:
                self._runs.clear()
            self._runs[key] = (lib, self._compile(lib, local))
        return (local[self.output],)

    def _one_by_one(self, values) -> dict:
        """Every value the chain makes, by its nodes' kernels in turn (fusion.run_one_by_one), and its inputs."""
        local = run_one_by_one(self.nodes, values)
        for vid in self.external:
            local[vid] = values[vid]
        return local

    def _compile(self, lib, local: dict):
        """A function of the external arrays running the chain as one call, for inputs of these shapes and
        types; False where a node cannot be written into the program."""
        places, scratch = self._places(local)
        if places is None:
            return False
        prog = _Program(places)
        for node in self.nodes:
            recorder = OPS[_op(node)][0]
            args = [local[v] if v >= 0 and v in local else (self.constants.get(v) if v >= 0 else None)
                    for v in node.inputs]
            outs = [local[v] for v in node.outputs if v >= 0]
            if recorder is _alias:
                if not _alias(prog, node, args, outs, self.constants):
                    return False
                if node is self.nodes[-1]:
                    prog.emit(COPY, (prog.ref(node.inputs[0]), prog.ref(node.outputs[0]), outs[0].nbytes))
                else:
                    places[node.outputs[0]] = places[node.inputs[0]]
            elif not recorder(prog, node, args, outs, self.constants):
                return False
        out = local[self.output]
        return _runner(lib, prog, len(self.external), out.shape, out.dtype, scratch)

    def _places(self, local: dict):
        """(value id -> reference, scratch bytes) for the chain's values at these arrays; (None, 0) where a value
        is not a contiguous array of a type the program stores."""
        places, offset = {}, 0
        for slot, vid in enumerate(self.external):
            places[vid] = _slot(slot)
        inner = [v for node in self.nodes for v in node.outputs if v >= 0 and v != self.output]
        for vid in (*inner, self.output):
            a = local[vid]
            if type(a) is not np.ndarray or not a.flags.c_contiguous or a.dtype.kind not in "iuf":
                return None, 0
        for vid in inner:
            places[vid] = _slot(_SCRATCH_SLOT, offset)
            offset += -(-local[vid].nbytes // _ALIGN) * _ALIGN
        places[self.output] = _slot(_OUT_SLOT)
        return places, offset


def _runner(lib, prog: _Program, n_in: int, shape, dtype, scratch: int):
    """The chain's call for one input signature: a fresh output and scratch per run (runs may be concurrent)."""
    words = np.zeros((len(prog.words), QC_WORDS), np.int64)
    floats = np.zeros((len(prog.floats), QC_FLOATS), F32)
    for i, (w, f) in enumerate(zip(prog.words, prog.floats)):
        words[i, :len(w)] = w
        floats[i, :len(f)] = f
    held = prog.held
    ptr, null, empty, call = native.ptr, native.NULL, np.empty, lib.ep_quant_chain
    words_ptr, floats_ptr, n_ops = ptr(words), ptr(floats), len(words)
    u8 = np.uint8

    def run(ext):
        ins = [ptr(a) for a in ext] + [null] * (_IN_SLOTS - len(ext))
        y = empty(shape, dtype)
        s = empty(scratch, u8)
        if call(words_ptr, floats_ptr, n_ops, ins[0], ins[1], ins[2], ins[3], ptr(y), ptr(s) if scratch else null):
            return None
        return y

    run.held = (held, words, floats)  # the program's arrays live as long as its run
    return run


def _chain_end(nodes, i: int, constants) -> int:
    """The end of the longest run of nodes from i that OPS names, each with its parameters initializers."""
    j = i
    while j < len(nodes):
        node = nodes[j]
        entry = OPS.get(_op(node)) if node.ep is None and "run" not in node.kernel.__dict__ else None
        if entry is None or any(v >= 0 and p not in entry[1] and v not in constants for p, v in enumerate(node.inputs)):
            break
        j += 1
    return j


def _closed(chain, consumers: dict, keep) -> tuple | None:
    """The values read from outside `chain` (at most four, none an initializer), when its inner values are
    read only inside it and its last node has one output; else None."""
    made = {v for n in chain for v in n.outputs if v >= 0}
    last = chain[-1].outputs
    if len(last) != 1 or last[0] < 0:
        return None
    reads: dict[int, int] = {}
    for n in chain:
        for v in n.inputs:
            if v >= 0:
                reads[v] = reads.get(v, 0) + 1
    for v in made - {last[0]}:
        if v in keep or consumers.get(v, 0) != reads.get(v, 0):
            return None
    return tuple(sorted(v for v in reads if v not in made))


def match_quant_chain(nodes, i: int, consumers, keep, constants):
    """(FusedNode, nodes used) for the longest quantized chain of two or more nodes starting at nodes[i], or
    None (fusion.fuse's hook)."""
    if not ENABLED:
        return None
    end = _chain_end(nodes, i, constants)
    for j in range(end, i + 1, -1):
        chain = nodes[i:j]
        closed = _closed(chain, consumers, keep)
        if closed is None or all(_op(n) in _PASSENGERS for n in chain):
            continue
        external = tuple(v for v in closed if v not in constants)
        if len(external) > _IN_SLOTS:
            continue
        kernel = QuantChain(chain, external, constants)
        return _fused(kernel, chain, external, (chain[-1].outputs[0],)), j - i
    return None
