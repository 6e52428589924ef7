"""ONNX Attention-23 on the GPU: two cuBLAS strided-batched GEMMs (the plugin's own cffi handles,
so the launches are capturable) around one fused kernel that applies softcap, the causal mask and
the attention mask (bool or additive float, broadcast, shorter than the keys = padded as masked)
and the softmax, in float32; or, where option attention_kernel picks it (flash_attention.choose),
one fused flash-style kernel (flash_attention.py) that never writes the scores out.

Covered: Q/K/V 4-D (B, H, S, D) or 3-D (B, S, H*D) with q_num_heads/kv_num_heads, grouped-query
attention (q heads a multiple of kv heads), attn_mask bool/float32/float16/bfloat16, is_causal, scale,
softcap, outputs Y and present_key/present_value (no past). Not claimed: past_key/past_value,
the qk_matmul_output output. A fully masked row gives zeros, as the ONNX reference does.

For the compiled plans (plugin_cuda/plan/):
  attention_plan(q_shape, k_shape, v_shape, mask_shape, mask_dtype, q_num_heads, kv_num_heads,
                 is_causal, scale, softcap, dtype) -> AttentionPlan (shape work, done once)
  plan.workspace_bytes                      device scratch the launch needs
  launch_attention(handle, plan, q, k, v, mask, y, workspace)
      pointers as ints (mask 0 when absent); launches 2 GEMMs + 1 kernel on the handle's stream,
      which must be CuPy's current stream too (the softmax kernel runs there).
  function("ephost_attn_softmax", dtype)    the compiled softmax kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from abi.dtypes import BFLOAT16_DTYPE

from ..device import cublas
from ..device.nvrtc import KernelLibrary
from ..device.streams import row_threads
from . import flash_attention
from .base import BOOL, FLOAT, CudaKernel, num_outputs, register
from .fused import source_for

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

__all__ = ["SOURCE", "AttentionPlan", "attention_plan", "function", "launch_attention"]

MASK_NONE, MASK_BOOL, MASK_F32, MASK_F16, MASK_BF16 = 0, 1, 2, 3, 4
_MASK_KINDS = {np.dtype(np.bool_): MASK_BOOL, np.dtype(np.float32): MASK_F32, np.dtype(np.float16): MASK_F16,
               BFLOAT16_DTYPE: MASK_BF16}

SOURCE = r"""
// One block per row (b, h, i) of scores laid out (B, H, Sq, Skv), float32, already scaled.
__device__ __forceinline__ float attn_logit(const float* sr, const void* mask, int kind, i64 mrow, i64 mj,
                                            i64 mask_len, int i, int j, int causal, i64 offset, float softcap) {
  float v = sr[j];
  if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
  bool allowed = !causal || (i64)j <= (i64)i + offset;
  if (kind) {
    if ((i64)j >= mask_len) {
      allowed = false;
    } else {
      const i64 at = mrow + (i64)j * mj;
      if (kind == 1) allowed = allowed && ((const unsigned char*)mask)[at] != 0;
      else if (kind == 2) v += ((const float*)mask)[at];
      else if (kind == 3) v += to_f(((const half_bits*)mask)[at]);
      else v += to_f(((const bf16_bits*)mask)[at]);
    }
  }
  return allowed ? v : EPHOST_NEG_INF;
}

