"""Compiled-plan Attention on the fused flash kernel (kernels/flash_source.py).

The Attention lowering (lower_rows.py) emits one `flash_attention` op, reading Q, K, V (and the
float mask) and writing Y, instead of its bgemm / softmax / bgemm chain when `wants_flash` says so
(option attention_kernel, kernels/flash_attention.choose); then no Sq x Skv scores buffer is planned.
`kernel` generates the step's CUDA: a wrapper that calls the shared fa_tile body (fa_tile_tf32 where
the plan's use_tf32 is on and the device has TF32 tensor cores) with every size,
stride and the scale as literals (symbolic sizes as their expressions: plan/symint.py).
"""

from __future__ import annotations

from plugin_cuda.kernels import flash_attention as flash
from plugin_cuda.kernels.flash_source import BODY, THREADS, key_block
from plugin_cuda.kernels.flash_tf32_source import BODY_TF32
from plugin_cuda.plan.codegen import KernelSpec
from plugin_cuda.plan.program import f32_literal

KIND = "flash_attention"
MASK_F32 = 2  # a plan's values are float32: its mask is an additive float32 one


def wants_flash(plan) -> bool:
    """Whether the plan's Attention `plan` (an AttentionPlan) runs as one flash_attention op."""
    return flash.choose(plan, flash.plan_choice(), flash.plan_tf32())


def tf32() -> bool:
    """Whether the plan being lowered runs its flash steps on TF32 tensor cores (use_tf32, sm_80+)."""
    return flash.plan_tf32()


def _i64(x) -> str:
    return f"(fa_i64)({x})"


def kernel(prog, step, name: str):
    """The KernelSpec of a flash_attention step (codegen.GENERATORS)."""
    op = step.op
    plan = op.attrs["plan"]
    has_mask = len(op.inputs) > 3
    q_st, kv_st, y_st = flash.strides(plan)
    mb, mh, mi, _ = plan.mask_strides
    mask = "p3" if has_mask else "0"
    out = "p4" if has_mask else "p3"
    decls = ["const float* __restrict__ p0", "const float* __restrict__ p1", "const float* __restrict__ p2"]
    decls += (["const float* __restrict__ p3"] if has_mask else []) + [f"float* __restrict__ {out}"]
    sizes = ", ".join(_i64(s) for s in q_st + kv_st + y_st + (mb, mh, mi))
    tensor = bool(op.attrs.get("tf32"))
    head = int(plan.head)  # a template argument: a literal even where the size is symbolic
    body = f"fa_tile_tf32<{head}, " if tensor else f"fa_tile<float, {head}, "
    src = (f'extern "C" __global__ void __launch_bounds__({THREADS}) {name}({", ".join(decls)}) {{\n'
           f"  {body}{key_block(head)}>(p0, p1, p2, {mask}, {out}, {sizes},\n"
           f"      {MASK_F32 if has_mask else 0}, {plan.mask_len}, {plan.q_heads // plan.kv_heads}, {plan.q_len}, "
           f"{plan.kv_len}, {int(plan.causal)}, {f32_literal(plan.scale)}, {f32_literal(plan.softcap)});\n}}\n")
    return KernelSpec(name, list(op.inputs) + list(op.outputs), flash.grid(plan, tensor), (THREADS, 1, 1),
                      BODY + BODY_TF32 + src, step)
