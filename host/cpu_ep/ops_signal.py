"""Window functions (HannWindow, HammingWindow, BlackmanWindow), MelWeightMatrix, Det, and the deprecated
Scatter.

Windows follow ONNX's definitions: `periodic` (the default) computes the window of size N+1 and
drops the last sample, as spectral analysis wants; otherwise the symmetric window of size N.
"""

from __future__ import annotations

import numpy as np
import onnx

from host.cpu_ep.base import OpKernel, compute_dtype, scalar
from host.cpu_ep.ops_index import ScatterElements
from host.cpu_ep.registry import register
from host.errors import InvalidArgument


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


def _output_dtype(kernel: OpKernel) -> np.dtype:
    to = kernel.attr_int("output_datatype", onnx.TensorProto.FLOAT)
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to))
    except (KeyError, ValueError, TypeError) as exc:
        raise kernel.bad_attr("output_datatype", to, "an onnx.TensorProto data type") from exc


@register("MelWeightMatrix", since=17)
class MelWeightMatrix(OpKernel):
    """The (dft_length // 2 + 1, num_mel_bins) matrix of triangular filters that maps a one-sided
    spectrum's bins onto mel bands (mel = 2595 log10(1 + hz / 700))."""

    def __init__(self, node):
        super().__init__(node)
        self.dtype = _output_dtype(self)

    def _run(self, num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz):
        mels, dft, rate = int(scalar(num_mel_bins)), int(scalar(dft_length)), int(scalar(sample_rate))
        low, high = float(scalar(lower_edge_hertz)), float(scalar(upper_edge_hertz))
        if mels < 1 or dft < 1 or rate < 1 or not 0 <= low <= high:
            raise InvalidArgument(f"MelWeightMatrix: num_mel_bins, dft_length and sample_rate must be >= 1 and "
                                  f"0 <= lower_edge_hertz <= upper_edge_hertz; got {mels}, {dft}, {rate}, {low}, {high}")
        # num_mel_bins + 2 band edges evenly spaced in mel, as spectrogram bin indices (floored). The mel
        # step divides by the edge count (num_mel_bins + 2), as onnx's reference and onnxruntime do.
        low_mel, high_mel = (2595 * np.log10(1 + hz / 700) for hz in (low, high))
        edges_mel = np.arange(mels + 2) * ((high_mel - low_mel) / (mels + 2)) + low_mel
        edges_hz = 700 * (10 ** (edges_mel / 2595) - 1)
        edges = np.floor((dft + 1) * edges_hz / rate).astype(np.int64)
        if edges[-1] > dft // 2:
            raise InvalidArgument(f"MelWeightMatrix: upper_edge_hertz {high} maps to spectrogram bin {edges[-1]}, past the "
                                  f"last of the {dft // 2 + 1} bins of dft_length {dft} at sample_rate {rate} (allowed: "
                                  f"up to about sample_rate / 2)")
        left, center, right = edges[:-2], edges[1:-1], edges[2:]
        j = np.arange(dft // 2 + 1)[:, None]
        # Rising edge left..center (a zero-width one is 1 at its center), falling edge center..right-1.
        rising = np.where(center > left, (j - left) / np.maximum(center - left, 1), 1.0)
        falling = (right - j) / np.maximum(right - center, 1)
        w = np.where((j >= left) & (j <= center), rising, np.where((j >= center) & (j < right), falling, 0.0))
        return (w.astype(self.dtype),)


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
