"""ConvTranspose for any number of spatial axes: one GEMM, then a col2im scatter-add.

Each input pixel times the weights gives a (M/group x kernel) patch: cols = W_g^T @ X_g, one batched
GEMM over (batch, group). The patches are then added into the output, one strided slice per kernel tap
(taps, not pixels, are the Python loop). When the taps of neighbouring pixels do not overlap (stride ==
kernel, no dilation: the usual 2x upsampling) the scatter is a plain transpose instead.

Output geometry as onnxruntime computes it (conv_transpose_attributes.h): the full result has
(in - 1) * stride + (kernel - 1) * dilation + 1 + output_padding cells per axis, cropped by the pads;
auto_pad SAME_* pads to in * stride; an output_shape attribute replaces the pads by the total padding
it implies (never negative: an output_shape up to stride - 1 cells larger extends the result with
zeros, then the bias). SAME_UPPER puts the odd padding cell at the end, every other mode at the start.
As in onnxruntime, an output that the matching Conv would not map back onto the input (output_padding
at or past the stride, an output_shape too large) is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype
from host.cpu_ep.registry import register

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


@dataclass(frozen=True)
class _Geometry:
    """Per spatial axis: the kernel, strides, dilations, the cells cropped at the start, the output size,
    and the uncropped result's size (the scatter buffer: at least pad + out)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    out: tuple[int, ...]
    full: tuple[int, ...]


def _split_padding(total: int, auto_pad: str) -> int:
    """The padding cropped at the start for `total` cells in all."""
    return total // 2 if auto_pad == "SAME_UPPER" else total - total // 2


