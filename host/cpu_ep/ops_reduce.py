"""Reductions and ArgMax/ArgMin.

`axes` is an attribute up to opset 12 (ReduceSum) / 17 (the others) and an optional input
since; both forms are accepted. Empty axes reduce everything unless
`noop_with_empty_axes`, in which case nothing is reduced (axis=() in numpy terms, so
ReduceSumSquare still squares, as a reduction over no axes would).
"""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype, constant_column, int_list, normalize_axes, normalize_axis
from host.cpu_ep.registry import register


def trailing_sum(x: np.ndarray, axis, keepdims: bool, dtype) -> np.ndarray:
    """np.add.reduce over `axis`; trailing axes of a contiguous tensor (global pooling, the SE blocks of
    vision models) are summed as one flattened axis, which NumPy reduces much faster."""
    k = len(axis) if axis is not None else 0
    if k > 1 and x.flags.c_contiguous and tuple(axis) == tuple(range(x.ndim - k, x.ndim)):
        total = np.add.reduce(x.reshape(*x.shape[:x.ndim - k], -1), axis=-1, dtype=dtype)
        return total.reshape(*total.shape, *([1] * k)) if keepdims else total
    return np.add.reduce(x, axis=axis, keepdims=keepdims, dtype=dtype)


_GEMV_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _accumulator(dtype: np.dtype) -> np.dtype:
    # Sums in the input dtype (np.sum would widen int32 to int64), halves in float32.
    return compute_dtype(dtype)


class Reduce(OpKernel):
    """Shared axes/keepdims handling; subclasses implement `_reduce(x, axis)`."""

    def __init__(self, node):
        super().__init__(node)
        self.keepdims = self.attr_bool("keepdims", 1)
        self.noop = self.attr_bool("noop_with_empty_axes", 0)
        self.axes_attr = self.attr_ints("axes", None)

    def _axes(self, x, axes):
        if self.axes_attr is not None:
            axes = self.axes_attr
        else:
            axes = int_list(axes)
        if not axes:
            return () if self.noop else None
        return normalize_axes(axes, x.ndim)

    def _run(self, x, axes=None):
        y = self._reduce(x, self._axes(x, axes))
        return (np.asarray(y).astype(x.dtype, copy=False),)

    def _reduce(self, x, axis):
        raise NotImplementedError


@register("ReduceSum")
class ReduceSum(Reduce):
    def _reduce(self, x, axis):
        return np.sum(x, axis=axis, keepdims=self.keepdims, dtype=_accumulator(x.dtype))


@register("ReduceMean")
class ReduceMean(Reduce):
    def __init__(self, node):
        super().__init__(node)
        self._bound_axes = self._parsed = None

    def bind_constants(self, constants):
        self._bound_axes, self._parsed = constants.get(1), None

    def _run(self, x, axes=None):
        # The axes input is an initializer in exported models: parsed once per input rank.
        if axes is not None and axes is self._bound_axes and self.axes_attr is None:
            parsed = self._parsed
            if parsed is None or parsed[0] != x.ndim:
                parsed = self._parsed = (x.ndim, self._axes(x, axes))
            axis = parsed[1]
        else:
            axis = self._axes(x, axes)
        k = len(axis) if axis else 0
        if (k and x.dtype in _GEMV_DTYPES and x.flags.c_contiguous and x.size
                and axis == tuple(range(x.ndim - k, x.ndim))):
            # Mean over trailing axes (global pooling, SE blocks): one GEMV against a 1/count column.
            count = math.prod(x.shape[x.ndim - k:])
            y = np.dot(x.reshape(-1, count), constant_column(count, 1 / count, x.dtype))
            lead = x.shape[:x.ndim - k]
            return (y.reshape(lead + (1,) * k if self.keepdims else lead),)
        return (np.asarray(self._reduce(x, axis)).astype(x.dtype, copy=False),)

    def _reduce(self, x, axis):
        ct = _accumulator(x.dtype)
        if ct.kind in "iu":
            # Integer mean: sum then divide, truncating toward zero like the C kernels.
            count = x.size if axis is None else math.prod(x.shape[a] for a in axis)
            total = np.sum(x, axis=axis, keepdims=self.keepdims, dtype=np.int64)
            return (total - np.fmod(total, count)) // count if count else total
        # add.reduce and a multiply: np.mean's python wrapper costs more than the sum on small tensors.
        count = x.size if axis is None else math.prod(x.shape[a] for a in axis)
        total = trailing_sum(x, axis, self.keepdims, ct)
        return total * ct.type(1 / count) if count else total * ct.type(np.nan)


