"""Convolutions on cuDNN: geometry (pure Python), prepared setups (descriptors + algorithm, made once
per shape and settings) and the capturable calls.

A ConvSetup is made at kernel build time (the first call of a shape, or the plan's build): its
descriptors, its algorithm (heuristic, exhaustive search or cuDNN's default, per the
`cudnn_conv_algo_search` option) and its workspace size. Setups are cached per (kind, shapes,
geometry, dtype, math, search, device) and are read-only afterwards, so every stream and thread
shares them. A call then only passes pointers: no allocation (the caller passes a workspace from
the EP's stream-ordered pool), no synchronisation, so graph capture records it.

1-D convolutions run as 2-D with a unit height; 2-D and 3-D map onto cuDNN's Nd descriptors.
cuDNN pads symmetrically: a convolution with different begin and end pads is not taken here
(forward_geometry returns None and the caller keeps its own kernel).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from plugin_cuda.device import algo_cache, cudnn
from plugin_cuda.device.cudnn import NULL, ONE, ZERO, CudnnError, check, ffi

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; geometry still works
    cupy = None

__all__ = ["ConvGeometry", "ConvSetup", "backward_data", "forward", "forward_geometry", "math_type",
           "setup", "transpose_geometry"]

# Most workspace an algorithm may ask for (the heuristic's and the search's choices are filtered by it).
WORKSPACE_LIMIT = 256 << 20
SEARCHES = ("HEURISTIC", "EXHAUSTIVE", "DEFAULT")


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution as cuDNN sees it: NCHW / NCDHW shapes (1-D lifted to 2-D), symmetric pads."""

    x_shape: tuple
    w_shape: tuple
    y_shape: tuple
    pads: tuple
    strides: tuple
    dilations: tuple
    group: int


def _lift(shape, values, fill):
    """1-D: insert a unit spatial axis in front (height 1), with `fill` for the per-axis values."""
    return (tuple(shape[:2]) + (1,) + tuple(shape[2:]), [(fill,) + tuple(v) for v in values])


def forward_geometry(x_shape, w_shape, y_shape, group, pads_begin, pads_end, strides, dilations):
    """The ConvGeometry of an ONNX Conv, or None where cuDNN cannot run it (asymmetric pads,
    spatial rank other than 1, 2 or 3)."""
    n = len(x_shape) - 2
    if n not in (1, 2, 3) or tuple(pads_begin) != tuple(pads_end):
        return None
    pads, strides, dilations = tuple(pads_begin), tuple(strides), tuple(dilations)
    x_shape, w_shape, y_shape = tuple(x_shape), tuple(w_shape), tuple(y_shape)
    if n == 1:
        x_shape, (pads, strides, dilations) = _lift(x_shape, (pads, strides, dilations), 0)
        strides = (1,) + strides[1:]
        dilations = (1,) + dilations[1:]
        w_shape = _lift(w_shape, (), 0)[0]
        y_shape = _lift(y_shape, (), 0)[0]
    return ConvGeometry(x_shape, w_shape, y_shape, pads, strides, dilations, int(group))


def transpose_geometry(x_shape, w_shape, out_sizes, group, begin, strides, dilations):
    """(ConvGeometry, crop) of an ONNX ConvTranspose as cuDNN's backward-data of the matching Conv.

    The transpose's input is the Conv's output (dy) and its output the Conv's input (dx); W is
    already laid out as the Conv's filter (C, M / group, *kernel). `crop` is None when cuDNN writes
    the result straight into Y (padding `begin` on both sides maps Y back onto X); otherwise the
    full, unpadded result is computed into a scratch tensor of the returned dx shape and Y is its
    window starting at `crop` (asymmetric or too-large pads, output_shape)."""
    n = len(x_shape) - 2
    if n not in (1, 2, 3):
        return None, None
    out_sizes, begin = tuple(out_sizes), tuple(begin)
    taps = [(k - 1) * d + 1 for k, d in zip(w_shape[2:], dilations)]
    ins = x_shape[2:]
    direct = all((o + 2 * b - t) >= 0 and (o + 2 * b - t) // s + 1 == i
                 for o, b, t, s, i in zip(out_sizes, begin, taps, strides, ins))
    m = w_shape[1] * group
    if direct:
        dx_sizes, pads, crop = out_sizes, begin, None
    else:
        dx_sizes = tuple(max((i - 1) * s + t, b + o) for i, s, t, b, o in zip(ins, strides, taps, begin, out_sizes))
        pads, crop = (0,) * n, begin
    geo = forward_geometry((x_shape[0], m) + dx_sizes, w_shape, x_shape, group, pads, pads, strides, dilations)
    if n == 1 and crop is not None:
        crop = (0,) + crop
    return geo, crop


