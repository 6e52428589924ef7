"""Attention-23 as one fused kernel (flash style, flash_source.py): the choice between it and the
two-GEMM path of attention.py, its argument layout and its launch.

The choice (`choose`): option `attention_kernel` = auto | flash | gemm. `flash` and `auto` take
the fused kernel only where it fits: head size in HEAD_SIZES and V's head size equal to Q's
(others run on the two GEMMs, the reference path). `auto` takes it from AUTO_MIN_KEYS keys (one
threshold for the tensor-core kernels, one for the exact-float32 SIMT kernel) and AUTO_MIN_QUERIES
queries on, where the two-GEMM path's Sq x Skv float32 scores (written, read, written, read) cost
more than the fused kernel's on-chip softmax (docs/cuda_ops.md has the figures).

float16 and bfloat16 run on tensor cores (mma.sync, float32 accumulation: flash_mma_source.py),
float32 on TF32 tensor cores where use_tf32 is on (flash_tf32_source.py), else on the SIMT kernel
in exact float32 (flash_source.py).
The launch needs no workspace and makes no allocation or synchronisation: capturable.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import numpy as np

from ..device.nvrtc import KernelLibrary
from .flash_mma_source import BLOCK_Q_MMA
from .flash_source import BLOCK_Q, HEAD_SIZES, THREADS, library_source

__all__ = ["AUTO_MIN_KEYS", "AUTO_MIN_QUERIES", "CHOICES", "auto_kind", "choose", "fits", "kernel_choice", "launch_flash", "plan_choice", "plan_tf32",
           "strides", "tensor_cores"]

CHOICES = ("auto", "flash", "gemm")
# auto: the fused kernel from this many keys on, per kernel kind (bench/attention_gpu.py on an H100,
# B=8 H=12 D=64: the half-type tensor-core kernel beats the two GEMMs from 128 keys on (1.9x), the
# exact float32 SIMT kernel beats the strict-float32 GEMMs at 2048 keys (1.2x); TF32: not measured
# yet, the SIMT kernel's crossover kept).
AUTO_MIN_KEYS = {"half": 64, "tf32": 1024, "simt": 1024}
# and from this many queries: the kernel parallelises over query tiles (no split over the keys), so a
# few queries against many keys (decoding) leave the GPU idle; the GEMMs are cheap there anyway.
AUTO_MIN_QUERIES = 64
# The option's value for compiled plans being lowered on this thread (Plan.build sets it).
_PLAN_CHOICE = contextvars.ContextVar("attention_kernel", default=("auto", False))

# One module per kind and dtype, compiled at first use: a dtype's SIMT kernels or its tensor-core ones.
LIBRARIES = {kind: KernelLibrary("", tuple(f"ephost_flash_{v}d{d}" for v in prefixes for d in HEAD_SIZES),
                                 lambda _body, dtype, kind=kind: library_source(np.dtype(dtype).name, kernels=(kind,)))
             for kind, prefixes in (("simt", ("",)), ("tensor", ("mma_", "tf32_")))}


def fits(plan) -> bool:
    """Whether the fused kernel computes `plan` (an attention.AttentionPlan)."""
    return plan.head in HEAD_SIZES and plan.v_head == plan.head and plan.kv_len > 0


def choose(plan, choice: str = "auto", tf32: bool = False) -> bool:
    """True: run `plan` on the fused kernel; False: on the two GEMMs. `tf32`: float32 may use TF32
    tensor cores (option use_tf32), which moves auto's threshold."""
    if choice not in CHOICES:
        raise ValueError(f"attention_kernel {choice!r}; allowed: {', '.join(CHOICES)}")
    if choice == "gemm" or not fits(plan):
        return False
    if choice == "flash":
        return True
    return plan.kv_len >= AUTO_MIN_KEYS[auto_kind(plan, tf32)] and plan.q_len >= AUTO_MIN_QUERIES


def auto_kind(plan, tf32: bool = False) -> str:
    """Which AUTO_MIN_KEYS threshold `plan` goes by: the kernel it would run on."""
    if plan.dtype.itemsize == 2:
        return "half" if _tensor_capable() else "simt"
    return "tf32" if tf32 and _tensor_capable() else "simt"