extern "C" __global__ void ephost_attn_softmax(
    const float* scores, T* probs, const void* mask, int kind, i64 mb, i64 mh, i64 mi, i64 mj, i64 mask_len,
    int H, int Sq, int Skv, int causal, i64 offset, float softcap) {
  const i64 row = blockIdx.x;
  const int i = (int)(row % Sq);
  const i64 bh = row / Sq;
  const int h = (int)(bh % H);
  const i64 b = bh / H;
  const float* sr = scores + row * Skv;
  T* pr = probs + row * Skv;
  const i64 mrow = b * mb + h * mh + (i64)i * mi;
  float m = EPHOST_NEG_INF;
  for (int j = threadIdx.x; j < Skv; j += blockDim.x)
    m = fmaxf(m, attn_logit(sr, mask, kind, mrow, mj, mask_len, i, j, causal, offset, softcap));
  m = block_max(m);
  if (m == EPHOST_NEG_INF) {  // no key to attend: zeros (block_max's barriers precede every write)
    for (int j = threadIdx.x; j < Skv; j += blockDim.x) put(pr, j, 0.0f);
    return;
  }
  float s = 0.0f;
  for (int j = threadIdx.x; j < Skv; j += blockDim.x)
    s += expf(attn_logit(sr, mask, kind, mrow, mj, mask_len, i, j, causal, offset, softcap) - m);
  s = block_sum(s);
  const float inv = 1.0f / s;
  for (int j = threadIdx.x; j < Skv; j += blockDim.x)
    put(pr, j, expf(attn_logit(sr, mask, kind, mrow, mj, mask_len, i, j, causal, offset, softcap) - m) * inv);
}
"""

LIBRARY = KernelLibrary(SOURCE, ("ephost_attn_softmax",), source_for)


def function(name: str, dtype):
    """The compiled kernel `name` of SOURCE for `dtype` on the current device."""
    return LIBRARY.function(name, dtype)


@dataclass(frozen=True)
class Gemm:
    """One cuBLAS strided-batched call, column-major terms; offsets in elements."""

    transa: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    calls: tuple  # ((a_off, b_off, c_off), ...)
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int


@dataclass(frozen=True)
class AttentionPlan:
    dtype: np.dtype
    out_shape: tuple
    present_shapes: tuple  # (key, value) 4-D shapes
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head: int
    v_head: int
    seq_major: bool  # the 3-D form
    scale: float
    softcap: float
    causal: bool
    mask_kind: int
    mask_strides: tuple  # (b, h, i, j) in elements
    mask_len: int
    scores: Gemm
    values: Gemm
    workspace_bytes: int
    probs_offset: int  # bytes into the workspace (0: the scores buffer is reused, float32)


def _mask_layout(node: str, shape, batch, heads, q_len, kv_len):
    if shape is None:
        return (0, 0, 0, 0), 0
    if not 1 <= len(shape) <= 4:
        raise ValueError(f"{node}: attn_mask shape {list(shape)}; allowed: rank 1 to 4")
    dims = (1,) * (4 - len(shape)) + tuple(shape)
    target = (batch, heads, q_len)
    for d, t in zip(dims[:3], target):
        if d not in (1, t):
            raise ValueError(f"{node}: attn_mask shape {list(shape)} does not broadcast to "
                             f"{[batch, heads, q_len, kv_len]}")
    if dims[3] > kv_len:
        raise ValueError(f"{node}: attn_mask has {dims[3]} keys; the keys number {kv_len}")
    strides, step = [], 1
    for d, t in reversed(list(zip(dims, (batch, heads, q_len, kv_len)))):
        # A size that is symbolic in a compiled plan (an int subclass) and equals its target keeps its
        # stride even when it is 1 this time, so the plan's source holds for every size.
        symbolic = type(d) is not int and isinstance(d, int) and d == t
        strides.append(step if d != 1 or symbolic else 0)
        step *= d
    strides.reverse()
    strides[3] = 1  # a last dim of 1 is one key followed by padding (masked), not a broadcast
    return tuple(strides), dims[3]


def attention_plan(q_shape, k_shape, v_shape, mask_shape, mask_dtype, q_num_heads, kv_num_heads, is_causal,
                   scale, softcap, dtype, node: str = "Attention") -> AttentionPlan:
    """The launch plan for one set of shapes (ValueError naming `node` when they do not fit)."""
    dtype = np.dtype(dtype)
    if not len(q_shape) == len(k_shape) == len(v_shape) or len(q_shape) not in (3, 4):
        raise ValueError(f"{node}: Q, K, V shapes {list(q_shape)}, {list(k_shape)}, {list(v_shape)}; "
                         "allowed: all 3-D or all 4-D")
    if len(q_shape) == 4:
        batch, hq, sq, d = q_shape
        _, hkv, skv, _ = k_shape
        dv = v_shape[3]
        ok = k_shape[0] == batch and k_shape[3] == d and v_shape[:3] == k_shape[:3]
        seq_major = False
    else:
        if not q_num_heads or not kv_num_heads:
            raise ValueError(f"{node}: 3-D inputs need q_num_heads and kv_num_heads attributes")
        hq, hkv = q_num_heads, kv_num_heads
        batch, sq = q_shape[:2]
        skv = k_shape[1]
        ok = q_shape[2] % hq == 0 and k_shape[2] % hkv == 0 and v_shape[2] % hkv == 0 and \
            k_shape[0] == batch and v_shape[:2] == k_shape[:2]
        d, dv = (q_shape[2] // hq if hq else 0), (v_shape[2] // hkv if hkv else 0)
        ok = ok and k_shape[2] // hkv == d
        seq_major = True
    if not ok or hkv == 0 or hq % hkv:
        raise ValueError(f"{node}: Q, K, V shapes {list(q_shape)}, {list(k_shape)}, {list(v_shape)} do not fit "
                         "(batch, heads, sequence, head size; q heads a multiple of kv heads)")
    g = hq // hkv
    mask_strides, mask_len = _mask_layout(node, mask_shape, batch, hq, sq, skv)
    mask_kind = MASK_NONE if mask_shape is None else _MASK_KINDS.get(np.dtype(mask_dtype))
    if mask_kind is None:
        raise ValueError(f"{node}: attn_mask dtype {np.dtype(mask_dtype)}; allowed: bool, float32, float16, bfloat16")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    if not seq_major:
        rows = g * sq  # the g query heads of one kv head are one matrix of g * sq rows
        pairs = ((0, 0, 0),)
        scores = Gemm(cublas.CUBLAS_OP_T, skv, rows, d, d, d, skv, pairs, skv * d, rows * d, rows * skv,
                      batch * hkv)
        values = Gemm(cublas.CUBLAS_OP_N, dv, rows, skv, dv, skv, dv, pairs, skv * dv, rows * skv, rows * dv,
                      batch * hkv)
        out_shape = (batch, hq, sq, dv)
    else:
        if g == 1:
            groups = [(b, 0) for b in range(batch)]
            per, k_stride, v_stride = hq, d, dv
        else:
            groups = [(b, hk) for b in range(batch) for hk in range(hkv)]
            per, k_stride, v_stride = g, 0, 0
        s_calls = tuple((b * skv * hkv * d + hk * d, b * sq * hq * d + hk * g * d, (b * hq + hk * g) * sq * skv)
                        for b, hk in groups)
        v_calls = tuple((b * skv * hkv * dv + hk * dv, (b * hq + hk * g) * sq * skv, b * sq * hq * dv + hk * g * dv)
                        for b, hk in groups)
        scores = Gemm(cublas.CUBLAS_OP_T, skv, sq, d, hkv * d, hq * d, skv, s_calls, k_stride, d, sq * skv, per)
        values = Gemm(cublas.CUBLAS_OP_N, dv, sq, skv, hkv * dv, skv, hq * dv, v_calls, v_stride, sq * skv, dv, per)
        out_shape = (batch, sq, hq * dv)
    n_scores = batch * hq * sq * skv
    probs_offset = 0 if dtype == np.float32 else (n_scores * 4 + 255) // 256 * 256
    workspace = n_scores * 4 if probs_offset == 0 else probs_offset + n_scores * dtype.itemsize
    return AttentionPlan(dtype, out_shape, ((batch, hkv, skv, d), (batch, hkv, skv, dv)), batch, hq, hkv, sq, skv,
                         d, dv, seq_major, scale, float(softcap or 0.0), bool(is_causal), mask_kind, mask_strides,
                         mask_len, scores, values, max(workspace, 1), probs_offset)


def _batched(handle, gemm: Gemm, a: int, a_type, b: int, b_type, c: int, c_type, item_a, item_b, item_c, compute,
             alpha) -> None:
    lib, raw, vp = handle.lib, handle.raw, cublas.void_ptr
    for oa, ob, oc in gemm.calls:
        cublas.check(lib.cublasGemmStridedBatchedEx(
            raw, gemm.transa, cublas.CUBLAS_OP_N, gemm.m, gemm.n, gemm.k,
            alpha, vp(a + oa * item_a), a_type, gemm.lda, gemm.stride_a,
            vp(b + ob * item_b), b_type, gemm.ldb, gemm.stride_b,
            cublas.ZERO, vp(c + oc * item_c), c_type, gemm.ldc, gemm.stride_c,
            gemm.batch, compute, cublas.CUBLAS_GEMM_DEFAULT,
        ), "cublasGemmStridedBatchedEx (Attention)")


def launch_attention(handle, plan: AttentionPlan, q: int, k: int, v: int, mask: int, y: int, workspace: int) -> None:
    """Y = softmax(mask(scale * Q K^T)) V for `plan`; `workspace` holds plan.workspace_bytes."""
    if plan.batch * plan.q_heads * plan.q_len == 0:
        return
    t_type, compute = cublas.gemm_types(plan.dtype, handle.use_tf32)
    item = plan.dtype.itemsize
    f32, f32_compute = cublas.CUDA_R_32F, (compute if plan.dtype == np.float32 else cublas.CUBLAS_COMPUTE_32F)
    scores = workspace
    probs = workspace + plan.probs_offset
    if plan.kv_len == 0:
        raise ValueError("Attention with no keys has no defined output")
    alpha = cublas.ffi.new("float *", plan.scale)
    # scores (fp32) = scale * Q K^T: cuBLAS sees K (transposed) as A and Q as B, column-major.
    _batched(handle, plan.scores, k, t_type, q, t_type, scores, f32, item, item, 4, f32_compute, alpha)
    b_, h_, i_, j_ = plan.mask_strides
    function("ephost_attn_softmax", plan.dtype)(
        (plan.batch * plan.q_heads * plan.q_len,), (row_threads(plan.kv_len),),
        (np.uint64(scores), np.uint64(probs), np.uint64(mask), np.int32(plan.mask_kind if mask else 0),
         np.int64(b_), np.int64(h_), np.int64(i_), np.int64(j_), np.int64(plan.mask_len), np.int32(plan.q_heads),
         np.int32(plan.q_len), np.int32(plan.kv_len), np.int32(plan.causal), np.int64(0), np.float32(plan.softcap)),
    )
    # Y = P V: V as A (not transposed), P as B.
    _batched(handle, plan.values, v, t_type, probs, t_type, y, t_type, item, item, item, compute, cublas.ONE)


@register("Attention", 23)
class Attention(CudaKernel):
    input_types = (FLOAT, FLOAT, FLOAT, FLOAT | BOOL)
    same_type = (0, 1, 2)
    max_outputs = 3
    needs_cublas = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.causal = bool(self.attr_int("is_causal", 0, (0, 1)))
        self.q_heads = self.attr_int("q_num_heads")
        self.kv_heads = self.attr_int("kv_num_heads")
        self.scale = self.attr_float("scale")
        self.softcap = self.attr_float("softcap", 0.0)
        self.attr_int("qk_matmul_output_mode", 0, (0, 1, 2, 3))
        self.attr_int("softmax_precision", 1, (1, 10, 11, 16))  # float32 softmax is at least as precise
        self.options = None  # the EP's CudaOptions, set by the plugin (attention_kernel)

    @classmethod
    def claims(cls, attrs, dtypes, opset):
        # past_key / past_value (inputs 4, 5) are not supported: only absent ones are accepted.
        return all(d is None for d in dtypes[4:]) and super().claims(attrs, dtypes[:4], opset)

    def _compute(self, ctx):
        inputs = ctx.inputs
        if any(x is not None for x in inputs[4:]):
            raise ValueError(f"Attention node '{self.node_name}': past_key/past_value are not supported")
        q, k, v = (cupy.ascontiguousarray(x) for x in inputs[:3])
        mask = inputs[3] if len(inputs) > 3 else None
        if mask is not None:
            mask = cupy.ascontiguousarray(mask)
        key = (q.shape, k.shape, v.shape, None if mask is None else mask.shape,
               None if mask is None else mask.dtype, q.dtype)
        plan = self.plan(key, self._plan)
        y = ctx.output(0, plan.out_shape, q.dtype)
        mask_ptr = 0 if mask is None else mask.data.ptr
        choice = getattr(self.options, "attention_kernel", "auto")
        tf32 = ctx.cublas.use_tf32
        if flash_attention.choose(plan, choice, tf32):
            flash_attention.launch_flash(plan, q.data.ptr, k.data.ptr, v.data.ptr, mask_ptr, y.data.ptr, tf32=tf32)
        else:
            work = cupy.empty((plan.workspace_bytes,), np.uint8)
            launch_attention(ctx.cublas, plan, q.data.ptr, k.data.ptr, v.data.ptr, mask_ptr, y.data.ptr,
                             work.data.ptr)
        count = num_outputs(ctx)
        for index, (x, shape) in enumerate(zip((k, v), plan.present_shapes), start=1):
            if count > index:
                src = x if not plan.seq_major else x.reshape(shape[0], shape[2], shape[1], shape[3]).transpose(
                    0, 2, 1, 3)
                cupy.copyto(ctx.output(index, shape, x.dtype), src)

    def _plan(self, q_shape, k_shape, v_shape, mask_shape, mask_dtype, dtype):
        return attention_plan(q_shape, k_shape, v_shape, mask_shape, mask_dtype, self.q_heads, self.kv_heads,
                              self.causal, self.scale, self.softcap, dtype, f"Attention node '{self.node_name}'")
