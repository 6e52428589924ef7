"""Fused ONNX ops as single raw CUDA kernels: LayerNormalization, RMSNormalization, ai.ephost
SkipLayerNormalization, ai.ephost BiasGelu, ai.ephost FusedMatMul (cuBLAS GEMM + one epilogue
kernel), RotaryEmbedding, and a one-kernel Softmax/LogSoftmax over the last axis.

One CUDA source (SOURCE) is compiled by NVRTC once per device and element type (float32, and
float16 and bfloat16 handled as raw 16-bit values converted with PTX `cvt` or bit arithmetic, so no
CUDA header is needed);
math runs in float32 registers. Every launch is capturable: no allocation, no synchronisation,
no host-to-device copy (all sizes are kernel arguments).

Launch helpers, shared by the per-node kernels below and by the compiled plans (plugin_cuda/plan/).
Pointers are device addresses as Python ints (0 for an absent optional tensor); `dtype` is the
element type of the T tensors (numpy.float32, numpy.float16 or ml_dtypes.bfloat16); each launches one kernel on CuPy's
*current* stream (enter `with stream:` or `cupy.cuda.ExternalStream(ptr)` first), on the current
device:

  function(name, dtype) -> the compiled kernel (cupy RawKernel-like Function; `.ptr` is the CUfunction)
  launch_norm(dtype, rows, n, x, y, gamma, beta=0, *, skip=0, skip_rows=1, bias=0, sum_out=0,
              mean_out=0, rstd_out=0, gamma_n=n, beta_n=n, eps=1e-5, rms=False)
      per row of n elements: v = x + skip[row % skip_rows] + bias; sum_out = v;
      y = (v - mean) * rstd * gamma[j % gamma_n] + beta[j % beta_n] (rms: no mean, rstd of v*v);
      mean_out / rstd_out (float32, one per row) when non-zero.
  launch_bias_act(dtype, total, x, y, bias=0, bias_n=1, act=ACT_NONE)
      y = act(x + bias[i % bias_n]); act in ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH (x may be y).
  launch_rotary(dtype, x, y, cos, sin, positions, batch, seq, heads, head, rot, interleaved,
                seq_major, pos_batch_stride, cache_batch_stride)
      ONNX RotaryEmbedding-23; seq_major: x is (B, S, H, D) (the 3-D form), else (B, H, S, D).
  launch_softmax(dtype, rows, n, x, y, log=False)    softmax (or log-softmax) of each row of n.

Kernel classes register themselves for the per-node path; attention.py adds Attention.
"""

from __future__ import annotations

import numpy as np

from abi.dtypes import BFLOAT16_DTYPE

from ..device import cublas
from ..device.nvrtc import KernelLibrary
from ..device.streams import arg_ptr, grid_1d, row_threads
from ..semantics import GELU_CUDA
from ..semantics.half import HALF_CUDA
from .base import EPHOST_DOMAIN, FLOAT, CudaKernel, num_outputs, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

__all__ = [
    "ACT_GELU",
    "ACT_GELU_TANH",
    "ACT_NONE",
    "ACT_RELU",
    "SOURCE",
    "function",
    "launch_bias_act",
    "launch_norm",
    "launch_rotary",
    "launch_softmax",
    "source_for",
]

ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2, 3
ACTIVATIONS = {"": ACT_NONE, "Relu": ACT_RELU, "Gelu": ACT_GELU, "GeluTanh": ACT_GELU_TANH}

# Device helpers shared with attention.py's source. T is `float`, `half_bits` (float16 bits) or
# `bf16_bits` (bfloat16 bits).
PRELUDE = GELU_CUDA + HALF_CUDA + r"""
#define EPHOST_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide reductions (blockDim.x a multiple of 32); every thread gets the result. The leading
// barrier lets a block call them back to back on the same shared buffer.
__device__ float block_sum(float v) {
  __shared__ float buf[32];
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? buf[lane] : 0.0f;
  return warp_sum(v);
}
__device__ float block_max(float v) {
  __shared__ float buf[32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? buf[lane] : EPHOST_NEG_INF;
  return warp_max(v);
}
__device__ __forceinline__ float activate(float v, int act) {
  if (act == 1) return fmaxf(v, 0.0f);
  if (act == 2) return ep_gelu(v);
  if (act == 3) return ep_gelu_tanh(v);
  return v;
}
"""

