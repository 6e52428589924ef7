"""Compiled execution plans for fused partitions of the CUDA plugin (ABI v6 `Ep.Compile`).

Modules: lower (ONNX nodes -> plan ops), fuse (ops -> steps), codegen (CUDA source), memory_plan
(liveness-based arena offsets), kernel_cache (NVRTC modules by source hash), driver (cuLaunchKernel
and graph capture through cffi), plan (Plan.build / Plan.run), partition (claim_fused grouping).
Everything but plan, driver and kernel_cache imports without CuPy.
"""

from plugin_cuda.plan.errors import DriverError, PlanError

__all__ = ["DriverError", "PlanError"]
