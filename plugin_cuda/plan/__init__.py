"""Compiled execution plans for fused partitions of the CUDA plugin (ABI v6 `Ep.Compile`).

Modules: lower (ONNX nodes -> plan ops, rules in lower_*.py), fuse (ops -> steps), codegen (CUDA
source), memory_plan (liveness-based arena offsets), plan (Plan.build / Plan.run), partition
(claim_fused grouping). NVRTC, the driver, cuBLAS and capture come from the device layer
(plugin_cuda/device). Everything but plan imports without CuPy.
"""

from plugin_cuda.plan.errors import DriverError, PlanError

__all__ = ["DriverError", "PlanError"]
