"""Ops that onnx added in opsets 24..27 for sequence models: Swish (24), TensorScatter (24, a KV-cache
write), CausalConvWithState (27, the stateful depthwise causal conv of Mamba / Gated DeltaNet)."""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype, normalize_axis
from host.cpu_ep.registry import register
from host.errors import InvalidArgument


def _silu(x: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    return x / (1 + np.exp(-alpha * x))


@register("Swish", since=24)
class Swish(OpKernel):
    """x * sigmoid(alpha * x)."""

    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 1.0)

    def _run(self, x):
        ct = compute_dtype(x.dtype)
        return (_silu(x.astype(ct, copy=False), ct.type(self.alpha)).astype(x.dtype, copy=False),)


@register("TensorScatter", since=24)
class TensorScatter(OpKernel):
    """present = past_cache with `update` written along `axis` at write_indices[b] (per batch entry),
    positions wrapping around the cache in circular mode."""

    def __init__(self, node):
        super().__init__(node)
        self.mode = self.attr_str("mode", "linear", ("linear", "circular"))
        self.axis = self.attr_int("axis", -2)

    def _run(self, past, update, write_indices=None):
        axis = normalize_axis(self.axis, past.ndim)
        if axis == 0 or update.ndim != past.ndim or update.shape[axis] > past.shape[axis] or any(
                u != p for i, (u, p) in enumerate(zip(update.shape, past.shape)) if i != axis):
            raise InvalidArgument(f"TensorScatter: update {list(update.shape)} must match past_cache "
                                  f"{list(past.shape)} except along axis {axis} (not 0), where it may be shorter")
        batch, length, steps = past.shape[0], past.shape[axis], update.shape[axis]
        starts = np.zeros(batch, np.int64) if write_indices is None else write_indices.astype(np.int64)
        positions = starts[:, None] + np.arange(steps)  # (batch, steps)
        if self.mode == "circular":
            positions %= max(length, 1)
        elif steps and (positions.min() < 0 or positions.max() >= length):
            raise InvalidArgument(f"TensorScatter: write_indices {starts.tolist()} plus {steps} updates leave the "
                                  f"cache's {length} positions along axis {axis} (linear mode)")
        present = past.copy()
        target = np.moveaxis(present, axis, 1)  # a view: (batch, length, ...) with the other axes after
        target[np.arange(batch)[:, None], positions] = np.moveaxis(update, axis, 1)
        return (present,)


@register("CausalConvWithState", since=27)
class CausalConvWithState(OpKernel):
    """Depthwise causal 1-D convolution over (batch, channels, length), left-padded by past_state (or zeros),
    with optional bias and fused SiLU; present_state is the last k-1 positions of the padded input."""

    def __init__(self, node):
        super().__init__(node)
        self.activation = self.attr_str("activation", "none", ("none", "silu", "swish"))

    def _run(self, x, weight, bias=None, past_state=None):
        if x.ndim != 3 or weight.ndim != 3 or weight.shape[0] != x.shape[1] or weight.shape[1] != 1:
            raise InvalidArgument(f"CausalConvWithState: input must be (batch, channels, length) and weight "
                                  f"(channels, 1, k); got {list(x.shape)} and {list(weight.shape)}")
        b, c, _ = x.shape
        k = weight.shape[2]
        if past_state is None:
            past_state = np.zeros((b, c, k - 1), x.dtype)
        elif past_state.shape != (b, c, k - 1):
            raise InvalidArgument(f"CausalConvWithState: past_state must have shape {[b, c, k - 1]}; "
                                  f"got {list(past_state.shape)}")
        padded = np.concatenate([past_state, x], axis=2)
        ct = compute_dtype(x.dtype)
        windows = np.lib.stride_tricks.sliding_window_view(padded.astype(ct, copy=False), k, axis=2)
        y = np.einsum("bclk,ck->bcl", windows, weight[:, 0, :].astype(ct, copy=False))
        if bias is not None:
            y += bias.astype(ct, copy=False)[:, None]
        if self.activation != "none":
            y = _silu(y)
        return y.astype(x.dtype, copy=False), padded[:, :, padded.shape[2] - (k - 1):]
