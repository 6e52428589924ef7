"""Index-driven ops: gathers and scatters by index tensors, OneHot, NonZero, TopK, CumSum.

Indices may be negative (counted from the end of their axis, as ONNX allows); an index outside
[-dim, dim) is a KernelError naming the node rather than a silent wrap or a NumPy IndexError.
"""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep.base import OpKernel, normalize_axis, scalar
from host.cpu_ep.registry import register

_REDUCTIONS = {"none": None, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def checked_indices(indices: np.ndarray, dim, what: str) -> np.ndarray:
    """int64 indices with negatives mapped into [0, dim); out-of-range raises ValueError.
    `dim` is an int or an array broadcasting against `indices` (one bound per coordinate)."""
    idx = indices.astype(np.int64, copy=False)
    if idx.size == 0:
        return idx
    if np.ndim(dim) == 0:
        # One bound: min and max decide (the common case, and the cheap one).
        lo, hi = int(idx.min()), int(idx.max())
        if -dim <= lo and hi < dim:
            return idx if lo >= 0 else np.where(idx < 0, idx + dim, idx)
    dim = np.asarray(dim, dtype=np.int64)
    bad = (idx < -dim) | (idx >= dim)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} {int(idx[first])} at position {first} is out of range for a dimension "
                         f"of {int(np.broadcast_to(dim, idx.shape)[first])}")
    return np.where(idx < 0, idx + dim, idx)


@register("GatherElements", since=11)
class GatherElements(OpKernel):
    """out[i][j][k] = data[index[i][j][k]][j][k] (for axis 0): NumPy's take_along_axis."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)

        self._bound = None
        self._flat: dict[tuple, np.ndarray] = {}

    def bind_constants(self, constants):
        self._bound, self._flat = constants.get(1), {}

    def _run(self, data, indices):
        axis = normalize_axis(self.axis, data.ndim)
        if indices.ndim != data.ndim:
            raise ValueError(f"indices of rank {indices.ndim} must have the rank of data ({data.ndim})")
        if indices is self._bound and indices.size and data.flags.c_contiguous:
            # Initializer indices (exporters' position ids): checked and made flat once per data shape.
            flat = self._flat.get(data.shape)
            if flat is None:
                if len(self._flat) >= 16:  # many data shapes: keep memory bounded
                    self._flat = {}
                flat = self._flat[data.shape] = self._flat_index(data.shape, indices, axis)
            if flat is not _NO_FLAT:
                return (np.take(data.reshape(-1), flat),)
        idx = checked_indices(indices, data.shape[axis], "index")
        return (np.take_along_axis(data, idx, axis=axis),)

    @staticmethod
    def _flat_index(shape, indices, axis):
        """Indices into data.reshape(-1) giving the gather (checked), or _NO_FLAT when indices would
        broadcast along another axis (the general path then decides)."""
        if any(i > d for a, (i, d) in enumerate(zip(indices.shape, shape)) if a != axis):
            return _NO_FLAT
        coords = list(np.indices(indices.shape, sparse=True))
        coords[axis] = checked_indices(indices, shape[axis], "index")
        flat = np.ravel_multi_index(coords, shape)
        flat.flags.writeable = False
        return flat


_NO_FLAT = np.empty(0, np.int64)  # marks "no flat index for this shape"


def _nd_split(data: np.ndarray, indices: np.ndarray, batch_dims: int):
    """(data as (B, *rest), indices as (B, N, k) normalized, output shape) for GatherND/ScatterND."""
    if indices.ndim < 1 or data.ndim < 1:
        raise ValueError("data and indices must have rank >= 1")
    k = indices.shape[-1]
    if batch_dims + k > data.ndim:
        raise ValueError(f"indices' last dimension {k} + batch_dims {batch_dims} exceeds data's rank {data.ndim}")
    if data.shape[:batch_dims] != indices.shape[:batch_dims]:
        raise ValueError(f"batch dimensions differ: data {data.shape[:batch_dims]}, indices "
                         f"{indices.shape[:batch_dims]}")
    b = math.prod(data.shape[:batch_dims])
    data_b = data.reshape(b, *data.shape[batch_dims:])
    idx = checked_indices(indices.reshape(b, -1, k), np.array(data.shape[batch_dims:batch_dims + k]), "index")
    out_shape = indices.shape[:-1] + data.shape[batch_dims + k:]
    return data_b, idx, out_shape


@register("GatherND", since=11)
class GatherND(OpKernel):
    """Gathers slices of data addressed by the last axis of indices (batch_dims since opset 12)."""

    def __init__(self, node):
        super().__init__(node)
        self.batch_dims = self.attr_int("batch_dims", 0, lo=0)

        self._bound = None
        self._flat: dict[tuple, tuple] = {}

    def bind_constants(self, constants):
        self._bound, self._flat = constants.get(1), {}

    def _run(self, data, indices):
        if indices is self._bound and data.flags.c_contiguous and data.size:
            # Initializer indices: checked and made flat once per data shape; a run is one take.
            cached = self._flat.get(data.shape)
            if cached is None:
                if len(self._flat) >= 16:  # many data shapes: keep memory bounded
                    self._flat = {}
                cached = self._flat[data.shape] = self._flat_index(data, indices)
            flat, rows, out_shape = cached
            return (data.reshape(rows).take(flat, axis=0).reshape(out_shape),)
        data_b, idx, out_shape = _nd_split(data, indices, self.batch_dims)
        batch = np.arange(data_b.shape[0]).reshape(-1, 1)
        coords = tuple(idx[..., j] for j in range(idx.shape[-1]))
        return (data_b[(batch, *coords)].reshape(out_shape),)

    def _flat_index(self, data, indices):
        """(row numbers, data's shape as rows, output shape): the addressed slices as rows of data
        reshaped to (batch * addressed cells, *slice)."""
        data_b, idx, out_shape = _nd_split(data, indices, self.batch_dims)
        k = idx.shape[-1]
        cells = data_b.shape[1:1 + k]
        batch = np.arange(data_b.shape[0]).reshape(-1, 1)
        flat = np.ravel_multi_index((batch, *(idx[..., j] for j in range(k))), (data_b.shape[0], *cells))
        flat.flags.writeable = False
        return flat, (-1, *data_b.shape[1 + k:]), out_shape


class _ScatterBase(OpKernel):
    """`reduction` (opset 16; max/min since 18) says how updates combine with data; with "none"
    duplicate indices keep the last update, as the reference implementation does."""

    def __init__(self, node):
        super().__init__(node)
        allowed = ("none",) if self.opset < 16 else ("none", "add", "mul") if self.opset < 18 else tuple(_REDUCTIONS)
        self.reduce = _REDUCTIONS[self.attr_str("reduction", "none", choices=allowed)]

    def _scatter(self, data, index, updates):
        out = data.copy()
        if self.reduce is None:
            out[index] = updates
        else:
            self.reduce.at(out, index, updates)
        return (out,)


@register("ScatterND", since=11)
class ScatterND(_ScatterBase):
    def _run(self, data, indices, updates):
        k = indices.shape[-1]
        if k > data.ndim:
            raise ValueError(f"indices' last dimension {k} exceeds data's rank {data.ndim}")
        want = indices.shape[:-1] + data.shape[k:]
        if updates.shape != want:
            raise ValueError(f"updates have shape {updates.shape}; expected {want}")
        idx = checked_indices(indices.reshape(-1, k), np.array(data.shape[:k]), "index")
        index = tuple(idx[:, j] for j in range(k))
        return self._scatter(data, index, updates.reshape(-1, *data.shape[k:]))


@register("ScatterElements", since=11)
class ScatterElements(_ScatterBase):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)

    def _run(self, data, indices, updates):
        axis = normalize_axis(self.axis, data.ndim)
        if indices.shape != updates.shape or indices.ndim != data.ndim:
            raise ValueError(f"indices {indices.shape} and updates {updates.shape} must share one shape of "
                             f"data's rank {data.ndim}")
        index = list(np.indices(indices.shape, sparse=True))
        index[axis] = checked_indices(indices, data.shape[axis], "index")
        return self._scatter(data, tuple(index), updates)


@register("OneHot", since=9)
class OneHot(OpKernel):
    """values = [off, on]; indices outside [-depth, depth) give an all-off row."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)

    def _run(self, indices, depth, values):
        d = int(scalar(depth))
        if d < 1:
            raise ValueError(f"depth {d} must be >= 1")
        if values.size != 2:
            raise ValueError(f"values must hold [off, on], got shape {values.shape}")
        axis = normalize_axis(self.axis, indices.ndim + 1)
        idx = np.asarray(indices).astype(np.int64)
        idx = np.where(idx < 0, idx + d, idx)
        shape = [1] * (indices.ndim + 1)
        shape[axis] = d
        hot = np.expand_dims(idx, axis) == np.arange(d).reshape(shape)
        off, on = values.reshape(-1)
        return (np.where(hot, on, off).astype(values.dtype, copy=False),)


@register("NonZero", since=9)
class NonZero(OpKernel):
    """(rank, count) int64 coordinates of the non-zero elements, row-major."""

    def _run(self, x):
        if x.ndim == 0:  # NumPy 2 refuses nonzero on 0-d; ONNX gives a (0, n) result
            return (np.zeros((0, int(bool(x))), np.int64),)
        return (np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1),)