SOURCE = r"""
// v rounded to T, where an op's function body computes in X's type (RMSNormalization's normalised
// value, RotaryEmbedding's products): a no-op for float.
__device__ __forceinline__ float in_t(float v) { T t; put(&t, 0, v); return to_f(t); }

// One block per row. rms: RMSNormalization (no mean); otherwise LayerNormalization.
extern "C" __global__ void ephost_norm(
    const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ bias,
    const T* __restrict__ gamma, const T* __restrict__ beta, T* __restrict__ y, T* __restrict__ sum_out,
    float* __restrict__ mean_out, float* __restrict__ rstd_out,
    i64 n, i64 skip_rows, i64 gamma_n, i64 beta_n, float eps, int rms) {
  const i64 row = blockIdx.x;
  const T* xr = x + row * n;
  const T* sr = skip ? skip + (row % skip_rows) * n : (const T*)0;
  T* so = sum_out ? sum_out + row * n : (T*)0;
  float acc = 0.0f;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    float v = to_f(xr[j]);
    if (sr) v += to_f(sr[j]);
    if (bias) v += to_f(bias[j]);
    if (so) put(so, j, v);
    acc += rms ? v * v : v;
  }
  acc = block_sum(acc);
  float mean = 0.0f, var;
  if (rms) {
    var = acc / (float)n;
  } else {
    mean = acc / (float)n;
    float sq = 0.0f;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
      float v = to_f(xr[j]);
      if (sr) v += to_f(sr[j]);
      if (bias) v += to_f(bias[j]);
      sq += (v - mean) * (v - mean);
    }
    var = block_sum(sq) / (float)n;
  }
  const float rstd = rsqrtf(var + eps);
  T* yr = y + row * n;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    float v = to_f(xr[j]);
    if (sr) v += to_f(sr[j]);
    if (bias) v += to_f(bias[j]);
    float o = (v - mean) * rstd;
    if (rms) o = in_t(o);  // RMSNormalization's function body: the normalised value in X's type
    o *= to_f(gamma[j % gamma_n]);
    if (beta) o += to_f(beta[j % beta_n]);
    put(yr, j, o);
  }
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = mean;
    if (rstd_out) rstd_out[row] = rstd;
  }
}

extern "C" __global__ void ephost_bias_act(const T* x, const T* __restrict__ bias, T* y, i64 total, i64 bias_n,
                                           int act) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    float v = to_f(x[i]);
    if (bias) v += to_f(bias[i % bias_n]);
    put(y, i, activate(v, act));
  }
}

// ONNX RotaryEmbedding-23. seq_major: x is (B, S, H, D); otherwise (B, H, S, D).
extern "C" __global__ void ephost_rotary(
    const T* __restrict__ x, const T* __restrict__ cosc, const T* __restrict__ sinc,
    const i64* __restrict__ pos, T* __restrict__ y, i64 total, int S, int H, int D, int rot,
    int interleaved, int seq_major, i64 pos_bstride, i64 cache_bstride) {
  const int half = rot / 2;
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const int d = (int)(i % D);
    if (d >= rot) { put(y, i, to_f(x[i])); continue; }
    i64 t = i / D;
    int s;
    i64 b;
    if (seq_major) { t /= H; s = (int)(t % S); b = t / S; }
    else { s = (int)(t % S); b = t / S / H; }
    const i64 base = i - d;
    int p;
    bool first;
    float x1, x2;
    if (interleaved) {
      p = d >> 1; first = (d & 1) == 0;
      x1 = to_f(x[base + 2 * p]); x2 = to_f(x[base + 2 * p + 1]);
    } else {
      first = d < half; p = first ? d : d - half;
      x1 = to_f(x[base + p]); x2 = to_f(x[base + p + half]);
    }
    const i64 crow = pos ? pos[b * pos_bstride + s] : b * cache_bstride + s;
    const float c = to_f(cosc[crow * half + p]), sn = to_f(sinc[crow * half + p]);
    put(y, i, first ? in_t(c * x1) - in_t(sn * x2) : in_t(sn * x1) + in_t(c * x2));
  }
}

extern "C" __global__ void ephost_softmax(const T* __restrict__ x, T* __restrict__ y, i64 n, int log_out) {
  const T* xr = x + (i64)blockIdx.x * n;
  T* yr = y + (i64)blockIdx.x * n;
  float m = EPHOST_NEG_INF;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, to_f(xr[j]));
  m = block_max(m);
  float s = 0.0f;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += expf(to_f(xr[j]) - m);
  s = block_sum(s);
  const float inv = 1.0f / s, ls = logf(s);
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = to_f(xr[j]) - m;
    put(yr, j, log_out ? v - ls : expf(v) * inv);
  }
}
"""

_C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "half_bits", BFLOAT16_DTYPE: "bf16_bits"}
_F32 = np.dtype(np.float32)


