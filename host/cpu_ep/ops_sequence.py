"""Sequence and optional ops. A seq(T) value is a Python list, an empty optional is None
(host/runtime/types.py); kernels never change a list they were given, they return a new one."""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, int_list, normalize_axis, scalar
from host.cpu_ep.registry import register


def _position(seq: list, pos, insert: bool) -> int:
    """A sequence position in range: [-n, n-1] to read or erase, [-n, n] to insert."""
    n = len(seq)
    p = int(scalar(pos))
    hi = n if insert else n - 1
    if not -n <= p <= hi:
        raise ValueError(f"position {p} is out of range for a sequence of {n} tensor(s); allowed: {-n}..{hi}")
    return p + n if p < 0 else p


@register("SequenceEmpty", since=11)
class SequenceEmpty(OpKernel):
    def _run(self):
        return ([],)


@register("SequenceConstruct", since=11)
class SequenceConstruct(OpKernel):
    def _run(self, *tensors):
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"a sequence holds one element type; got {sorted(str(d) for d in dtypes)}")
        return (list(tensors),)


@register("SequenceInsert", since=11)
class SequenceInsert(OpKernel):
    def _run(self, seq, tensor, position=None):
        if seq and seq[0].dtype != tensor.dtype:
            raise ValueError(f"inserting a {tensor.dtype} tensor into a sequence of {seq[0].dtype}")
        out = list(seq)
        out.insert(len(seq) if position is None else _position(seq, position, True), tensor)
        return (out,)


@register("SequenceAt", since=11)
class SequenceAt(OpKernel):
    def _run(self, seq, position):
        return (seq[_position(seq, position, False)],)


@register("SequenceErase", since=11)
class SequenceErase(OpKernel):
    def _run(self, seq, position=None):
        if not seq:
            raise ValueError("cannot erase from an empty sequence")
        out = list(seq)
        del out[len(seq) - 1 if position is None else _position(seq, position, False)]
        return (out,)


@register("SequenceLength", since=11)
class SequenceLength(OpKernel):
    def _run(self, seq):
        return (np.array(len(seq), np.int64),)


@register("SplitToSequence", since=11)
class SplitToSequence(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)
        self.keepdims = self.attr_bool("keepdims", 1)

    def _run(self, x, split=None):
        axis = normalize_axis(self.axis, x.ndim)
        n = x.shape[axis]
        if split is None:
            parts = np.split(x, n, axis=axis)
            return ([p if self.keepdims else np.squeeze(p, axis) for p in parts],)
        if split.ndim == 0:
            size = int(split)
            if size <= 0:
                raise ValueError(f"split size must be > 0; got {size}")
            cuts = list(range(size, n, size))
        else:
            sizes = int_list(split)
            if sum(sizes) != n or any(s < 0 for s in sizes):
                raise ValueError(f"split sizes {sizes} must be >= 0 and add up to {n}, the length of axis {axis}")
            cuts = np.cumsum(sizes)[:-1].tolist()
        return (np.split(x, cuts, axis=axis),)


@register("ConcatFromSequence", since=11)
class ConcatFromSequence(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis")
        self.new_axis = self.attr_bool("new_axis", 0)

    def _run(self, seq):
        if not seq:
            raise ValueError("ConcatFromSequence of an empty sequence")
        if self.new_axis:
            return (np.stack(seq, axis=normalize_axis(self.axis, seq[0].ndim + 1)),)
        return (np.concatenate(seq, axis=normalize_axis(self.axis, seq[0].ndim)),)


@register("Optional", since=15)
class Optional(OpKernel):
    def _run(self, value=None):
        return (value,)


@register("OptionalHasElement", since=15)
class OptionalHasElement(OpKernel):
    def _run(self, value=None):
        return (np.array(value is not None),)


@register("OptionalGetElement", since=15)
class OptionalGetElement(OpKernel):
    def _run(self, value):
        if value is None:
            raise ValueError("the optional input is empty (None); OptionalGetElement needs a value")
        return (value,)