def _tensor_capable() -> bool:
    """sm_80 or newer; True where no device can be asked (lowering on a machine without one)."""
    try:
        return _capability() >= 80
    except Exception:  # noqa: BLE001 - no CuPy or no device
        return True


@contextlib.contextmanager
def kernel_choice(choice: str, tf32: bool = False):
    """Lower compiled plans under `choice` (the EP's attention_kernel option) and `tf32` (the plan's
    use_tf32: float32 flash steps on TF32 tensor cores) in this block."""
    if choice not in CHOICES:
        raise ValueError(f"attention_kernel {choice!r}; allowed: {', '.join(CHOICES)}")
    token = _PLAN_CHOICE.set((choice, bool(tf32)))
    try:
        yield
    finally:
        _PLAN_CHOICE.reset(token)


def plan_choice() -> str:
    """The attention_kernel choice in force for plan lowering (kernel_choice's, else auto)."""
    return _PLAN_CHOICE.get()[0]


def plan_tf32() -> bool:
    """Whether float32 flash steps of plans lowered now run on TF32 tensor cores (sm_80 on)."""
    if not _PLAN_CHOICE.get()[1]:
        return False
    try:
        return _capability() >= 80
    except Exception:  # noqa: BLE001 - no CuPy or no device: the exact SIMT kernel
        return False


def strides(plan) -> tuple:
    """Element strides (batch, head, position) of Q, of K and V, of Y: 4-D (B, H, S, D) or the 3-D
    (B, S, H * D) form."""
    d, hq, hkv, sq, skv = plan.head, plan.q_heads, plan.kv_heads, plan.q_len, plan.kv_len
    if plan.seq_major:
        q = (sq * hq * d, d, hq * d)
        kv = (skv * hkv * d, d, hkv * d)
    else:
        q = (hq * sq * d, sq * d, d)
        kv = (hkv * skv * d, skv * d, d)
    return q, kv, q


def tensor_cores(plan, tf32: bool = False) -> bool:
    """Whether `plan` runs on tensor cores (sm_80 on): the half types always (flash_mma_source.py),
    float32 with `tf32` (the use_tf32 option: flash_tf32_source.py); else the SIMT kernel."""
    return (plan.dtype.itemsize == 2 or bool(tf32)) and _capability() >= 80


@functools.cache
def _capability_of(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def _capability() -> int:
    import cupy

    return _capability_of(cupy.cuda.runtime.getDevice())


def grid(plan, mma: bool = False) -> tuple:
    rows = BLOCK_Q_MMA if mma else BLOCK_Q
    return ((plan.q_len + rows - 1) // rows, plan.q_heads, plan.batch)


def launch_flash(plan, q: int, k: int, v: int, mask: int, y: int, mma: bool | None = None, tf32: bool = False) -> None:
    """Y of `plan` (fits(plan) holds) on CuPy's current stream; pointers as ints, mask 0 when absent.
    `mma`: on tensor cores (None: tensor_cores(plan, tf32)); float32 there is TF32."""
    if plan.batch * plan.q_heads * plan.q_len == 0:
        return
    mma = tensor_cores(plan, tf32) if mma is None else mma
    variant = ("mma_" if plan.dtype.itemsize == 2 else "tf32_") if mma else ""
    sq_, skv_, sy_ = strides(plan)
    mb, mh, mi, _ = plan.mask_strides
    kind = plan.mask_kind if mask else 0
    i64, i32 = np.int64, np.int32
    LIBRARIES["tensor" if mma else "simt"].function(f"ephost_flash_{variant}d{plan.head}", plan.dtype)(
        grid(plan, mma), (THREADS,),
        (np.uint64(q), np.uint64(k), np.uint64(v), np.uint64(mask), np.uint64(y),
         *(i64(s) for s in sq_ + skv_ + sy_), i64(mb), i64(mh), i64(mi), i32(kind), i32(plan.mask_len),
         i32(plan.q_heads // plan.kv_heads), i32(plan.q_len), i32(plan.kv_len), i32(plan.causal),
         np.float32(plan.scale), np.float32(plan.softcap)),
    )
