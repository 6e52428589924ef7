"""Data movement without arithmetic: SpaceToDepth, DepthToSpace, Compress, EyeLike, ReverseSequence,
CenterCropPad."""

from __future__ import annotations

import numpy as np
import onnx

from host.cpu_ep.base import OpKernel, int_list, normalize_axes, normalize_axis
from host.cpu_ep.registry import register


@register("SpaceToDepth", since=1)
class SpaceToDepth(OpKernel):
    """(N, C, H, W) -> (N, C*b*b, H/b, W/b): each b x b block becomes channels; mode (opset 28) DCR
    (block row, block column, then channel; the default) or CRD (channel first), DepthToSpace's inverse."""

    def __init__(self, node):
        super().__init__(node)
        self.b = self.attr_int("blocksize", lo=1)
        self.mode = self.attr_str("mode", "DCR", ("DCR", "CRD"))

    def _run(self, x):
        n, c, h, w = x.shape
        b = self.b
        if h % b or w % b:
            raise ValueError(f"input height and width ({h}, {w}) must be multiples of blocksize {b}")
        order = (0, 3, 5, 1, 2, 4) if self.mode == "DCR" else (0, 1, 3, 5, 2, 4)
        y = x.reshape(n, c, h // b, b, w // b, b).transpose(order)
        return (y.reshape(n, c * b * b, h // b, w // b),)


@register("DepthToSpace", since=1)
class DepthToSpace(OpKernel):
    """(N, C, H, W) -> (N, C/(b*b), H*b, W*b); mode DCR (depth, column, row; the default) or CRD."""

    def __init__(self, node):
        super().__init__(node)
        self.b = self.attr_int("blocksize", lo=1)
        self.mode = self.attr_str("mode", "DCR", ("DCR", "CRD"))

    def _run(self, x):
        n, c, h, w = x.shape
        b = self.b
        if c % (b * b):
            raise ValueError(f"input channels {c} must be a multiple of blocksize^2 = {b * b}")
        if self.mode == "DCR":
            y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
        return (y.reshape(n, c // (b * b), h * b, w * b),)


@register("Compress", since=9)
class Compress(OpKernel):
    """The slices along `axis` (the flattened input without it) where condition is true; a condition
    shorter than the axis selects nothing past its end."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr("axis", None)
        if self.axis is not None:
            self.axis = self.attr_int("axis")

    def _run(self, x, condition):
        cond = np.asarray(condition, dtype=bool).reshape(-1)
        if self.axis is None:
            flat = x.reshape(-1)
            return (flat[: cond.size][cond[: flat.size]],)
        ax = normalize_axis(self.axis, x.ndim)
        if cond.size > x.shape[ax]:
            raise ValueError(f"condition has {cond.size} elements; axis {self.axis} has only {x.shape[ax]}")
        return (np.compress(cond, x, axis=ax),)


@register("EyeLike", since=9)
class EyeLike(OpKernel):
    """A 2-D tensor of the input's shape with ones on diagonal k, of `dtype` (default: the input's)."""

    def __init__(self, node):
        super().__init__(node)
        self.k = self.attr_int("k", 0)
        dtype = self.attr("dtype", None)
        self.dtype = None
        if dtype is not None:
            try:
                self.dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.attr_int("dtype")))
            except (KeyError, ValueError, TypeError) as exc:
                raise self.bad_attr("dtype", dtype, "an onnx.TensorProto data type") from exc

    def _run(self, x):
        if x.ndim != 2:
            raise ValueError(f"EyeLike takes a 2-D input, got shape {x.shape}")
        return (np.eye(x.shape[0], x.shape[1], k=self.k, dtype=self.dtype or x.dtype),)


@register("ReverseSequence", since=10)
class ReverseSequence(OpKernel):
    """Reverses the first sequence_lens[i] elements along time_axis of batch entry i."""

    def __init__(self, node):
        super().__init__(node)
        self.time_axis = self.attr_int("time_axis", 0, lo=0, hi=1)
        self.batch_axis = self.attr_int("batch_axis", 1, lo=0, hi=1)
        if self.time_axis == self.batch_axis:
            raise self.bad_attr("batch_axis", self.batch_axis, f"0 or 1, not time_axis ({self.time_axis})")

    def _run(self, x, sequence_lens):
        y = x.copy()
        lens = int_list(sequence_lens)
        if len(lens) != x.shape[self.batch_axis]:
            raise ValueError(f"sequence_lens has {len(lens)} entries; the batch axis has {x.shape[self.batch_axis]}")
        for i, n in enumerate(lens):
            if not 0 <= n <= x.shape[self.time_axis]:
                raise ValueError(f"sequence_lens[{i}] = {n} is outside [0, {x.shape[self.time_axis]}]")
            index = [slice(None)] * x.ndim
            index[self.batch_axis] = i
            index[self.time_axis] = slice(0, n)
            y[tuple(index)] = np.flip(x[tuple(index)], axis=0)
        return (y,)


@register("CenterCropPad", since=18)
class CenterCropPad(OpKernel):
    """Crops (centered) or pads with zeros (centered) each of `axes` to shape[i]; an odd difference
    puts the extra element at the end (crop: start offset floor(diff/2); pad: before floor(diff/2))."""

    def __init__(self, node):
        super().__init__(node)
        self.axes = self.attr_ints("axes", None)

    def _run(self, x, shape):
        target = int_list(shape)
        axes = normalize_axes(self.axes if self.axes is not None else range(x.ndim), x.ndim)
        if len(target) != len(axes):
            raise ValueError(f"shape has {len(target)} entries for {len(axes)} axes")
        out_shape = list(x.shape)
        src, dst = [slice(None)] * x.ndim, [slice(None)] * x.ndim
        for ax, size in zip(axes, target):
            dim = x.shape[ax]
            out_shape[ax] = size
            if size <= dim:
                start = (dim - size) // 2
                src[ax] = slice(start, start + size)
            else:
                start = (size - dim) // 2
                dst[ax] = slice(start, start + dim)
        y = np.zeros(out_shape, dtype=x.dtype)
        y[tuple(dst)] = x[tuple(src)]
        return (y,)


@register("Upsample", since=7, until=9)
class Upsample(OpKernel):
    """Deprecated (opset 10 made it Resize): scales per axis, an attribute at 7-8 and an input at 9;
    mode 'nearest' (out[i] = x[floor(i / scale)]) only."""

    def __init__(self, node):
        super().__init__(node)
        if self.attr_str("mode", "nearest", ("nearest", "linear")) != "nearest":
            raise self.bad_attr("mode", "linear", "'nearest' (the CPU EP's Upsample; Resize does linear)")
        scales = self.attr("scales", None)
        self.scales = None if scales is None else [float(s) for s in scales]

    def _run(self, x, scales=None):
        factors = self.scales if scales is None else [float(s) for s in np.asarray(scales).reshape(-1)]
        if factors is None or len(factors) != x.ndim:
            raise ValueError(f"scales must give one factor per axis of the rank-{x.ndim} input, got {factors}")
        index = tuple(np.minimum((np.arange(int(d * s)) / s).astype(np.int64), d - 1).reshape(
            [-1 if a == i else 1 for a in range(x.ndim)]) for i, (d, s) in enumerate(zip(x.shape, factors)))
        return (x[index],)


@register("MaxUnpool", since=9)
class MaxUnpool(OpKernel):
    """Scatters X into zeros at the flat indices I (MaxPool's second output); the output shape is
    output_shape when given, else (in - 1) * stride + kernel - pads per spatial axis."""

    def __init__(self, node):
        super().__init__(node)
        self.kernel = self.attr_ints("kernel_shape", lo=1)
        nd = len(self.kernel)
        self.strides = self.attr_ints("strides", [1] * nd, length=nd, lo=1)
        self.pads = self.attr_ints("pads", [0] * 2 * nd, length=2 * nd, lo=0)

    def _run(self, x, indices, output_shape=None):
        nd = len(self.kernel)
        if output_shape is not None:
            shape = tuple(int_list(output_shape))
        else:
            shape = x.shape[:2] + tuple((x.shape[2 + i] - 1) * self.strides[i] + self.kernel[i] - self.pads[i]
                                        - self.pads[i + nd] for i in range(nd))
        y = np.zeros(int(np.prod(shape)), dtype=x.dtype)
        flat = indices.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= y.size):
            raise ValueError(f"indices must lie in [0, {y.size}) for output shape {shape}")
        y[flat] = x.reshape(-1)
        return (y.reshape(shape),)