def source_for(body: str, dtype) -> str:
    """Full CUDA source of `body` for element type `dtype` (the PRELUDE plus `typedef ... T`)."""
    ctype = _C_TYPES.get(np.dtype(dtype))
    if ctype is None:
        raise ValueError(f"fused CUDA kernels got dtype {np.dtype(dtype)}; allowed: float32, float16, bfloat16")
    return f"{PRELUDE}\ntypedef {ctype} T;\n{body}"


LIBRARY = KernelLibrary(SOURCE, ("ephost_norm", "ephost_bias_act", "ephost_rotary", "ephost_softmax"), source_for)


def function(name: str, dtype):
    """The compiled kernel `name` of SOURCE for `dtype` on the current device (compiled on first use)."""
    return LIBRARY.function(name, dtype)


def launch_norm(dtype, rows: int, n: int, x: int, y: int, gamma: int, beta: int = 0, *, skip: int = 0,
                skip_rows: int = 1, bias: int = 0, sum_out: int = 0, mean_out: int = 0, rstd_out: int = 0,
                gamma_n: int | None = None, beta_n: int | None = None, eps: float = 1e-5,
                rms: bool = False) -> None:
    if rows == 0 or n == 0:
        return
    function("ephost_norm", dtype)(
        (rows,), (row_threads(n),),
        (arg_ptr(x), arg_ptr(skip), arg_ptr(bias), arg_ptr(gamma), arg_ptr(beta), arg_ptr(y), arg_ptr(sum_out), arg_ptr(mean_out), arg_ptr(rstd_out),
         np.int64(n), np.int64(max(skip_rows, 1)), np.int64(gamma_n or n), np.int64(beta_n or n),
         np.float32(eps), np.int32(bool(rms))),
    )


def launch_bias_act(dtype, total: int, x: int, y: int, bias: int = 0, bias_n: int = 1, act: int = ACT_NONE) -> None:
    if total == 0:
        return
    function("ephost_bias_act", dtype)(
        (grid_1d(total),), (256,), (arg_ptr(x), arg_ptr(bias), arg_ptr(y), np.int64(total), np.int64(max(bias_n, 1)), np.int32(act)),
    )


def launch_rotary(dtype, x: int, y: int, cos: int, sin: int, positions: int, batch: int, seq: int, heads: int,
                  head: int, rot: int, interleaved: bool, seq_major: bool, pos_batch_stride: int,
                  cache_batch_stride: int) -> None:
    total = batch * seq * heads * head
    if total == 0:
        return
    function("ephost_rotary", dtype)(
        (grid_1d(total),), (256,),
        (arg_ptr(x), arg_ptr(cos), arg_ptr(sin), arg_ptr(positions), arg_ptr(y), np.int64(total), np.int32(seq), np.int32(heads),
         np.int32(head), np.int32(rot), np.int32(bool(interleaved)), np.int32(bool(seq_major)),
         np.int64(pos_batch_stride), np.int64(cache_batch_stride)),
    )


def launch_softmax(dtype, rows: int, n: int, x: int, y: int, log: bool = False) -> None:
    if rows == 0 or n == 0:
        return
    function("ephost_softmax", dtype)((rows,), (row_threads(n),), (arg_ptr(x), arg_ptr(y), np.int64(n), np.int32(bool(log))))


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _contiguous(x):
    return x if x is None or x.flags.c_contiguous else cupy.ascontiguousarray(x)


# ---------------------------------------------------------------------------------------------
# Per-node kernels


class _Norm(CudaKernel):
    """Shared by the normalisations: rows are the dims before `axis`, a row the dims from it on."""

    def _rows(self, shape):
        axis = self.axis(self.axis_attr, len(shape))
        rows = int(np.prod(shape[:axis], dtype=np.int64))
        n = int(np.prod(shape[axis:], dtype=np.int64))
        return axis, rows, n

    def _param(self, p, n: int, what: str):
        """A scale/bias whose size divides the row and that broadcasts over its trailing dims."""
        if p is None:
            return None, 1
        if p.size == 0 or n % p.size:
            raise ValueError(f"{self.op_type} node '{self.node_name}': {what} has shape {list(p.shape)}; "
                             f"allowed: a shape that broadcasts to the normalized {n} elements")
        return _contiguous(p), p.size


