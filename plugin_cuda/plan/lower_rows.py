"""Lowering rules of the row kernels: Softmax, the normalisations, Attention, RotaryEmbedding and
the trailing-axis means (ReduceMean, GlobalAveragePool)."""

from __future__ import annotations

import math

import numpy as np

from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.lowering import (
    EPHOST_DOMAIN,
    attributes,
    broadcast,
    ew,
    lowers,
    norm_axis,
    present,
    view,
)
from plugin_cuda.plan.symint import dim
from plugin_cuda.semantics import shapes

# ---------------------------------------------------------------------------------------------
# Row kernels: softmax and normalisations


@lowers("Softmax", "LogSoftmax")
def _softmax(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    default = shapes.softmax_default_axis(node.opset)
    axis = norm_axis(node, attributes(node).integer("axis", default), max(len(shape), 1))
    if axis != len(shape) - 1:
        raise PlanError(f"{node.op_type} node '{node.name}': axis {axis} of rank {len(shape)}; "
                        "a compiled plan supports the last axis only")
    ctx.set_shape(node, node.outputs[0], shape)
    ctx.emit("softmax", node, [x], [node.outputs[0]], log=node.op_type == "LogSoftmax", cols=shape[-1])


def _norm(ctx, node, x: int, scale: int, bias: int | None, kind: str, default_eps: float) -> None:
    shape = ctx.shape(x)
    attrs = attributes(node)
    axis = norm_axis(node, attrs.integer("axis", -1), max(len(shape), 1))
    cols = dim(math.prod(shape[axis:]))
    for vid, what in ((scale, "scale"), (bias, "bias")):
        if vid is not None and ctx.prog.values[vid].size != cols:
            raise PlanError(f"{node.op_type} node '{node.name}': {what} has shape {ctx.shape(vid)}; "
                            f"a compiled plan needs {cols} elements (the normalised shape {shape[axis:]})")
    attrs.integer("stash_type", 1, (1,))
    ctx.set_shape(node, node.outputs[0], shape)
    ins = [x, scale] + ([bias] if bias is not None else [])
    ctx.emit("norm", node, ins, [node.outputs[0]], kind=kind, eps=attrs.number("epsilon", default_eps),
             cols=cols)


def _used_outputs(ctx, node) -> list:
    return [v for v in node.outputs[1:] if v >= 0]


@lowers("LayerNormalization")
def _layer_norm(ctx, node):
    if _used_outputs(ctx, node):
        raise PlanError(f"LayerNormalization node '{node.name}': Mean/InvStdDev outputs are not supported "
                        "in a compiled plan")
    _norm(ctx, node, node.inputs[0], node.inputs[1], node.inputs[2] if present(node, 2) else None, "layer", 1e-5)


@lowers("RMSNormalization")
def _rms_norm(ctx, node):
    _norm(ctx, node, node.inputs[0], node.inputs[1], None, "rms", 1e-5)


@lowers("SkipLayerNormalization", domain=EPHOST_DOMAIN)
def _skip_layer_norm(ctx, node):
    x, skip = node.inputs[0], node.inputs[1]
    shape = broadcast(node, ctx.shape(x), ctx.shape(skip))
    extra = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] >= 0 else None
    total = extra if extra is not None else ctx.temp(node, shape, "sum")
    ew(ctx, node, [x, skip], total, "({0} + {1})")
    _norm(ctx, node, total, node.inputs[2], node.inputs[3] if present(node, 3) else None, "layer", 1e-12)


@lowers("Attention")
def _attention(ctx, node):
    """Attention-23 without past: scores = scale * Q K^T (cuBLAS, batched), a row softmax (causal
    when asked, plus the additive float attn_mask when given), Y = P V (cuBLAS). The GEMM layouts and
    the mask's broadcast strides come from the per-node kernel's attention_plan, so both paths read
    Q, K, V and the mask and write Y the same way."""
    try:
        from plugin_cuda.kernels.attention import attention_plan
    except ImportError as exc:
        raise PlanError(f"Attention node '{node.name}': the attention kernels are not available ({exc})") from None
    if any(present(node, i) for i in range(4, len(node.inputs))):
        raise PlanError(f"Attention node '{node.name}': past_key/past_value inputs are not supported in a "
                        "compiled plan")
    if any(v >= 0 for v in node.outputs[1:]):
        raise PlanError(f"Attention node '{node.name}': only output Y is supported in a compiled plan")
    attrs = attributes(node)
    if attrs.number("softcap", 0.0) != 0.0:
        raise PlanError(f"Attention node '{node.name}': softcap is not supported in a compiled plan")
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if present(node, 3) else None
    try:
        plan = attention_plan(ctx.shape(q), ctx.shape(k), ctx.shape(v), None if mask is None else ctx.shape(mask),
                              ctx.dtype(mask) if mask is not None else np.float32, attrs.integer("q_num_heads"),
                              attrs.integer("kv_num_heads"), attrs.flag("is_causal"), attrs.number("scale"), 0.0,
                              ctx.dtype(q), f"Attention node '{node.name}'")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    refused = _flash(ctx, node, plan, [q, k, v] + ([] if mask is None else [mask]))
    if not refused:
        return
    rows = plan.batch * plan.q_heads * plan.q_len
    # Scores in float32 whatever Q's type (cuBLAS writes a float32 C from half A and B); the
    # probabilities in V's type, the second GEMM's B operand.
    scores = ctx.temp(node, (rows, plan.kv_len), "scores", np.float32)
    probs = ctx.temp(node, (rows, plan.kv_len), "probs", ctx.dtype(v))
    ctx.set_shape(node, node.outputs[0], plan.out_shape)
    ctx.emit("bgemm", node, [k, q], [scores], gemm=plan.scores, alpha=plan.scale, flash_refused=refused)
    masked = {} if mask is None else {"mask_strides": plan.mask_strides[:3], "mask_len": plan.mask_len,
                                      "heads": plan.q_heads}
    ctx.emit("softmax", node, [scores] + ([] if mask is None else [mask]), [probs], log=False, cols=plan.kv_len,
             causal=plan.causal, q_len=plan.q_len, **masked)
    ctx.emit("bgemm", node, [v, probs], [node.outputs[0]], gemm=plan.values, alpha=1.0)