@register("ReduceProd")
class ReduceProd(Reduce):
    def _reduce(self, x, axis):
        return np.prod(x, axis=axis, keepdims=self.keepdims, dtype=_accumulator(x.dtype))


def _extreme(dtype: np.dtype, low: bool):
    """The identity of max (low=True) or min: what an empty reduction returns."""
    if dtype.kind == "b":
        return not low
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if low else info.max
    return -np.inf if low else np.inf


@register("ReduceMax")
class ReduceMax(Reduce):
    def _reduce(self, x, axis):
        # An empty set reduces to -inf (the identity of max), not to an error.
        extra = {"initial": _extreme(x.dtype, True)} if x.size == 0 else {}
        return np.max(x, axis=axis, keepdims=self.keepdims, **extra)


@register("ReduceMin")
class ReduceMin(Reduce):
    def _reduce(self, x, axis):
        extra = {"initial": _extreme(x.dtype, False)} if x.size == 0 else {}
        return np.min(x, axis=axis, keepdims=self.keepdims, **extra)


@register("ReduceSumSquare")
class ReduceSumSquare(Reduce):
    def _reduce(self, x, axis):
        xc = x.astype(_accumulator(x.dtype), copy=False)
        return np.sum(xc * xc, axis=axis, keepdims=self.keepdims)


@register("ReduceL1")
class ReduceL1(Reduce):
    def _reduce(self, x, axis):
        return np.sum(np.abs(x), axis=axis, keepdims=self.keepdims, dtype=_accumulator(x.dtype))


@register("ReduceL2")
class ReduceL2(Reduce):
    def _reduce(self, x, axis):
        ct = _accumulator(x.dtype)
        xc = x.astype(np.float64 if ct.kind in "iu" else ct, copy=False)
        return np.sqrt(np.sum(xc * xc, axis=axis, keepdims=self.keepdims))


@register("ReduceLogSum")
class ReduceLogSum(Reduce):
    def _reduce(self, x, axis):
        return np.log(np.sum(x, axis=axis, keepdims=self.keepdims, dtype=_accumulator(x.dtype)))


@register("ReduceLogSumExp")
class ReduceLogSumExp(Reduce):
    """log(sum(exp(x))) shifted by the max so that exp cannot overflow."""

    def _reduce(self, x, axis):
        xc = x.astype(_accumulator(x.dtype), copy=False)
        m = np.max(xc, axis=axis, keepdims=True, initial=-np.inf)
        m = np.where(np.isfinite(m), m, 0)
        y = np.log(np.sum(np.exp(xc - m), axis=axis, keepdims=True)) + m
        if not self.keepdims:
            y = y.reshape(()) if axis is None else np.squeeze(y, axis=axis)
        return y


class _ArgReduce(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)
        self.keepdims = self.attr_bool("keepdims", 1)
        self.last = self.attr_bool("select_last_index", 0)

    def _run(self, x):
        axis = normalize_axis(self.axis, x.ndim)
        if self.last:
            # Searching the flipped axis finds the last occurrence first.
            idx = x.shape[axis] - 1 - self.fn(np.flip(x, axis), axis=axis, keepdims=self.keepdims)
        else:
            idx = self.fn(x, axis=axis, keepdims=self.keepdims)
        return (np.asarray(idx, dtype=np.int64),)


@register("ArgMax")
class ArgMax(_ArgReduce):
    fn = staticmethod(np.argmax)


@register("ArgMin")
class ArgMin(_ArgReduce):
    fn = staticmethod(np.argmin)
