"""A compiled plan's algorithm choices made at session creation instead of its first run.

A plan makes its cuDNN convolution setups and cuBLASLt epilogue GEMMs when it first runs on a stream
(plan.py's _Instance). Making their algorithm choices here, right after Plan.build, puts them in the
context a session writes at creation (plan/saved.py takes the choices made since the partition's
mark) and takes the searches out of run 1: the run then finds them in device/algo_cache.py (and
the cuDNN setup in cudnn_conv's memo, the cuBLASLt GEMM in the plan's own table).
"""

from __future__ import annotations

import numpy as np

from plugin_cuda.device import cublas, cublaslt, cudnn_conv
from plugin_cuda.plan import cudnn_step
from plugin_cuda.plan.plan import epilogue_gemm


def make_choices(plan) -> None:
    """The choices of every cuDNN and cuBLASLt step of `plan` (a Plan built with an EP). A step whose
    choice fails here is left to its first run, which raises the same error where it did before."""
    ep = plan.ep
    if ep is None:
        return
    try:
        _make_choices(plan, ep)
    except Exception:  # noqa: BLE001 - see the docstring: nothing changes for a failing step
        return


def _make_choices(plan, ep) -> None:
    for variant in {id(v): v for v in (plan.eager, plan.graph)}.values():
        for step, spec in zip(variant.steps, variant.specs):
            if spec is not None or step.op is None or not _float32(plan, step.op):
                continue
            if step.kind == cudnn_step.KIND:
                _conv(plan, ep, step)
            elif "epilogue" in step.op.attrs and step.op.kind != "bgemm":
                _epilogue_gemm(plan, step, variant)


def _float32(plan, op) -> bool:
    """Only float32 steps: the setups and GEMMs made here are float32 ones (a value without a dtype
    is float32, the plan's only type before half-precision plans)."""
    value = plan.prog.values[op.outputs[0]]
    return np.dtype(getattr(value, "dtype", None) or np.float32) == np.float32  # None: float32 (np.dtype(None) is float64)


def _conv(plan, ep, step) -> None:
    handle = ep.cudnn_handles.take(0)
    if handle is None:  # no cuDNN here: the step says so at its first run, as before
        return
    try:
        with plan.cupy.cuda.Device(plan.device_id):
            cudnn_conv.setup(handle, "forward", cudnn_step.geometry(plan.prog, step.op), np.float32)
    finally:
        ep.cudnn_handles.give_back(handle)  # the first stream of the session takes it


def _epilogue_gemm(plan, step, variant) -> None:
    """The GEMM _CublasStep._cublaslt makes, under the same key, so the first run reuses it."""
    op = step.op
    kind, where = plan.location(op.inputs[2], variant)
    if kind != "const":  # the step refuses such a bias at its first run
        return
    compute = cublas.gemm_types(np.dtype(np.float32), plan.use_tf32)[1]
    with plan.cupy.cuda.Device(plan.device_id):
        plan.epilogue_gemm((variant.name, id(step)), lambda: epilogue_gemm(
            plan, step, plan._const_base + where, compute, cublaslt.CUDA_R_32F))
