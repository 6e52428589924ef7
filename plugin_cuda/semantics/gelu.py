"""GELU, once: the constants of its erf and tanh forms and their CUDA C definitions, included by
every CUDA source of the plugin (the compiled plans' prelude, the fused kernels, the elementwise
kernels)."""

from __future__ import annotations

from abi.gelu import GELU_TANH_COEFF, SQRT_2_OVER_PI, SQRT_HALF

__all__ = ["GELU_CUDA", "GELU_TANH_COEFF", "SQRT_2_OVER_PI", "SQRT_HALF"]

# The constants are abi/gelu.py's (the host's CPU EP and optimizer use the same ones).

# Plain C as well (the CPU test shim of the generated kernels compiles it with g++). A decimal
# literal with the f suffix rounds to the nearest float32, the value the kernels always used.
GELU_CUDA = f"""
__device__ __forceinline__ float ep_gelu(float a) {{ return 0.5f * a * (1.0f + erff(a * {SQRT_HALF!r}f)); }}
__device__ __forceinline__ float ep_gelu_tanh(float a) {{
  return 0.5f * a * (1.0f + tanhf({SQRT_2_OVER_PI!r}f * (a + {GELU_TANH_COEFF!r}f * a * a * a)));
}}
"""