def _flash(ctx, node, plan, inputs: list) -> str:
    """Attention as one fused flash kernel (plan/flash_step.py) where option attention_kernel picks it
    and the kernel computes it (float32, float16 and bfloat16 plans): "" when emitted, else the reason
    it was not."""
    from plugin_cuda.plan import flash_step

    reason = flash_step.refusal(plan, [ctx.dtype(v) for v in inputs], ctx.prog.values[node.outputs[0]].dtype)
    if reason:
        return reason
    ctx.set_shape(node, node.outputs[0], plan.out_shape)
    half = np.dtype(ctx.dtype(inputs[0])) != np.float32
    ctx.emit(flash_step.KIND, node, inputs, [node.outputs[0]], plan=plan, tf32=not half and flash_step.tf32(),
             mma=half and flash_step.half_mma(plan))
    return ""


@lowers("RotaryEmbedding")
def _rotary(ctx, node):
    if present(node, 3):
        raise PlanError(f"RotaryEmbedding node '{node.name}': position_ids are not supported in a compiled plan")
    x, cos, sin = node.inputs[:3]
    shape = ctx.shape(x)
    attrs = attributes(node)
    heads = attrs.integer("num_heads", 0)
    if len(shape) == 4:
        batch, heads, seq, size = shape
    elif len(shape) == 3 and heads > 0 and shape[2] % heads == 0:
        batch, seq, size = shape[0], shape[1], shape[2] // heads
    else:
        raise PlanError(f"RotaryEmbedding node '{node.name}': input shape {shape} with num_heads {heads}; allowed: "
                        "4-D (batch, heads, seq, size), or 3-D with num_heads dividing the last dimension")
    rot = attrs.integer("rotary_embedding_dim", 0) or size
    cache = ctx.shape(cos)
    if rot % 2 or rot > size or ctx.shape(sin) != cache or len(cache) != 3 or cache[0] not in (1, batch) \
            or cache[1:] != (seq, rot // 2):
        raise PlanError(f"RotaryEmbedding node '{node.name}': caches {cache} and {ctx.shape(sin)} for input {shape} "
                        f"and rotary dim {rot}; a compiled plan needs both ({batch} or 1, {seq}, {rot // 2})")
    ctx.set_shape(node, node.outputs[0], shape)
    ctx.emit("rotary", node, [x, cos, sin], [node.outputs[0]], heads=heads, seq=seq, size=size, rot=rot,
             seq_major=len(shape) == 3, interleaved=attrs.flag("interleaved"),
             cache_batch=0 if cache[0] == 1 else seq * rot // 2)


def _mean(ctx, node, axes: list) -> None:
    shape = ctx.shape(node.inputs[0])
    axes = sorted({norm_axis(node, a, len(shape)) for a in axes})
    first = axes[0] if axes else len(shape)
    if axes != list(range(first, len(shape))):
        raise PlanError(f"{node.op_type} node '{node.name}': axes {axes} of rank {len(shape)}; a compiled plan "
                        "reduces trailing axes only")
    keep = attributes(node).flag("keepdims", 1)
    out = shape[:first] + ((1,) * (len(shape) - first) if keep else ())
    ctx.set_shape(node, node.outputs[0], out)
    ctx.emit("mean", node, [node.inputs[0]], [node.outputs[0]], inner=dim(math.prod(shape[first:])))


@lowers("ReduceMean")
def _reduce_mean(ctx, node):
    if present(node, 1):
        axes = list(ctx.host_ints(node, node.inputs[1], "the axes input"))
    else:
        axes = list(attributes(node).integers("axes") or [])
    if not axes:
        if attributes(node).flag("noop_with_empty_axes"):
            ctx.set_shape(node, node.outputs[0], ctx.shape(node.inputs[0]))
            view(ctx, node, node.inputs[0], node.outputs[0])
            return
        axes = list(range(len(ctx.shape(node.inputs[0]))))
    _mean(ctx, node, axes)


@lowers("GlobalAveragePool")
def _global_average_pool(ctx, node):
    _mean(ctx, node, list(range(2, len(ctx.shape(node.inputs[0])))))