def math_type(dtype, use_tf32: bool) -> int:
    """cuDNN math type: strict FMA for float32 without TF32 (as PyTorch), tensor cores for half types."""
    name = np.dtype(dtype).name
    if name == "float32":
        return cudnn.CUDNN_DEFAULT_MATH if use_tf32 else cudnn.CUDNN_FMA_MATH
    return cudnn.CUDNN_TENSOR_OP_MATH


# ---------------------------------------------------------------------------------------------
# Descriptors


def packed_strides(shape) -> list:
    """Row-major strides of `shape` in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _destroy_all(lib, owned: list) -> None:
    for destroy, desc in reversed(owned):  # the last made first: a graph's operations before their tensors
        try:
            getattr(lib, destroy)(desc)
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass
    owned.clear()


class Descriptors:
    """The descriptors of one setup (or one graph: cudnn_graph.py); destroyed with it."""

    def __init__(self, lib):
        self.lib = lib
        self._owned: list = []
        self._finalizer = weakref.finalize(self, _destroy_all, lib, self._owned)
        self._finalizer.atexit = False

    def _create(self, kind: str):
        box = ffi.new(f"cudnn{kind}Descriptor_t *")
        check(getattr(self.lib, f"cudnnCreate{kind}Descriptor")(box), f"cudnnCreate{kind}Descriptor")
        self._owned.append((f"cudnnDestroy{kind}Descriptor", box[0]))
        return box[0]

    def tensor(self, shape, dtype_code: int):
        desc = self._create("Tensor")
        dims = ffi.new("int[]", list(shape))
        strides = ffi.new("int[]", packed_strides(shape))
        check(self.lib.cudnnSetTensorNdDescriptor(desc, dtype_code, len(shape), dims, strides),
              f"cudnnSetTensorNdDescriptor {tuple(shape)}")
        return desc

    def filter(self, shape, dtype_code: int):
        desc = self._create("Filter")
        dims = ffi.new("int[]", list(shape))
        check(self.lib.cudnnSetFilterNdDescriptor(desc, dtype_code, cudnn.CUDNN_TENSOR_NCHW, len(shape), dims),
              f"cudnnSetFilterNdDescriptor {tuple(shape)}")
        return desc

    def convolution(self, geo: ConvGeometry, math: int):
        desc = self._create("Convolution")
        n = len(geo.pads)
        check(self.lib.cudnnSetConvolutionNdDescriptor(
            desc, n, ffi.new("int[]", list(geo.pads)), ffi.new("int[]", list(geo.strides)),
            ffi.new("int[]", list(geo.dilations)), cudnn.CUDNN_CROSS_CORRELATION, cudnn.CUDNN_DATA_FLOAT),
            f"cudnnSetConvolutionNdDescriptor pads {geo.pads} strides {geo.strides} dilations {geo.dilations}")
        check(self.lib.cudnnSetConvolutionGroupCount(desc, geo.group), f"cudnnSetConvolutionGroupCount {geo.group}")
        check(self.lib.cudnnSetConvolutionMathType(desc, math), "cudnnSetConvolutionMathType")
        return desc

    def activation(self, mode: int):
        desc = self._create("Activation")
        check(self.lib.cudnnSetActivationDescriptor(desc, mode, cudnn.CUDNN_NOT_PROPAGATE_NAN, 0.0),
              "cudnnSetActivationDescriptor")
        return desc


class ConvSetup:
    """One convolution ready to call: descriptors, algorithm, workspace size (see the module doc)."""

    def __init__(self, lib, kind: str, geo: ConvGeometry, dtype, use_tf32: bool):
        self.kind = kind
        self.geo = geo
        self.dtype = np.dtype(dtype)
        code = cudnn.data_type(dtype)
        self.math = math_type(dtype, use_tf32)
        self.strict = self.dtype.name == "float32" and not use_tf32
        d = self.descriptors = Descriptors(lib)
        self.x = d.tensor(geo.x_shape, code)
        self.w = d.filter(geo.w_shape, code)
        self.y = d.tensor(geo.y_shape, code)
        self.conv = d.convolution(geo, self.math)
        self._check_output(lib)
        # The bias is added to the op's output: the Conv's y, or (backward data) the Conv's x.
        out = geo.y_shape if kind == "forward" else geo.x_shape
        self.bias = d.tensor((1, out[1]) + (1,) * (len(out) - 2), code)
        self._relu = None
        # Whether cudnnConvolutionBiasActivationForward runs this algorithm (cleared at its first
        # NOT_SUPPORTED: the call is then made of the plain convolution, additions and activation).
        self.fused_ok = True
        self.algo = -1
        self.workspace_bytes = 0

    def _check_output(self, lib) -> None:
        n = len(self.geo.y_shape)
        dims = ffi.new("int[]", n)
        check(lib.cudnnGetConvolutionNdForwardOutputDim(self.conv, self.x, self.w, n, dims),
              "cudnnGetConvolutionNdForwardOutputDim")
        if tuple(dims) != self.geo.y_shape:
            raise CudnnError(f"cuDNN computes output {tuple(dims)} for {self.geo}; ONNX expects {self.geo.y_shape}")

    def relu(self):
        if self._relu is None:
            self._relu = self.descriptors.activation(cudnn.CUDNN_ACTIVATION_RELU)
        return self._relu


# ---------------------------------------------------------------------------------------------
# Algorithm choice


def capturing(stream_ptr: int) -> bool:
    """Whether `stream_ptr` is capturing (True when it cannot be told: then nothing synchronises)."""
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))
    except Exception:  # noqa: BLE001 - an old CuPy: assume it may be capturing (take the heuristic)
        return True


def _pick(perfs, count: int, strict: bool):
    """The first usable result (cuDNN sorts them best first) within the workspace limit."""
    for i in range(count):
        p = perfs[i]
        if p.status != 0 or p.memory > WORKSPACE_LIMIT:
            continue
        if strict and p.mathType not in (cudnn.CUDNN_DEFAULT_MATH, cudnn.CUDNN_FMA_MATH):
            continue
        return p
    return None


def _query(handle, s: ConvSetup, search: str):
    lib, raw = handle.lib, handle.raw
    fwd = s.kind == "forward"
    perf_t = "cudnnConvolutionFwdAlgoPerf_t[]" if fwd else "cudnnConvolutionBwdDataAlgoPerf_t[]"
    count = ffi.new("int *")
    check((lib.cudnnGetConvolutionForwardAlgorithmMaxCount if fwd else
           lib.cudnnGetConvolutionBackwardDataAlgorithmMaxCount)(raw, count), "cudnnGet*AlgorithmMaxCount")
    perfs = ffi.new(perf_t, max(count[0], 1))
    returned = ffi.new("int *")
    if search == "EXHAUSTIVE" and not capturing(handle.stream_ptr or 0):
        try:
            _find(handle, s, count[0], returned, perfs)
            return _pick(perfs, returned[0], s.strict)
        except CudnnError:  # the search could not run here (memory, an algorithm failing): ask the heuristic
            returned[0] = 0
    if fwd:
        check(lib.cudnnGetConvolutionForwardAlgorithm_v7(raw, s.x, s.w, s.conv, s.y, count[0], returned, perfs),
              "cudnnGetConvolutionForwardAlgorithm_v7")
    else:
        check(lib.cudnnGetConvolutionBackwardDataAlgorithm_v7(raw, s.w, s.y, s.conv, s.x, count[0], returned, perfs),
              "cudnnGetConvolutionBackwardDataAlgorithm_v7")
    return _pick(perfs, returned[0], s.strict)


def _find(handle, s: ConvSetup, requested: int, returned, perfs) -> None:
    """cudnnFind*AlgorithmEx on scratch tensors (it runs every algorithm and synchronises: build
    time only, never while the stream is capturing)."""
    g, item = s.geo, s.dtype.itemsize
    x = cupy.zeros(math.prod(g.x_shape) * item, np.uint8)
    w = cupy.zeros(math.prod(g.w_shape) * item, np.uint8)
    y = cupy.zeros(math.prod(g.y_shape) * item, np.uint8)
    ws = cupy.empty(WORKSPACE_LIMIT, np.uint8)
    vp = _vp
    if s.kind == "forward":
        check(handle.lib.cudnnFindConvolutionForwardAlgorithmEx(
            handle.raw, s.x, vp(x.data.ptr), s.w, vp(w.data.ptr), s.conv, s.y, vp(y.data.ptr), requested,
            returned, perfs, vp(ws.data.ptr), WORKSPACE_LIMIT), "cudnnFindConvolutionForwardAlgorithmEx")
    else:
        check(handle.lib.cudnnFindConvolutionBackwardDataAlgorithmEx(
            handle.raw, s.w, vp(w.data.ptr), s.y, vp(y.data.ptr), s.conv, s.x, vp(x.data.ptr), requested,
            returned, perfs, vp(ws.data.ptr), WORKSPACE_LIMIT), "cudnnFindConvolutionBackwardDataAlgorithmEx")


def choose(handle, s: ConvSetup, search: str) -> None:
    """Set s.algo (and its math type) by `search`, and s.workspace_bytes."""
    lib, raw = handle.lib, handle.raw
    fwd = s.kind == "forward"
    key = algo_cache.conv_key(str(cupy.cuda.Device().compute_capability), s.kind, s.geo, s.dtype.name,
                              handle.use_tf32, search)
    saved = algo_cache.lookup(key)
    if isinstance(saved, list) and len(saved) == 2:  # [algorithm, math type] of an earlier search
        algo, math_type = (int(v) for v in saved)
    else:
        perf = None if search == "DEFAULT" else _query(handle, s, search)
        if perf is None:
            algo = (cudnn.CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM if fwd
                    else cudnn.CUDNN_CONVOLUTION_BWD_DATA_ALGO_1)
            math_type = s.math
        else:
            algo = int(perf.algo)
            math_type = s.math if s.strict else int(perf.mathType)  # the math the algorithm was measured with
        algo_cache.record(key, [algo, math_type])
    s.algo = algo
    if math_type != s.math:
        s.math = math_type
        check(lib.cudnnSetConvolutionMathType(s.conv, s.math), "cudnnSetConvolutionMathType")
    size = ffi.new("size_t *")
    if fwd:
        check(lib.cudnnGetConvolutionForwardWorkspaceSize(raw, s.x, s.w, s.conv, s.y, s.algo, size),
              "cudnnGetConvolutionForwardWorkspaceSize")
    else:
        check(lib.cudnnGetConvolutionBackwardDataWorkspaceSize(raw, s.w, s.y, s.conv, s.x, s.algo, size),
              "cudnnGetConvolutionBackwardDataWorkspaceSize")
    s.workspace_bytes = int(size[0])


_setups: dict = {}
_setups_lock = threading.Lock()
_SETUP_LIMIT = 1024


def setup(handle, kind: str, geo: ConvGeometry, dtype) -> ConvSetup:
    """The ConvSetup of `geo` for the handle's settings (memoised; kind 'forward' or 'backward_data')."""
    device = cupy.cuda.runtime.getDevice()
    key = (kind, geo, np.dtype(dtype).name, handle.use_tf32, handle.algo_search, device)
    s = _setups.get(key)
    if s is not None:
        return s
    with _setups_lock:
        s = _setups.get(key)
        if s is None:
            s = ConvSetup(handle.lib, kind, geo, dtype, handle.use_tf32)
            choose(handle, s, handle.algo_search)
            if len(_setups) >= _SETUP_LIMIT:  # dynamic shapes must not grow this without bound
                _setups.clear()
            _setups[key] = s
    return s