@register("LayerNormalization", 17)
class LayerNormalization(_Norm):
    """Y = (X - mean) / sqrt(var + eps) * Scale + B over the dimensions from `axis` on, one kernel.
    Optional outputs Mean and InvStdDev are float32 (stash_type 1)."""

    input_types = (FLOAT, FLOAT, FLOAT)
    max_outputs = 3

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self.attr_int("stash_type", 1, (1,))

    def _compute(self, ctx):
        inputs = ctx.inputs
        x = _contiguous(inputs[0])
        axis, rows, n = self.plan((x.shape,), self._rows)
        scale, gn = self._param(inputs[1], n, "Scale")
        bias, bn = self._param(inputs[2] if len(inputs) > 2 else None, n, "B")
        out = ctx.output(0, x.shape, x.dtype)
        count = num_outputs(ctx)
        stat_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
        mean = ctx.output(1, stat_shape, _F32) if count > 1 else None
        rstd = ctx.output(2, stat_shape, _F32) if count > 2 else None
        launch_norm(x.dtype, rows, n, x.data.ptr, out.data.ptr, scale.data.ptr, _ptr(bias), gamma_n=gn, beta_n=bn,
                    mean_out=_ptr(mean), rstd_out=_ptr(rstd), eps=self.epsilon)


@register("RMSNormalization", 23)
class RMSNormalization(_Norm):
    """Y = X / sqrt(mean(X^2) + eps) * Scale over the dimensions from `axis` on, one kernel."""

    input_types = (FLOAT, FLOAT)
    max_outputs = 1

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self.attr_int("stash_type", 1, (1,))

    def _compute(self, ctx):
        x = _contiguous(ctx.inputs[0])
        _, rows, n = self.plan((x.shape,), self._rows)
        scale, gn = self._param(ctx.inputs[1], n, "scale")
        out = ctx.output(0, x.shape, x.dtype)
        launch_norm(x.dtype, rows, n, x.data.ptr, out.data.ptr, scale.data.ptr, gamma_n=gn, eps=self.epsilon,
                    rms=True)


@register("SkipLayerNormalization", 1, domain=EPHOST_DOMAIN)
class SkipLayerNormalization(_Norm):
    """ai.ephost: Y = LayerNorm(X + Skip) * Scale + Bias over the last axis (Skip may broadcast over
    leading rows); optional output 1 is X + Skip. One kernel."""

    input_types = (FLOAT, FLOAT, FLOAT, FLOAT)
    max_outputs = 2

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.axis_attr = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, skip = _contiguous(inputs[0]), _contiguous(inputs[1])
        _, rows, n = self.plan((x.shape,), self._rows)
        skip_rows = skip.size // n if n else 1
        if n and (skip.size % n or rows % max(skip_rows, 1) or x.shape[x.ndim - skip.ndim:] != skip.shape):
            raise ValueError(f"SkipLayerNormalization node '{self.node_name}': Skip shape {list(skip.shape)} does "
                             f"not broadcast to input shape {list(x.shape)}")
        scale, gn = self._param(inputs[2], n, "Scale")
        bias, bn = self._param(inputs[3] if len(inputs) > 3 else None, n, "Bias")
        out = ctx.output(0, x.shape, x.dtype)
        total = ctx.output(1, x.shape, x.dtype) if num_outputs(ctx) > 1 else None
        launch_norm(x.dtype, rows, n, x.data.ptr, out.data.ptr, scale.data.ptr, _ptr(bias), skip=skip.data.ptr,
                    skip_rows=skip_rows, sum_out=_ptr(total), gamma_n=gn, beta_n=bn, eps=self.epsilon)


def _bias_of(node: str, x, bias):
    """Bias over the last axis (its size divides the row)."""
    if bias is None:
        return None, 1
    if bias.size == 0 or (x.shape and x.shape[-1] % bias.size) or bias.ndim > 1 and bias.shape[:-1] != (1,) * (
            bias.ndim - 1):
        raise ValueError(f"{node}: bias shape {list(bias.shape)} does not broadcast over the last axis of "
                         f"{list(x.shape)}")
    return _contiguous(bias), bias.size


@register("BiasGelu", 1, domain=EPHOST_DOMAIN)
class BiasGelu(CudaKernel):
    """ai.ephost: Y = Gelu(X + Bias), Bias over the last axis; approximate 'none' or 'tanh'. One kernel."""

    input_types = (FLOAT, FLOAT)
    max_outputs = 1

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        approximate = self.attr_str("approximate", "none", ("none", "tanh"))
        self.act = ACT_GELU_TANH if approximate == "tanh" else ACT_GELU

    def _compute(self, ctx):
        x = _contiguous(ctx.inputs[0])
        bias, bn = _bias_of(f"BiasGelu node '{self.node_name}'", x, ctx.inputs[1])
        out = ctx.output(0, x.shape, x.dtype)
        launch_bias_act(x.dtype, x.size, x.data.ptr, out.data.ptr, _ptr(bias), bn, self.act)


