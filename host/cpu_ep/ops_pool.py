"""Pooling: MaxPool (with indices), AveragePool, GlobalAveragePool, GlobalMaxPool, over the window
views of ops_nn.py."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from host.cpu_ep.base import OpKernel, compute_dtype, constant_column
from host.cpu_ep.ops_nn import _pad_spatial, _Spatial, _taps, _windows
from host.cpu_ep.ops_reduce import trailing_sum
from host.cpu_ep.ops_standardize import _ROW_DTYPES
from host.cpu_ep.registry import register


class _Pool(_Spatial):
    def __init__(self, node):
        super().__init__(node)
        # Pools have no weight to take the kernel shape from: the attribute is required.
        self.kernel_shape = self.attr_ints("kernel_shape", lo=1)
        self._check_lengths(len(self.kernel_shape))


@register("MaxPool")
class MaxPool(_Pool):
    """Indices (second output) are flat indices into x, row-major, or column-major over
    the spatial axes when storage_order=1."""

    def __init__(self, node):
        super().__init__(node)
        self.storage_order = self.attr_int("storage_order", 0, lo=0, hi=1)
        self.want_indices = self.n_outputs > 1 and bool(node.outputs[1])
        self._tiled: dict[tuple, bool] = {}  # input shape -> whether the windows tile it (_tiles)

    def _tiles(self, x) -> bool:
        """Whether the 2-D windows cut x into whole tiles (kernel = strides, no padding or dilation): the
        max is then one np.maximum per extra kernel row and column over strided views, instead of the
        padded window taps (a 2x2 pool of a small 8-bit image: 25 -> 6 us)."""
        if self.want_indices or x.ndim != 4 or x.dtype.kind not in "fiu":
            return False
        g, strides, dilations = self._params(x, self.kernel_shape)
        return (list(strides) == list(self.kernel_shape) and set(dilations) == {1} and not any(g.begin + g.end + g.extra)
                and all(o * k == d for o, k, d in zip(g.out, self.kernel_shape, x.shape[2:])) and 0 not in g.out)

    def _run(self, x):
        tiles = self._tiled.get(x.shape)
        if tiles is None:
            tiles = self._tiles(x)
            if len(self._tiled) < 16:
                self._tiled[x.shape] = tiles
        if tiles:
            return (_tile_max(x, *self.kernel_shape),)
        g, strides, dilations = self._params(x, self.kernel_shape)
        nd = len(self.kernel_shape)
        if x.dtype.kind not in "fiu":
            raise TypeError(f"MaxPool does not support dtype {x.dtype}")
        # Padding must never win the max.
        low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        lead = x.shape[:2] + g.out
        if 0 in g.out or x.size == 0:
            y = np.zeros(lead, dtype=x.dtype)
            return (y, np.zeros(lead, dtype=np.int64)) if self.want_indices else (y,)
        taps = _taps(_windows(_pad_spatial(x, g, low), g, self.kernel_shape, strides, dilations), nd)
        y = next(taps).copy()
        if not self.want_indices:
            for tap in taps:
                np.maximum(y, tap, out=y)
            return (y,)
        index_taps = _taps(_windows(_pad_spatial(self._flat_index(x.shape), g, -1), g,
                                    self.kernel_shape, strides, dilations), nd)
        index = next(index_taps).copy()
        for tap, index_tap in zip(taps, index_taps):
            # Strictly greater: ties keep the first tap, as the reference kernels do.
            better = tap > y
            np.copyto(y, tap, where=better)
            np.copyto(index, index_tap, where=better)
        return (y, index)

    def _flat_index(self, shape) -> np.ndarray:
        spatial = shape[2:]
        size = math.prod(spatial)
        local = np.arange(size, dtype=np.int64).reshape(spatial)
        if self.storage_order == 1:
            local = np.arange(size, dtype=np.int64).reshape(spatial[::-1]).T
        block = np.arange(shape[0] * shape[1], dtype=np.int64).reshape(shape[0], shape[1], *[1] * len(spatial))
        return block * size + local


def _tile_max(x: np.ndarray, kh: int, kw: int) -> np.ndarray:
    """Max over the (kh, kw) tiles of an N-C-H-W tensor that they cut exactly."""
    n, c, h, w = x.shape
    rows = x.reshape(n * c, h // kh, kh, w)
    y = rows[:, :, 0]
    for i in range(1, kh):
        y = np.maximum(y, rows[:, :, i])
    cols = y.reshape(n * c, h // kh, w // kw, kw)
    z = cols[..., 0]
    for j in range(1, kw):
        z = np.maximum(z, cols[..., j])
    return np.ascontiguousarray(z).reshape(n, c, h // kh, w // kw)


@register("AveragePool")
class AveragePool(_Pool):
    """Divides by the window's count of input cells, plus explicit pads when
    count_include_pad; cells added only for ceil_mode never count."""

    def __init__(self, node):
        super().__init__(node)
        self.count_include_pad = self.attr_bool("count_include_pad", 0)

    def _run(self, x):
        g, strides, dilations = self._params(x, self.kernel_shape)
        nd = len(self.kernel_shape)
        dtype = x.dtype
        if 0 in g.out or x.size == 0:
            return (np.zeros(x.shape[:2] + g.out, dtype=dtype),)
        ct = compute_dtype(dtype)
        win = _windows(_pad_spatial(x.astype(ct, copy=False), g, 0), g, self.kernel_shape, strides, dilations)
        taps = _taps(win, nd)
        total = next(taps).copy()
        for tap in taps:
            total += tap
        # The counted-cell mask is a product of 1-D masks, so the divisor is too.
        divisor = np.ones((1, 1), dtype=ct)
        for i in range(nd):
            pad_flag = 1 if self.count_include_pad else 0
            mask = np.concatenate([np.full(g.begin[i], pad_flag), np.ones(x.shape[2 + i]),
                                   np.full(g.end[i], pad_flag), np.zeros(g.extra[i])]).astype(ct)
            counts = sliding_window_view(mask, (self.kernel_shape[i] - 1) * dilations[i] + 1)
            counts = counts[: (g.out[i] - 1) * strides[i] + 1: strides[i], :: dilations[i]].sum(axis=-1)
            divisor = divisor[..., None] * counts
        return ((total / divisor).astype(dtype, copy=False),)


@register("GlobalAveragePool")
class GlobalAveragePool(OpKernel):
    def _run(self, x):
        if x.dtype in _ROW_DTYPES and x.ndim > 2 and x.size and x.flags.c_contiguous:
            # One GEMV against a 1/count column (as ReduceMean over trailing axes).
            count = math.prod(x.shape[2:])
            y = np.dot(x.reshape(-1, count), constant_column(count, 1 / count, x.dtype))
            return (y.reshape(*x.shape[:2], *([1] * (x.ndim - 2))),)
        ct = compute_dtype(x.dtype)
        axes = tuple(range(2, x.ndim))
        y = trailing_sum(x, axes, True, ct)
        y *= ct.type(1 / math.prod(x.shape[2:])) if x.size else ct.type(np.nan)
        return (y.astype(x.dtype, copy=False),)


@register("GlobalMaxPool")
class GlobalMaxPool(OpKernel):
    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)