def clear_setups() -> None:
    with _setups_lock:
        _setups.clear()


# ---------------------------------------------------------------------------------------------
# Calls (capturable: pointers in, no allocation, no synchronisation)


def _vp(address: int):
    return ffi.cast("void *", address)


def forward(handle, s: ConvSetup, x: int, w: int, y: int, workspace: int, bias: int = 0, relu: bool = False,
            z: int = 0) -> None:
    """y = act(conv(x, w) + z + bias) on the handle's stream. `relu` goes through
    cudnnConvolutionBiasActivationForward (it needs a bias); otherwise the convolution, then the
    bias as cudnnAddTensor. `z` (a residual of y's shape, 0: none) only with relu."""
    lib, raw = handle.lib, handle.raw
    ws = _vp(workspace) if workspace else NULL
    if relu and s.fused_ok:
        if not bias:
            raise CudnnError("cuDNN fused convolution + ReLU needs a bias")
        status = lib.cudnnConvolutionBiasActivationForward(
            raw, ONE, s.x, _vp(x), s.w, _vp(w), s.conv, s.algo, ws, s.workspace_bytes,
            ONE if z else ZERO, s.y, _vp(z if z else y), s.bias, _vp(bias), s.relu(), s.y, _vp(y))
        if status // 1000 not in (2, 3):  # done, or an execution error; else the separate calls below
            check(status, "cudnnConvolutionBiasActivationForward")
            return
        s.fused_ok = False  # BAD_PARAM / NOT_SUPPORTED for this algorithm: nothing was launched
    check(lib.cudnnConvolutionForward(raw, ONE, s.x, _vp(x), s.w, _vp(w), s.conv, s.algo, ws,
                                      s.workspace_bytes, ZERO, s.y, _vp(y)), "cudnnConvolutionForward")
    if bias:
        check(lib.cudnnAddTensor(raw, ONE, s.bias, _vp(bias), ONE, s.y, _vp(y)), "cudnnAddTensor (Conv bias)")
    if z:
        check(lib.cudnnAddTensor(raw, ONE, s.y, _vp(z), ONE, s.y, _vp(y)), "cudnnAddTensor (residual)")
    if relu:
        check(lib.cudnnActivationForward(raw, s.relu(), ONE, s.y, _vp(y), ZERO, s.y, _vp(y)),
              "cudnnActivationForward (ReLU)")


def backward_data(handle, s: ConvSetup, x: int, w: int, y: int, workspace: int, bias: int = 0) -> None:
    """ConvTranspose: y = conv^T(x, w) (+ bias), cuDNN's backward-data of the matching Conv."""
    lib, raw = handle.lib, handle.raw
    ws = _vp(workspace) if workspace else NULL
    # The matching Conv maps Y (its input, s.x) onto X (its output, s.y).
    check(lib.cudnnConvolutionBackwardData(raw, ONE, s.w, _vp(w), s.y, _vp(x), s.conv, s.algo, ws,
                                           s.workspace_bytes, ZERO, s.x, _vp(y)), "cudnnConvolutionBackwardData")
    if bias:
        check(lib.cudnnAddTensor(raw, ONE, s.bias, _vp(bias), ONE, s.x, _vp(y)), "cudnnAddTensor (ConvTranspose bias)")
