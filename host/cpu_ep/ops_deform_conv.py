"""DeformConv (opsets 19 and 22): a convolution whose kernel taps sample X at learned fractional offsets.

Each tap of each output position reads X at (its regular position + offset), by linear interpolation
between the 2**nd surrounding pixels (zero outside X), optionally scaled by a mask; the sampled
columns then go through one grouped matrix product with W, as an im2col convolution. The sampling is
vectorized over every tap, output position and channel: one gather per interpolation corner.
"""

from __future__ import annotations

import itertools

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype
from host.cpu_ep.registry import register
from host.errors import InvalidArgument


def _corners(pos: np.ndarray, size: int):
    """The two interpolation taps along one axis: (index, weight, inside X) for floor and floor + 1."""
    lo = np.floor(pos)
    t = pos - lo
    lo = lo.astype(np.int64)
    return [(i, w, (i >= 0) & (i < size)) for i, w in ((lo, 1 - t), (lo + 1, t))]


def _sample(x: np.ndarray, positions: list[np.ndarray]) -> np.ndarray:
    """x (N, G, Cg, *spatial) read at `positions` (one (N, G, P) array per spatial axis) by linear
    interpolation, zero outside: (N, G, Cg, P)."""
    n, g, cg = x.shape[:3]
    spatial = x.shape[3:]
    flat = x.reshape(n, g, cg, -1)
    out = np.zeros((n, g, cg, positions[0].shape[-1]), dtype=x.dtype)
    per_axis = [_corners(p, s) for p, s in zip(positions, spatial)]
    for combo in itertools.product(*per_axis):
        index, weight, inside = 0, 1.0, True
        for (i, w, ok), size in zip(combo, spatial):
            index = index * size + np.clip(i, 0, size - 1)
            weight = weight * w
            inside = inside & ok
        gathered = np.take_along_axis(flat, index[:, :, None, :], axis=-1)
        out += gathered * np.where(inside, weight, 0).astype(x.dtype)[:, :, None, :]
    return out


@register("DeformConv", since=19)
class DeformConv(OpKernel):
    """X (N, C, *spatial), W (M, C / group, *kernel), offset (N, offset_group * prod(kernel) * nd, *out),
    optional B (M) and mask (N, offset_group * prod(kernel), *out) -> Y (N, M, *out)."""

    def __init__(self, node):
        super().__init__(node)
        self.kernel_shape = self.attr_ints("kernel_shape", None, lo=1)
        self.strides = self.attr_ints("strides", None, lo=1)
        self.dilations = self.attr_ints("dilations", None, lo=1)
        self.pads = self.attr_ints("pads", None, lo=0)
        self.group = self.attr_int("group", 1, lo=1)
        self.offset_group = self.attr_int("offset_group", 1, lo=1)

    def _attrs(self, nd: int):
        for name, want in (("kernel_shape", nd), ("strides", nd), ("dilations", nd), ("pads", 2 * nd)):
            value = getattr(self, name)
            if value is not None and len(value) != want:
                raise self.bad_attr(name, value, f"a list of {want} ints ({nd} spatial axes)")
        return self.strides or [1] * nd, self.dilations or [1] * nd, self.pads or [0] * (2 * nd)

    def _check(self, x, w, offset, mask, kernel, strides, dilations, pads) -> tuple[int, ...]:
        """The output's spatial shape; InvalidArgument when the inputs do not fit together."""
        nd, c, m = x.ndim - 2, x.shape[1], w.shape[0]
        if c != w.shape[1] * self.group or m % self.group or c % self.offset_group:
            raise InvalidArgument(f"DeformConv: X has {c} channels and W shape {list(w.shape)}; C must equal "
                                  f"W's dim 1 times group ({self.group}), M (W's dim 0) must be a multiple of group, "
                                  f"and C a multiple of offset_group ({self.offset_group})")
        out = tuple((x.shape[2 + i] + pads[i] + pads[i + nd] - (dilations[i] * (kernel[i] - 1) + 1)) // strides[i] + 1
                    for i in range(nd))
        taps = self.offset_group * int(np.prod(kernel))
        want = (x.shape[0], taps * nd, *out)
        if offset.shape != want:
            raise InvalidArgument(f"DeformConv: offset must have shape {list(want)} (N, offset_group * "
                                  f"prod(kernel) * {nd}, *output) for X {list(x.shape)} and kernel {list(kernel)}; "
                                  f"got {list(offset.shape)}")
        if mask is not None and mask.shape != (x.shape[0], taps, *out):
            raise InvalidArgument(f"DeformConv: mask must have shape {[x.shape[0], taps, *out]}; "
                                  f"got {list(mask.shape)}")
        return out

    def _positions(self, offset, kernel, out, strides, dilations, pads, ct) -> list[np.ndarray]:
        """Per spatial axis, where every (image, offset group, tap, output position) samples X: (N, G, K * P)."""
        nd, n = len(kernel), offset.shape[0]
        k, p = int(np.prod(kernel)), int(np.prod(out))
        shifts = offset.astype(ct, copy=False).reshape(n, self.offset_group, k, nd, p)
        taps = np.indices(kernel).reshape(nd, k)
        grid = np.indices(out).reshape(nd, p)
        positions = []
        for a in range(nd):
            regular = grid[a][None, :] * strides[a] - pads[a] + taps[a][:, None] * dilations[a]  # (K, P)
            positions.append((regular + shifts[:, :, :, a]).reshape(n, self.offset_group, k * p))
        return positions

    def _run(self, x, w, offset, b=None, mask=None):
        nd = x.ndim - 2
        if nd < 1 or w.ndim != x.ndim:
            raise InvalidArgument(f"DeformConv: X must be (N, C, *spatial) with at least one spatial axis and W of "
                                  f"the same rank; got X {list(x.shape)}, W {list(w.shape)}")
        strides, dilations, pads = self._attrs(nd)
        kernel = self.kernel_shape or list(w.shape[2:])
        if list(kernel) != list(w.shape[2:]):
            raise InvalidArgument(f"DeformConv: kernel_shape {kernel} must match W's spatial shape {list(w.shape[2:])}")
        out = self._check(x, w, offset, mask, kernel, strides, dilations, pads)
        n, c, m = x.shape[0], x.shape[1], w.shape[0]
        k, p = int(np.prod(kernel)), int(np.prod(out))
        ct = compute_dtype(x.dtype)
        xg = x.astype(ct, copy=False).reshape(n, self.offset_group, c // self.offset_group, *x.shape[2:])
        cols = _sample(xg, self._positions(offset, kernel, out, strides, dilations, pads, ct))
        if mask is not None:
            cols = cols * mask.astype(ct, copy=False).reshape(n, self.offset_group, 1, k * p)
        cols = cols.reshape(n, self.group, (c // self.group) * k, p)
        weights = w.astype(ct, copy=False).reshape(self.group, m // self.group, -1)
        y = np.matmul(weights[None], cols).reshape(n, m, *out)  # (N, group, M / group, P)
        if b is not None:
            y = y + b.astype(ct, copy=False).reshape(m, *([1] * nd))
        return (y.astype(x.dtype, copy=False),)
