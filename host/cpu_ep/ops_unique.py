"""Unique: the distinct elements (or slices along an axis) of a tensor, sorted or in order of first
occurrence, with their first indices, the inverse mapping and their counts (numpy.unique)."""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, normalize_axis
from host.cpu_ep.registry import register


@register("Unique", since=11)
class Unique(OpKernel):
    """Y, indices, inverse_indices, counts; `sorted`=0 keeps the order of first occurrence."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr("axis", None)
        self.sorted = self.attr_bool("sorted", 1)

    def _run(self, x):
        axis = None if self.axis is None else normalize_axis(self.attr_int("axis"), x.ndim)
        y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True,
                                              axis=axis)
        inverse = inverse.reshape(-1)
        if not self.sorted:  # reorder the sorted uniques by where each first occurs
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            y = np.take(y, order, axis=0 if axis is None else axis)
            first, counts, inverse = first[order], counts[order], rank[inverse]
        return tuple(a.astype(np.int64, copy=False) if i else a
                     for i, a in enumerate((y, first, inverse, counts)))[:self.n_outputs]
