"""GELU's constants, for both sides of the ABI (the host's optimizer and CPU EP, the CUDA plugin).

    erf form:  0.5 x (1 + erf(x / sqrt(2)))
    tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))   (Gelu-20 approximate='tanh')
"""

from __future__ import annotations

import math

SQRT_2 = math.sqrt(2.0)
SQRT_HALF = math.sqrt(0.5)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_COEFF = 0.044715

__all__ = ["GELU_TANH_COEFF", "SQRT_2", "SQRT_2_OVER_PI", "SQRT_HALF"]
