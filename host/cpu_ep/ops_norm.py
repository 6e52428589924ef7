"""Normalizations and norm-based pools beyond the transformer set: LpPool, GlobalLpPool,
LpNormalization, Hardmax, MeanVarianceNormalization, LRN, InstanceNormalization, GroupNormalization.
Half types compute in float32 and come back in their own type."""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype, normalize_axes, normalize_axis
from host.cpu_ep.ops_nn import _pad_spatial, _taps, _windows
from host.cpu_ep.ops_pool import _Pool
from host.cpu_ep.registry import register


@register("LpPool", since=2)
class LpPool(_Pool):
    """(sum over the window of |x|^p)^(1/p); padding cells are zeros."""

    def __init__(self, node):
        super().__init__(node)
        self.p = self.attr_int("p", 2, lo=1)

    def _run(self, x):
        g, strides, dilations = self._params(x, self.kernel_shape)
        ct = compute_dtype(x.dtype)
        if 0 in g.out or x.size == 0:
            return (np.zeros(x.shape[:2] + g.out, dtype=x.dtype),)
        powered = np.abs(x.astype(ct, copy=False)) ** self.p
        taps = _taps(_windows(_pad_spatial(powered, g, 0), g, self.kernel_shape, strides, dilations),
                     len(self.kernel_shape))
        total = next(taps).copy()
        for tap in taps:
            total += tap
        return ((total ** (1.0 / self.p)).astype(x.dtype, copy=False),)


@register("GlobalLpPool", since=2)
class GlobalLpPool(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.p = self.attr_int("p", 2, lo=1)

    def _run(self, x):
        xf = np.abs(x.astype(compute_dtype(x.dtype), copy=False))
        axes = tuple(range(2, x.ndim))
        return ((np.sum(xf ** self.p, axis=axes, keepdims=True) ** (1.0 / self.p)).astype(x.dtype),)


@register("LpNormalization", since=1)
class LpNormalization(OpKernel):
    """x / ||x||_p along axis (p 1 or 2); a zero norm gives 0."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)
        self.p = self.attr_int("p", 2, lo=1, hi=2)

    def _run(self, x):
        ax = normalize_axis(self.axis, x.ndim)
        xf = x.astype(compute_dtype(x.dtype), copy=False)
        norm = np.sum(np.abs(xf), axis=ax, keepdims=True) if self.p == 1 else np.sqrt(
            np.sum(xf * xf, axis=ax, keepdims=True))
        y = np.where(norm == 0, 0, xf / np.where(norm == 0, 1, norm))
        return (y.astype(x.dtype, copy=False),)


@register("Hardmax", since=1)
class Hardmax(OpKernel):
    """1 at the first maximum along axis, 0 elsewhere. Before opset 13 the input is seen as 2-D
    (axes before `axis` x the rest), as Softmax was."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1 if self.opset >= 13 else 1)

    def _run(self, x):
        ax = normalize_axis(self.axis, x.ndim)
        shaped = x if self.opset >= 13 else x.reshape(int(np.prod(x.shape[:ax])), -1)
        axis = ax if self.opset >= 13 else 1
        index = np.expand_dims(np.argmax(shaped, axis=axis), axis)
        y = np.zeros_like(shaped)
        np.put_along_axis(y, index, 1, axis=axis)
        return (y.reshape(x.shape),)


@register("MeanVarianceNormalization", since=9)
class MeanVarianceNormalization(OpKernel):
    """(x - mean) / sqrt(var) over `axes` (default 0, 2, 3), with onnx's epsilon 1e-9 under the root."""

    def __init__(self, node):
        super().__init__(node)
        self.axes = self.attr_ints("axes", [0, 2, 3])

    def _run(self, x):
        axes = normalize_axes(self.axes, x.ndim)
        xf = x.astype(compute_dtype(x.dtype), copy=False)
        mean = np.mean(xf, axis=axes, keepdims=True)
        var = np.mean(xf * xf, axis=axes, keepdims=True) - mean * mean
        return (((xf - mean) / np.sqrt(var + 1e-9)).astype(x.dtype, copy=False),)


@register("LRN", since=1)
class LRN(OpKernel):
    """x / (bias + alpha / size * sum of x^2 over the `size` neighbouring channels)^beta."""

    def __init__(self, node):
        super().__init__(node)
        self.size = self.attr_int("size", lo=1)
        self.alpha = self.attr_float("alpha", 0.0001)
        self.beta = self.attr_float("beta", 0.75)
        self.bias = self.attr_float("bias", 1.0)

    def _run(self, x):
        xf = x.astype(compute_dtype(x.dtype), copy=False)
        sq = xf * xf
        c = x.shape[1]
        before, after = (self.size - 1) // 2, self.size - 1 - (self.size - 1) // 2
        padded = np.pad(sq, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
        csum = np.cumsum(padded, axis=1)
        csum = np.concatenate([np.zeros_like(csum[:, :1]), csum], axis=1)
        window = csum[:, self.size:self.size + c] - csum[:, :c]
        y = xf / (self.bias + self.alpha / self.size * window) ** self.beta
        return (y.astype(x.dtype, copy=False),)


def _normalize(xf: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    mean = np.mean(xf, axis=axes, keepdims=True)
    var = np.mean(np.square(xf - mean), axis=axes, keepdims=True)
    return (xf - mean) / np.sqrt(var + eps)


@register("InstanceNormalization", since=1)
class InstanceNormalization(OpKernel):
    """Per sample and channel over the spatial axes, then scale[c] and bias[c]."""

    def __init__(self, node):
        super().__init__(node)
        self.eps = self.attr_float("epsilon", 1e-5)

    def _run(self, x, scale, bias):
        xf = x.astype(compute_dtype(x.dtype), copy=False)
        y = _normalize(xf, tuple(range(2, x.ndim)), self.eps)
        bshape = (1, -1) + (1,) * (x.ndim - 2)
        return ((y * scale.reshape(bshape) + bias.reshape(bshape)).astype(x.dtype, copy=False),)


@register("GroupNormalization", since=18)
class GroupNormalization(OpKernel):
    """Per sample and group of channels over (channels of the group, spatial axes); scale and bias
    are per group at opset 18 and per channel from 21. stash_type 1 (the default) computes in float32."""

    def __init__(self, node):
        super().__init__(node)
        self.eps = self.attr_float("epsilon", 1e-5)
        self.groups = self.attr_int("num_groups", lo=1)

    def _run(self, x, scale, bias):
        n, c = x.shape[:2]
        if c % self.groups:
            raise ValueError(f"{c} channels do not split into num_groups={self.groups} groups")
        xf = x.astype(np.float32 if x.dtype.itemsize < 4 else x.dtype, copy=False)
        grouped = xf.reshape(n, self.groups, -1)
        y = _normalize(grouped, (2,), self.eps).reshape(x.shape)
        s, b = scale, bias
        if self.opset < 21:  # one scale and bias per group: repeat them over the group's channels
            s, b = np.repeat(scale, c // self.groups), np.repeat(bias, c // self.groups)
        bshape = (1, -1) + (1,) * (x.ndim - 2)
        return ((y * s.reshape(bshape) + b.reshape(bshape)).astype(x.dtype, copy=False),)
