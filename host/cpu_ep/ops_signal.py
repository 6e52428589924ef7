"""Window functions (HannWindow, HammingWindow, BlackmanWindow), Det, and the deprecated Scatter.

Windows follow ONNX's definitions: `periodic` (the default) computes the window of size N+1 and
drops the last sample, as spectral analysis wants; otherwise the symmetric window of size N.
"""

from __future__ import annotations

import numpy as np
import onnx

from host.cpu_ep.base import OpKernel, compute_dtype, scalar
from host.cpu_ep.ops_index import ScatterElements
from host.cpu_ep.registry import register


class _Window(OpKernel):
    # Cosine-sum coefficients a0, a1, a2: w[n] = a0 - a1 cos(2 pi n / N) + a2 cos(4 pi n / N).
    coefficients: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __init__(self, node):
        super().__init__(node)
        self.periodic = self.attr_bool("periodic", 1)
        to = self.attr_int("output_datatype", onnx.TensorProto.FLOAT)
        try:
            self.dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
        except (KeyError, ValueError, TypeError) as exc:
            raise self.bad_attr("output_datatype", to, "an onnx.TensorProto data type") from exc

    def _run(self, size):
        n = int(scalar(size))
        if n < 0:
            raise ValueError(f"size must be >= 0, got {n}")
        denominator = n if self.periodic else n - 1
        a0, a1, a2 = self.coefficients
        k = np.arange(n, dtype=np.float64)
        with np.errstate(all="ignore"):
            phase = 2 * np.pi * k / denominator if denominator > 0 else np.zeros(n)
        w = a0 - a1 * np.cos(phase) + a2 * np.cos(2 * phase)
        return (w.astype(self.dtype),)


@register("HannWindow", since=17)
class HannWindow(_Window):
    coefficients = (0.5, 0.5, 0.0)


@register("HammingWindow", since=17)
class HammingWindow(_Window):
    coefficients = (25 / 46, 21 / 46, 0.0)


@register("BlackmanWindow", since=17)
class BlackmanWindow(_Window):
    coefficients = (0.42, 0.5, 0.08)


@register("Det", since=11)
class Det(OpKernel):
    """Determinants of the trailing square matrices (..., M, M)."""

    def _run(self, x):
        if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
            raise ValueError(f"Det takes (..., M, M) matrices, got shape {x.shape}")
        return (np.linalg.det(x.astype(compute_dtype(x.dtype), copy=False)).astype(x.dtype),)


@register("Scatter", since=9, until=10)
class Scatter(ScatterElements):
    """Deprecated in opset 11 in favour of ScatterElements, which it equals."""