@register("ConvTranspose")
class ConvTranspose(OpKernel):
    """Y = ConvTranspose(X (N, C, *in), W (C, M/group, *kernel), B (M)); see the module docstring."""

    def __init__(self, node):
        super().__init__(node)
        self.auto_pad = self.attr_str("auto_pad", "NOTSET", choices=_AUTO_PADS)
        self.group = self.attr_int("group", 1, lo=1)
        self.kernel_shape = self.attr_ints("kernel_shape", None, lo=1)
        self.strides = self.attr_ints("strides", None, lo=1)
        self.dilations = self.attr_ints("dilations", None, lo=1)
        self.pads = self.attr_ints("pads", None, lo=0)
        self.output_padding = self.attr_ints("output_padding", None, lo=0)
        self.output_shape = self.attr_ints("output_shape", None, lo=1)
        self._geometries: dict[tuple, _Geometry] = {}

    def _attr_list(self, name: str, value, nd: int, default: int) -> list[int]:
        if value is None:
            return [default] * nd
        if len(value) != nd:
            raise self.bad_attr(name, value, f"a list of {nd} ints ({nd} spatial axes)")
        return value

    def _geometry(self, x_shape, w_shape) -> _Geometry:
        nd = len(x_shape) - 2
        kernel = list(w_shape[2:])
        if self.kernel_shape is not None and self.kernel_shape != kernel:
            raise ValueError(f"kernel_shape {self.kernel_shape} differs from the weight's spatial shape {kernel}")
        strides = self._attr_list("strides", self.strides, nd, 1)
        dilations = self._attr_list("dilations", self.dilations, nd, 1)
        adj = self._attr_list("output_padding", self.output_padding, nd, 0)
        pads = self._attr_list("pads", self.pads, 2 * nd, 0)
        wanted = self.output_shape
        if wanted is not None and len(wanted) != nd:
            raise self.bad_attr("output_shape", wanted, f"a list of {nd} ints (the spatial axes)")
        begin, out, full = [], [], []
        for i in range(nd):
            if adj[i] >= max(strides[i], dilations[i]):
                raise ValueError(f"output_padding[{i}] = {adj[i]} must be less than max(stride, dilation) = "
                                 f"{max(strides[i], dilations[i])}")
            taps = (kernel[i] - 1) * dilations[i] + 1
            span = (x_shape[2 + i] - 1) * strides[i] + taps
            if wanted is not None or self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
                target = wanted[i] if wanted is not None else x_shape[2 + i] * strides[i]
                total = max(0, span + adj[i] - target)
                head = _split_padding(total, self.auto_pad)
                size = wanted[i] if wanted is not None else span + adj[i] - total
            else:
                head, tail = (0, 0) if self.auto_pad == "VALID" else (pads[i], pads[i + nd])
                total, size = head + tail, span + adj[i] - head - tail
            # onnxruntime refuses an output that the matching Conv would not map back onto the input.
            implied = (size + total - taps) // strides[i] + 1
            if size <= 0 or implied != x_shape[2 + i]:
                raise ValueError(f"spatial axis {i}: an output of {size} cells does not fit the input's "
                                 f"{x_shape[2 + i]} (a Conv of it gives {implied}; kernel {kernel[i]}, stride "
                                 f"{strides[i]}, dilation {dilations[i]}, padding {total}, output_padding "
                                 f"{adj[i]}); output_padding must stay below the stride and output_shape "
                                 f"within a stride of the natural size")
            begin.append(head)
            out.append(size)
            full.append(max(span, head + size))
        return _Geometry(tuple(kernel), tuple(strides), tuple(dilations), tuple(begin), tuple(out), tuple(full))

    def _check(self, x, w, b):
        if x.ndim < 3 or w.ndim != x.ndim:
            raise ValueError(f"X {x.shape} and W {w.shape} must have the same rank, at least 3 (N, C, spatial...)")
        c, G = x.shape[1], self.group
        if w.shape[0] != c or c % G:
            raise ValueError(f"W {w.shape} must have X's {c} input channels first, a multiple of group={G}")
        m = w.shape[1] * G
        if b is not None and b.shape != (m,):
            raise ValueError(f"B must have shape ({m},) (the output channels), got {b.shape}")

    def _run(self, x, w, b=None):
        self._check(x, w, b)
        key = (x.shape, w.shape)
        geo = self._geometries.get(key)
        if geo is None:
            geo = self._geometry(x.shape, w.shape)
            if len(self._geometries) < 16:
                self._geometries[key] = geo
        n, c = x.shape[:2]
        G, mg, nd = self.group, w.shape[1], x.ndim - 2
        ct = compute_dtype(x.dtype)
        pixels, taps = math.prod(x.shape[2:]), math.prod(geo.kernel)
        # (G, Mg*taps, Cg) @ (N, G, Cg, pixels) -> (N, G, Mg*taps, pixels): every output patch
        # Contiguous operands: numpy's batched matmul takes a slow non-BLAS loop over a transposed view.
        wt = np.ascontiguousarray(w.astype(ct, copy=False).reshape(G, c // G, mg * taps).transpose(0, 2, 1))
        xg = np.ascontiguousarray(x.astype(ct, copy=False)).reshape(n, G, c // G, pixels)
        cols = np.dot(wt[0], xg[0, 0])[None, None] if n == 1 and G == 1 else np.matmul(wt, xg)
        cols = cols.reshape(n, G * mg, *geo.kernel, *x.shape[2:])
        y = _col2im(cols, geo, nd)
        if b is not None:
            y += b.astype(ct, copy=False).reshape(-1, *([1] * nd))
        return (y.astype(x.dtype, copy=False),)


def _col2im(cols: np.ndarray, geo: _Geometry, nd: int) -> np.ndarray:
    """Adds the patches cols (N, M, *kernel, *in) into the output (N, M, *out), cropped and C-contiguous."""
    n, m = cols.shape[:2]
    size_in = cols.shape[2 + nd:]
    if geo.kernel == geo.strides and all(d == 1 for d in geo.dilations):
        # Non-overlapping taps: (N, M, k1.., i1..) -> (N, M, i1, k1, i2, k2, ..) is the uncropped output.
        perm = (0, 1, *[a for i in range(nd) for a in (2 + nd + i, 2 + i)])
        full = cols.transpose(perm).reshape(n, m, *(i * k for i, k in zip(size_in, geo.kernel)))
        return _crop(full, geo, nd)
    buf = np.zeros((n, m, *geo.full), dtype=cols.dtype)
    for tap in np.ndindex(*geo.kernel):
        where = tuple(slice(k * d, k * d + (i - 1) * s + 1, s)
                      for k, d, i, s in zip(tap, geo.dilations, size_in, geo.strides))
        buf[(slice(None), slice(None), *where)] += cols[(slice(None), slice(None), *tap)]
    return _crop(buf, geo, nd)


def _crop(full: np.ndarray, geo: _Geometry, nd: int) -> np.ndarray:
    """The output window of the uncropped result, as a new C-contiguous array; cells past the uncropped
    result (an output_shape larger than it) are 0."""
    if full.shape[2:] == geo.out and not any(geo.begin):
        return np.ascontiguousarray(full)
    y = np.zeros((*full.shape[:2], *geo.out), dtype=full.dtype)
    src = tuple(slice(b, min(b + o, f)) for b, o, f in zip(geo.begin, geo.out, full.shape[2:]))
    dst = tuple(slice(0, s.stop - s.start) for s in src)
    y[(slice(None), slice(None), *dst)] = full[(slice(None), slice(None), *src)]
    return y