@register("FusedMatMul", 1, domain=EPHOST_DOMAIN)
class FusedMatMul(CudaKernel):
    """ai.ephost: Y = act(A @ B + Bias) (MatMul broadcasting; Bias over the last axis); activation in
    '', 'Relu', 'Gelu', 'GeluTanh'. The GEMM through the plugin's cuBLAS, then one epilogue kernel
    in place (none without bias and activation)."""

    input_types = (FLOAT, FLOAT, FLOAT)
    max_outputs = 1
    needs_cublas = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.act = ACTIVATIONS[self.attr_str("activation", "", tuple(ACTIVATIONS))]

    def _compute(self, ctx):
        inputs = ctx.inputs
        a, b = inputs[0], inputs[1]
        out = ctx.output(0, cublas.matmul_shape(a.shape, b.shape), a.dtype)
        cublas.matmul(ctx.cublas, a, b, out)
        bias, bn = _bias_of(f"FusedMatMul node '{self.node_name}'", out, inputs[2] if len(inputs) > 2 else None)
        if bias is not None or self.act != ACT_NONE:
            launch_bias_act(out.dtype, out.size, out.data.ptr, out.data.ptr, _ptr(bias), bn, self.act)


@register("RotaryEmbedding", 23)
class RotaryEmbedding(CudaKernel):
    """ONNX RotaryEmbedding-23 in one kernel: X (B, H, S, D) or (B, S, H*D) with num_heads; caches
    (max_position, rot/2) indexed by position_ids (B, S), or (B, S, rot/2) without them."""

    input_types = (FLOAT, FLOAT, FLOAT, frozenset({"int64"}))
    same_type = (0, 1, 2)
    max_outputs = 1

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.interleaved = bool(self.attr_int("interleaved", 0, (0, 1)))
        self.num_heads = self.attr_int("num_heads", 0)
        self.rot_attr = self.attr_int("rotary_embedding_dim", 0)

    def _plan(self, x_shape, cos_shape, pos_shape):
        node = f"RotaryEmbedding node '{self.node_name}'"
        if len(x_shape) == 4:
            batch, heads, seq, head = x_shape
            seq_major = False
        elif len(x_shape) == 3:
            if self.num_heads <= 0 or x_shape[2] % self.num_heads:
                raise ValueError(f"{node}: a 3-D input of shape {list(x_shape)} needs num_heads dividing its "
                                 f"last dim; num_heads is {self.num_heads}")
            batch, seq, heads, head = x_shape[0], x_shape[1], self.num_heads, x_shape[2] // self.num_heads
            seq_major = True
        else:
            raise ValueError(f"{node}: input shape {list(x_shape)}; allowed: rank 3 or 4")
        rot = self.rot_attr or head
        if rot % 2 or rot > head:
            raise ValueError(f"{node}: rotary_embedding_dim {rot} must be even and at most head size {head}")
        if cos_shape[-1] != rot // 2:
            raise ValueError(f"{node}: cos/sin cache shape {list(cos_shape)}; the last dim must be {rot // 2}")
        if pos_shape is not None:
            if len(pos_shape) != 2 or pos_shape[1] != seq or pos_shape[0] not in (1, batch):
                raise ValueError(f"{node}: position_ids shape {list(pos_shape)}; expected {[batch, seq]}")
            pos_stride, cache_stride = (0 if pos_shape[0] == 1 else seq), 0
        else:
            if len(cos_shape) != 3 or cos_shape[1] != seq or cos_shape[0] not in (1, batch):
                raise ValueError(f"{node}: without position_ids the cache shape must be {[batch, seq, rot // 2]}; "
                                 f"got {list(cos_shape)}")
            pos_stride, cache_stride = 0, (0 if cos_shape[0] == 1 else seq)
        return batch, seq, heads, head, rot, seq_major, pos_stride, cache_stride

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, cos, sin = (_contiguous(v) for v in inputs[:3])
        pos = _contiguous(inputs[3]) if len(inputs) > 3 else None
        if cos.shape != sin.shape:
            raise ValueError(f"RotaryEmbedding node '{self.node_name}': cos cache {list(cos.shape)} and sin cache "
                             f"{list(sin.shape)} differ")
        batch, seq, heads, head, rot, seq_major, ps, cs = self.plan(
            (x.shape, cos.shape, None if pos is None else pos.shape), self._plan)
        out = ctx.output(0, x.shape, x.dtype)
        launch_rotary(x.dtype, x.data.ptr, out.data.ptr, cos.data.ptr, sin.data.ptr, _ptr(pos), batch, seq, heads,
                      head, rot, self.interleaved, seq_major, ps, cs)
