"""Image geometry: Col2Im (opset 18), the inverse of im2col, and AffineGrid (opset 20), the sampling
grid of an affine transform that GridSample consumes.

Col2Im adds each kernel tap's column block into a strided slice of the padded image: one whole-array
add per tap (prod(block_shape) of them), never a loop over pixels.
"""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype, int_list
from host.cpu_ep.registry import register
from host.errors import InvalidArgument


@register("Col2Im", since=18)
class Col2Im(OpKernel):
    """(N, C * prod(block), L) columns -> (N, C, *image_shape), overlapping taps summed."""

    def __init__(self, node):
        super().__init__(node)
        self.strides = self.attr_ints("strides", None, lo=1)
        self.dilations = self.attr_ints("dilations", None, lo=1)
        self.pads = self.attr_ints("pads", None, lo=0)

    def _attrs(self, nd: int) -> tuple[list[int], list[int], list[int]]:
        for name, want in (("strides", nd), ("dilations", nd), ("pads", 2 * nd)):
            value = getattr(self, name)
            if value is not None and len(value) != want:
                raise self.bad_attr(name, value, f"a list of {want} ints ({nd} image axes)")
        return self.strides or [1] * nd, self.dilations or [1] * nd, self.pads or [0] * (2 * nd)

    def _blocks(self, image, block, strides, dilations, pads) -> list[int]:
        """The number of block positions along each image axis."""
        nd = len(image)
        blocks = [(image[i] + pads[i] + pads[i + nd] - (dilations[i] * (block[i] - 1) + 1)) // strides[i] + 1
                  for i in range(nd)]
        if min(blocks) < 1:
            raise InvalidArgument(f"Col2Im: block_shape {block} (dilations {dilations}) does not fit image_shape "
                                  f"{image} with pads {pads}; each block must fit inside the padded image")
        return blocks

    def _run(self, data, image_shape, block_shape):
        image, block = int_list(image_shape), int_list(block_shape)
        nd = len(image)
        if len(block) != nd or nd < 1 or min(block) < 1 or min(image) < 1:
            raise InvalidArgument(f"Col2Im: image_shape and block_shape must hold the same number (>= 1) of positive "
                                  f"sizes; got image_shape {image}, block_shape {block}")
        strides, dilations, pads = self._attrs(nd)
        blocks = self._blocks(image, block, strides, dilations, pads)
        taps = int(np.prod(block))
        if data.ndim != 3 or data.shape[1] % taps or data.shape[2] != int(np.prod(blocks)):
            raise InvalidArgument(f"Col2Im: input must have shape (N, C * {taps} (the block size), {int(np.prod(blocks))} "
                                  f"(the block positions {blocks})); got {list(data.shape)}")
        n, c = data.shape[0], data.shape[1] // taps
        ct = compute_dtype(data.dtype)
        cols = data.astype(ct, copy=False).reshape(n, c, taps, *blocks)
        padded = np.zeros((n, c, *(image[i] + pads[i] + pads[i + nd] for i in range(nd))), dtype=ct)
        for t, offset in enumerate(np.ndindex(*block)):
            # Within one tap, block positions land on distinct pixels: a strided in-place add is exact.
            region = tuple(slice(o * d, o * d + s * (b - 1) + 1, s)
                           for o, d, s, b in zip(offset, dilations, strides, blocks))
            padded[(slice(None), slice(None), *region)] += cols[:, :, t]
        crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(nd))
        return (padded[(slice(None), slice(None), *crop)].astype(data.dtype, copy=False),)


def _axis_positions(size: int, align_corners: bool) -> np.ndarray:
    """Normalized [-1, 1] positions of `size` pixels: their centers, or with align_corners their corners
    (the spec leaves a single pixel's position open there: it sits at 1 as in onnxruntime, whose Eigen
    LinSpaced returns the upper end for one point; PyTorch says 0, onnx's reference -1)."""
    if align_corners:
        return np.linspace(-1.0, 1.0, size) if size > 1 else np.ones(size)
    return (2.0 * np.arange(size) + 1.0) / size - 1.0


@register("AffineGrid", since=20)
class AffineGrid(OpKernel):
    """theta (N, 2, 3) and size (N, C, H, W) -> grid (N, H, W, 2); theta (N, 3, 4) and size (N, C, D, H, W) ->
    grid (N, D, H, W, 3). The grid's last axis holds (x, y[, z]): x runs along the last (width) axis."""

    def __init__(self, node):
        super().__init__(node)
        self.align_corners = self.attr_bool("align_corners", 0)

    def _run(self, theta, size):
        dims = int_list(size)
        if theta.ndim != 3 or theta.shape[1:] not in ((2, 3), (3, 4)):
            raise InvalidArgument(f"AffineGrid: theta must have shape (N, 2, 3) (2-D) or (N, 3, 4) (3-D); "
                                  f"got {list(theta.shape)}")
        nd = theta.shape[1]
        if len(dims) != nd + 2 or dims[0] != theta.shape[0] or min(dims[2:]) < 0:
            layout = "(N, C, H, W)" if nd == 2 else "(N, C, D, H, W)"
            raise InvalidArgument(f"AffineGrid: size must be {layout} with N = {theta.shape[0]} (theta's batch) and "
                                  f"sizes >= 0 for theta of shape {list(theta.shape)}; got {dims}")
        spatial = dims[2:]
        ct = compute_dtype(theta.dtype)
        # Homogeneous base coordinates (x, y[, z], 1) of every output pixel, x along the last axis.
        axes = np.meshgrid(*(_axis_positions(s, self.align_corners) for s in spatial), indexing="ij")
        base = np.stack([*reversed(axes), np.ones(spatial)], axis=-1).reshape(-1, nd + 1).astype(ct)
        grid = np.matmul(base, np.swapaxes(theta.astype(ct, copy=False), 1, 2))  # (N, pixels, nd)
        return (grid.reshape(theta.shape[0], *spatial, nd).astype(theta.dtype, copy=False),)