@register("TopK", since=1)
class TopK(OpKernel):
    """The k largest (or smallest) along axis, sorted; ties keep the lower index first.
    k is an attribute before opset 10, an input since; largest/sorted since opset 11."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)
        self.k_attr = self.attr_int("k", lo=0) if self.opset < 10 else None
        self.largest = self.attr_bool("largest", 1)

    def _run(self, x, k=None):
        kk = self.k_attr if self.k_attr is not None else int(scalar(k))
        axis = normalize_axis(self.axis, x.ndim)
        n = x.shape[axis]
        if not 0 <= kk <= n:
            raise ValueError(f"k = {kk} is outside [0, {n}] (the size of axis {axis})")
        if self.largest:
            # Stable ascending sort of the reversed axis, read backwards: values descend and,
            # among equal values, the original lower index comes first.
            order = n - 1 - np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
        else:
            order = np.argsort(x, axis=axis, kind="stable")
        order = np.take(order, np.arange(kk), axis=axis)
        return np.take_along_axis(x, order, axis=axis), order.astype(np.int64, copy=False)


@register("CumSum", since=11)
class CumSum(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.exclusive = self.attr_bool("exclusive", 0)
        self.reverse = self.attr_bool("reverse", 0)

    scan = staticmethod(np.cumsum)
    identity = 0

    def _run(self, x, axis):
        ax = normalize_axis(int(scalar(axis)), x.ndim)
        y = np.flip(x, ax) if self.reverse else x
        out = type(self).scan(y, axis=ax, dtype=x.dtype)
        if self.exclusive:
            # Shift by one along the axis: each position gets the sum (product) of the ones before it.
            out = np.concatenate([np.full_like(np.take(out, [0], axis=ax), self.identity),
                                  np.take(out, np.arange(out.shape[ax] - 1), axis=ax)], axis=ax)
        return (np.flip(out, ax) if self.reverse else out,)


@register("CumProd", since=26)
class CumProd(CumSum):
    """CumSum's rules with products (exclusive: the first element is 1)."""

    scan = staticmethod(np.cumprod)
    identity = 1
