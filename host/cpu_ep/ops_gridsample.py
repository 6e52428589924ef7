"""GridSample (opsets 16 and 20): sampling X (N, C, *spatial) at the normalized grid positions
(N, *out, ndim), in nearest / linear / cubic mode, with zeros / border / reflection padding, for 2-D
(opset 16) and any number of spatial dims (opset 20). Vectorized over every output point: one gather
per interpolation tap (2**ndim linear, 4**ndim cubic)."""

from __future__ import annotations

import itertools

import numpy as np

from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register
from host.errors import InvalidArgument

# Opset 16 names the modes bilinear and bicubic; opset 20 calls them linear and cubic.
_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}
_CUBIC_A = -0.75  # Keys' cubic convolution coefficient, as onnx and onnxruntime use


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Reflects x at the bounds lo and hi until it lies inside them (onnx's _gs_reflect, vectorized)."""
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = x < lo, x > hi
    dx = np.where(below, lo - x, x - hi)
    n = np.floor(dx / span)
    r = dx - n * span
    even = n % 2 == 0
    inside_below = np.where(even, lo + r, hi - r)
    inside_above = np.where(even, hi - r, lo + r)
    return np.where(below, inside_below, np.where(above, inside_above, x))


def _cubic_weights(t: np.ndarray) -> list[np.ndarray]:
    """The four Keys weights of the taps at floor-1 .. floor+2 for fractional offsets t in [0, 1)."""
    a = _CUBIC_A

    def far(d):  # 1 <= |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    def near(d):  # |d| < 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


@register("GridSample", since=16)
class GridSample(OpKernel):
    """Samples X at grid positions; the grid's last axis holds (x, y[, z]), x indexing the last spatial axis."""

    def __init__(self, node):
        super().__init__(node)
        names = ("bilinear", "nearest", "bicubic") if self.opset < 20 else ("linear", "nearest", "cubic")
        self.mode = _MODES[self.attr_str("mode", names[0], names)]
        self.padding = self.attr_str("padding_mode", "zeros", ("zeros", "border", "reflection"))
        self.align_corners = self.attr_bool("align_corners", 0)

    def _check(self, x: np.ndarray, grid: np.ndarray) -> None:
        nd = x.ndim - 2
        if nd < 1 or (self.opset < 20 and nd != 2):
            allowed = "4-D (N, C, H, W)" if self.opset < 20 else "at least 3-D (N, C, spatial...)"
            raise InvalidArgument(f"GridSample's X must be {allowed}; got shape {list(x.shape)}")
        if grid.ndim != x.ndim or grid.shape[0] != x.shape[0] or grid.shape[-1] != nd:
            raise InvalidArgument(f"GridSample's grid must have shape (N={x.shape[0]}, *out ({nd} dims), {nd}) "
                                  f"for X of shape {list(x.shape)}; got {list(grid.shape)}")

    def _run(self, x, grid):
        self._check(x, grid)
        spatial = x.shape[2:]
        out_shape = (x.shape[0], x.shape[1], *grid.shape[1:-1])
        if 0 in out_shape:
            return (np.zeros(out_shape, x.dtype),)
        ct = np.float64 if grid.dtype == np.float64 or x.dtype == np.float64 else np.float32
        coords = [self._coordinate(grid[..., len(spatial) - 1 - i].astype(ct), d) for i, d in enumerate(spatial)]
        xt = np.moveaxis(x, 1, -1).astype(ct, copy=False)  # (N, *spatial, C): a gather yields (N, *out, C)
        batch = np.arange(x.shape[0]).reshape((-1,) + (1,) * (grid.ndim - 2))
        if self.mode == "nearest":
            y = self._fetch(xt, batch, coords)  # already rounded; truncated as onnx does
        else:
            y = self._interpolate(xt, batch, coords)
        return (np.moveaxis(y, -1, 1).astype(x.dtype, copy=False),)

    def _bounds(self, size: int) -> tuple[float, float]:
        return (0.0, size - 1.0) if self.align_corners else (-0.5, size - 0.5)

    def _coordinate(self, g: np.ndarray, size: int) -> np.ndarray:
        """Normalized [-1, 1] positions to pixel coordinates, border and reflection padding applied."""
        c = (g + 1) / 2 * (size - 1) if self.align_corners else ((g + 1) * size - 1) / 2
        if self.mode == "nearest":
            c = np.rint(c)
        lo, hi = self._bounds(size)
        # Cubic with border padding clamps each tap, not the coordinate (onnxruntime and PyTorch; onnx's
        # reference clamps the coordinate, which no backend test tells apart).
        if self.padding == "border" and self.mode != "cubic":
            c = np.where((c < lo) | (c > hi), np.clip(c, 0, size - 1), c)
        elif self.padding == "reflection":
            c = _reflect(c, lo, hi)
        return c

    def _fetch(self, xt: np.ndarray, batch: np.ndarray, index: list[np.ndarray]) -> np.ndarray:
        """xt at integer positions `index` (one array per spatial axis), padding rules for outside ones."""
        spatial = xt.shape[1:-1]
        valid = None
        idx = []
        for i, size in zip(index, spatial):
            if self.padding == "reflection":
                lo, hi = self._bounds(size)
                i = _reflect(i, lo, hi)
            i = i.astype(np.int64)
            if self.padding == "zeros":
                ok = (i >= 0) & (i < size)
                valid = ok if valid is None else valid & ok
            idx.append(np.clip(i, 0, size - 1))
        values = xt[(batch, *idx)]
        if valid is not None:
            values = np.where(valid[..., None], values, 0)
        return values

    def _interpolate(self, xt: np.ndarray, batch: np.ndarray, coords: list[np.ndarray]) -> np.ndarray:
        """Sum over the taps of each axis (2 linear, 4 cubic) of the product of the per-axis weights."""
        taps = []
        for c in coords:
            base = np.floor(c)
            t = c - base
            if self.mode == "linear":
                taps.append([(base, 1 - t), (base + 1, t)])
            else:
                taps.append([(base + k - 1, w) for k, w in enumerate(_cubic_weights(t))])
        y = None
        for combo in itertools.product(*taps):
            weight = combo[0][1]
            for _, w in combo[1:]:
                weight = weight * w
            term = self._fetch(xt, batch, [p for p, _ in combo]) * weight[..., None]
            y = term if y is None else y + term
        return y
