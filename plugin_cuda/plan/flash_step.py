"""Compiled-plan Attention on the fused flash kernel (kernels/flash_source.py).

The Attention lowering (lower_rows.py) emits one `flash_attention` op, reading Q, K, V (and the
mask) and writing Y, instead of its bgemm / softmax / bgemm chain when `refusal` finds nothing
against it (option attention_kernel, kernels/flash_attention.choose, the element types); then no
Sq x Skv scores buffer is planned. Where it keeps the two GEMMs, the reason is recorded on the
chain's first bgemm op (attrs["flash_refused"]).

`kernel` generates the step's CUDA: a wrapper that calls one of the shared bodies with every size,
stride and the scale as literals (symbolic sizes as their expressions: plan/symint.py):
- float32: fa_tile (exact SIMT), or fa_tile_tf32 where the plan's use_tf32 is on and the device has
  TF32 tensor cores;
- float16 / bfloat16 plans: fa_tile_mma (mma.sync m16n8k16, float32 accumulation and softmax
  statistics, P rounded to the half type, Y rounded once) on sm_80 and newer, else fa_tile on the
  half type (widened to float32 in shared memory). The wrapper's pointers have the plan's storage
  types (half_bits / bf16_bits, codegen.check_pointer_types), passed on as the body's fa_f16 /
  fa_bf16 (the same 16 bits).
The mask is read in its own plan type: float32, float16 or bfloat16 (additive; kinds 2, 3, 4 of
flash_source.fa_mask), as the half plans store it.
"""

from __future__ import annotations

import numpy as np

from plugin_cuda.kernels import flash_attention as flash
from plugin_cuda.kernels.flash_mma_source import BODY_MMA
from plugin_cuda.kernels.flash_source import BODY, HEAD_SIZES, THREADS, key_block
from plugin_cuda.kernels.flash_tf32_source import BODY_TF32
from plugin_cuda.plan.codegen import KernelSpec, decl
from plugin_cuda.plan.program import BF16, F16, F32, f32_literal

KIND = "flash_attention"
# flash_source.fa_mask's kind per plan type of the mask (plans hold no bool values).
MASK_KINDS = {F32: 2, F16: 3, BF16: 4}
# The body's element type per plan type of Q, K, V and Y.
BODY_TYPES = {F32: "float", F16: "fa_f16", BF16: "fa_bf16"}


def wants_flash(plan) -> bool:
    """Whether the plan's Attention `plan` (an AttentionPlan) runs as one flash_attention op as far
    as the option and the kernel's sizes go (refusal adds the element types)."""
    return flash.choose(plan, flash.plan_choice(), flash.plan_tf32())


def refusal(plan, dtypes: list, out_dtype) -> str:
    """Why the plan's Attention keeps the two GEMMs ("" where it runs as one flash_attention op).
    `dtypes`: the plan types of Q, K, V (and the mask); `out_dtype`: Y's (None: not known yet)."""
    choice = flash.plan_choice()
    if choice == "gemm":
        return "attention_kernel=gemm"
    if plan.head not in HEAD_SIZES:
        return f"head size {plan.head}; the fused kernel has {', '.join(map(str, HEAD_SIZES))}"
    if plan.v_head != plan.head:
        return f"V's head size {plan.v_head} differs from Q's {plan.head}; the fused kernel keeps one"
    if not flash.fits(plan):
        return "no keys"
    if not wants_flash(plan):
        return (f"attention_kernel=auto: {plan.q_len} queries, {plan.kv_len} keys; the fused kernel from "
                f"{flash.AUTO_MIN_QUERIES} queries and {flash.AUTO_MIN_KEYS[flash.auto_kind(plan, tf32())]} keys")
    q, k, v = (np.dtype(d) for d in dtypes[:3])
    if k != q or v != q or out_dtype not in (None, q):
        out = "?" if out_dtype is None else np.dtype(out_dtype).name
        return (f"Q, K, V, Y of element types {q.name}, {k.name}, {v.name}, {out}; the fused kernel reads and "
                "writes one type")
    return ""


def tf32() -> bool:
    """Whether the plan being lowered runs its float32 flash steps on TF32 tensor cores (use_tf32, sm_80+)."""
    return flash.plan_tf32()


def half_mma(plan) -> bool:
    """Whether a float16 / bfloat16 `plan` runs on tensor cores (sm_80+; True where no device can be
    asked, as auto's threshold assumes)."""
    return flash.auto_kind(plan) == "half"


def _i64(x) -> str:
    return f"(fa_i64)({x})"


def _body_call(op, dtype, head: int) -> str:
    """`fa_tile...<...>(` of the step's kernel: the body for its type and tensor-core choice."""
    if dtype == F32:
        return f"fa_tile_tf32<{head}, {key_block(head)}>(" if op.attrs.get("tf32") else \
            f"fa_tile<float, {head}, {key_block(head)}>("
    if op.attrs.get("mma"):
        return f"fa_tile_mma<{BODY_TYPES[dtype]}, {head}>("
    return f"fa_tile<{BODY_TYPES[dtype]}, {head}, {key_block(head)}>("


def kernel(prog, step, name: str):
    """The KernelSpec of a flash_attention step (codegen.GENERATORS)."""
    op = step.op
    plan = op.attrs["plan"]
    has_mask = len(op.inputs) > 3
    dtype = prog.values[op.inputs[0]].dtype or F32
    q_st, kv_st, y_st = flash.strides(plan)
    mb, mh, mi, _ = plan.mask_strides
    params = list(op.inputs) + list(op.outputs)
    decls = [decl(prog, vid, f"p{i}", const=i < len(op.inputs)) for i, vid in enumerate(params)]
    fa_type = BODY_TYPES[dtype]
    q, k, v, y = (f"(const {fa_type}*)p0", f"(const {fa_type}*)p1", f"(const {fa_type}*)p2",
                  f"({fa_type}*)p{len(op.inputs)}")
    mask = "p3" if has_mask else "0"
    mask_kind = MASK_KINDS[prog.values[op.inputs[3]].dtype or F32] if has_mask else 0
    sizes = ", ".join(_i64(s) for s in q_st + kv_st + y_st + (mb, mh, mi))
    head = int(plan.head)  # a template argument: a literal even where the size is symbolic
    src = (f'extern "C" __global__ void __launch_bounds__({THREADS}) {name}({", ".join(decls)}) {{\n'
           f"  {_body_call(op, dtype, head)}{q}, {k}, {v}, {mask}, {y}, {sizes},\n"
           f"      {mask_kind}, {plan.mask_len}, {plan.q_heads // plan.kv_heads}, {plan.q_len}, "
           f"{plan.kv_len}, {int(plan.causal)}, {f32_literal(plan.scale)}, {f32_literal(plan.softcap)});\n}}\n")
    tensor = bool(op.attrs.get("tf32") if dtype == F32 else op.attrs.get("mma"))
    bodies = BODY + (BODY_TF32 if dtype == F32 else BODY_MMA)
    return KernelSpec(name, params, flash.grid(plan, tensor), (THREADS, 1, 1), bodies + src, step)
