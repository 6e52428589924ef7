"""Resize (and Upsample's successor semantics): nearest, linear and cubic, any number of axes.

The interpolation is separable, so it runs one axis at a time: for each resized axis the output
coordinates are mapped back to input coordinates (coordinate_transformation_mode), then gathered
(nearest) or blended from 2 (linear) or 4 (cubic) neighbours with per-coordinate weights (more with
antialias when downscaling: the kernel is stretched by 1/scale). Neighbours
outside the input repeat the edge, except with exclude_outside (cubic) which drops their weight,
and tf_crop_and_resize, which puts extrapolation_value where the source coordinate leaves the input.
"""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep.base import OpKernel, int_list, normalize_axes
from host.cpu_ep.registry import register

_COORD_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                "tf_crop_and_resize", "tf_half_pixel_for_nn")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_POLICIES = ("stretch", "not_larger", "not_smaller")


def source_coords(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """Input-space coordinate of every output index along one axis."""
    x = np.arange(out_len, dtype=np.float64)
    if mode in ("half_pixel", "tf_half_pixel_for_nn"):
        return (x + 0.5) / scale - 0.5 if mode == "half_pixel" else (x + 0.5) / scale
    if mode == "half_pixel_symmetric":
        adjustment = out_len / (scale * in_len)
        offset = in_len / 2 * (1 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros(out_len)
    if mode == "align_corners":
        # The reference divides by the unrounded output length (scale * in_len), not by out_len.
        width = scale * in_len
        return x * (in_len - 1) / (width - 1) if width != 1 else np.zeros(out_len)
    if mode == "asymmetric":
        return x / scale
    start, end = roi  # tf_crop_and_resize, over the unrounded output length like align_corners
    width = scale * in_len
    if width != 1:
        return start * (in_len - 1) + x * (end - start) * (in_len - 1) / (width - 1)
    return np.full(out_len, 0.5 * (start + end) * (in_len - 1))


def _nearest_index(coords: np.ndarray, mode: str, in_len: int) -> np.ndarray:
    if mode == "round_prefer_floor":
        idx = np.ceil(coords - 0.5)
    elif mode == "round_prefer_ceil":
        idx = np.floor(coords + 0.5)
    elif mode == "floor":
        idx = np.floor(coords)
    else:
        idx = np.ceil(coords)
    return np.clip(idx, 0, in_len - 1).astype(np.int64)


def _keys(d: np.ndarray, a: float) -> np.ndarray:
    """The Keys cubic kernel at distances |d| (0 from 2 on)."""
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _antialias_taps(frac: np.ndarray, scale: float, cubic: bool, a: float):
    """Downscaling with antialias: the linear (triangle) or cubic kernel stretched by 1/scale, so each
    output averages every input it covers; neighbours floor+start .. floor+1-start, weights normalized."""
    start = math.floor(-(2 if cubic else 1) / scale) + 1
    offsets = np.arange(start, 2 - start)
    args = (offsets[None, :] - frac[:, None]) * scale
    weights = _keys(args, a) if cubic else np.clip(1 - np.abs(args), 0, 1)
    return offsets, weights / weights.sum(axis=1, keepdims=True)


def _cubic_weights(frac: np.ndarray, a: float) -> np.ndarray:
    """(n, 4) Keys cubic weights for neighbours floor-1 .. floor+2 at fractional offset frac."""
    def far(d):  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    def near(d):  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1
    return np.stack([far(frac + 1), near(frac), near(1 - frac), far(2 - frac)], axis=1)


@register("Resize", since=10)
class Resize(OpKernel):
    """Opset 10: (X, scales); since 11: (X, roi, scales, sizes); axes and keep_aspect_ratio_policy since 18."""

    def __init__(self, node):
        super().__init__(node)
        self.mode = self.attr_str("mode", "nearest", choices=("nearest", "linear", "cubic"))
        default_coord = "asymmetric" if self.opset < 11 else "half_pixel"
        self.coord_mode = self.attr_str("coordinate_transformation_mode", default_coord, choices=_COORD_MODES)
        self.nearest_mode = self.attr_str("nearest_mode", "round_prefer_floor" if self.opset >= 11 else "floor",
                                          choices=_NEAREST_MODES)
        if self.opset < 11:
            self.nearest_mode = "floor"  # Resize-10 truncates, as Upsample did
        self.cubic_a = self.attr_float("cubic_coeff_a", -0.75)
        self.exclude_outside = self.attr_bool("exclude_outside", 0)
        self.extrapolation = self.attr_float("extrapolation_value", 0.0)
        self.axes_attr = self.attr_ints("axes", None)
        self.policy = self.attr_str("keep_aspect_ratio_policy", "stretch", choices=_POLICIES)
        self.antialias = self.attr_bool("antialias", 0)

    def _run(self, x, *rest):
        roi, scales, sizes = (None, rest[0] if rest else None, None) if self.opset < 11 else \
            (tuple(rest) + (None, None, None))[:3]
        axes = list(range(x.ndim)) if self.axes_attr is None else list(normalize_axes(self.axes_attr, x.ndim))
        scale_list, out_shape = self._targets(x.shape, axes, scales, sizes)
        roi_list = self._roi(roi, x.ndim, axes)
        y = x
        ct = np.float64 if x.dtype == np.float64 else np.float32
        for axis in range(x.ndim):
            if out_shape[axis] == x.shape[axis] and scale_list[axis] == 1.0 and self.coord_mode != "tf_crop_and_resize":
                continue
            y = self._axis(y, axis, out_shape[axis], scale_list[axis], roi_list[axis], ct)
        if y.dtype != x.dtype:
            y = np.rint(y) if x.dtype.kind in "iu" else y
            y = y.astype(x.dtype)
        return (y,)

    def _targets(self, shape, axes, scales, sizes):
        """Per-axis scale and output length, from either scales or sizes (exactly one is given)."""
        has_scales = scales is not None and scales.size > 0
        has_sizes = sizes is not None and sizes.size > 0
        if has_scales == has_sizes:
            raise ValueError("exactly one of scales and sizes must be given (non-empty)")
        scale_list = [1.0] * len(shape)
        out = list(shape)
        if has_scales:
            values = [float(v) for v in scales.reshape(-1)]
            if len(values) != len(axes):
                raise ValueError(f"scales {values} must hold one value per resized axis ({len(axes)})")
            for axis, s in zip(axes, values):
                if s <= 0:
                    raise ValueError(f"scale {s} must be > 0")
                scale_list[axis] = s
                # floor(in * scale), the roi left out, as the reference and onnxruntime compute it.
                out[axis] = int(math.floor(shape[axis] * s))
            return scale_list, out
        values = int_list(sizes)
        if len(values) != len(axes):
            raise ValueError(f"sizes {values} must hold one value per resized axis ({len(axes)})")
        ratios = [v / shape[a] for a, v in zip(axes, values)]
        if self.policy != "stretch":
            r = min(ratios) if self.policy == "not_larger" else max(ratios)
            ratios = [r] * len(axes)
            values = [int(math.floor(r * shape[a] + 0.5)) for a in axes]
        for axis, v, r in zip(axes, values, ratios):
            out[axis], scale_list[axis] = v, r
        return scale_list, out

    def _roi(self, roi, rank: int, axes) -> list[tuple[float, float]]:
        spans = [(0.0, 1.0)] * rank
        if roi is None or roi.size == 0 or self.coord_mode != "tf_crop_and_resize":
            return spans
        values = [float(v) for v in roi.reshape(-1)]
        n = len(axes)
        if len(values) != 2 * n:
            raise ValueError(f"roi {values} must hold starts and ends for the {n} resized axes")
        for i, axis in enumerate(axes):
            spans[axis] = (values[i], values[i + n])
        return spans

    def _axis(self, x: np.ndarray, axis: int, out_len: int, scale: float, roi, ct) -> np.ndarray:
        in_len = x.shape[axis]
        coords = source_coords(self.coord_mode, out_len, in_len, scale, roi)
        if self.mode == "nearest":
            y = np.take(x, _nearest_index(coords, self.nearest_mode, in_len), axis=axis)
        else:
            base = np.floor(coords)
            frac = coords - base
            if self.antialias and scale < 1:
                offsets, weights = _antialias_taps(frac, scale, self.mode == "cubic", self.cubic_a)
            elif self.mode == "linear":
                offsets = np.array([0, 1])
                weights = np.stack([1 - frac, frac], axis=1)
            else:
                offsets = np.array([-1, 0, 1, 2])
                weights = _cubic_weights(frac, self.cubic_a)
            idx = base.astype(np.int64)[:, None] + offsets[None, :]
            if self.exclude_outside:
                weights = np.where((idx < 0) | (idx >= in_len), 0.0, weights)
                total = weights.sum(axis=1, keepdims=True)
                weights = weights / np.where(total == 0, 1.0, total)
            idx = np.clip(idx, 0, in_len - 1)
            xc = x.astype(ct, copy=False)
            shape = [1] * x.ndim
            shape[axis] = out_len
            y = None
            for j in range(idx.shape[1]):
                term = np.take(xc, idx[:, j], axis=axis) * weights[:, j].astype(ct).reshape(shape)
                y = term if y is None else y + term
        if self.coord_mode == "tf_crop_and_resize":
            outside = (coords < 0) | (coords > in_len - 1)
            if outside.any():
                shape = [1] * x.ndim
                shape[axis] = out_len
                y = np.where(outside.reshape(shape), np.asarray(self.extrapolation, dtype=y.dtype), y)
        return y
