"""The run front's shortcut for the common feed: a C-contiguous NumPy array of the input's dtype
whose shape fits the declared one.

Such a feed is taken as it is (InferenceSession.check_feed would return the same object: np.asarray
of a C-contiguous array is that array); anything else (another dtype or shape, strings, OrtValues,
device arrays, lists, sequences and maps) goes through check_feed, which converts or raises the
typed error. What a check depends on (dtype, rank, fixed dims) is worked out once per session.
"""

from __future__ import annotations

import numpy as np

from abi.dtypes import STRING, to_numpy


class PlainInput:
    """One tensor input's plain-feed test: `accepts(value)` is True when check_feed would pass
    `value` through unchanged."""

    __slots__ = ("axes", "dtype", "rank", "vid", "wants")

    def __init__(self, vid: int, dtype: np.dtype, shape: tuple):
        self.vid, self.dtype, self.rank = vid, dtype, len(shape)
        fixed = [(axis, dim) for axis, dim in enumerate(shape) if isinstance(dim, int) and dim > 0]
        self.axes = tuple(axis for axis, _ in fixed)
        self.wants = tuple(dim for _, dim in fixed)

    def accepts(self, value) -> bool:
        if type(value) is not np.ndarray or value.dtype != self.dtype or not value.flags.c_contiguous:
            return False
        shape = value.shape
        if len(shape) != self.rank:
            return False
        for axis, want in zip(self.axes, self.wants):
            if shape[axis] != want:
                return False
        return True


def plain_inputs(metas: dict, input_ids: dict[str, int]) -> dict[str, PlainInput]:
    """{input name: PlainInput} for the inputs that can take a plain feed: tensors of a known,
    non-string element type and a declared shape."""
    out = {}
    for name, meta in metas.items():
        if meta.type is not None or not meta.elem_type or meta.elem_type == STRING or meta.shape is None:
            continue
        try:
            dtype = to_numpy(meta.elem_type)
        except TypeError:
            continue  # an element type NumPy cannot hold: check_feed (or the model's checks) says so
        out[name] = PlainInput(input_ids[name], dtype, tuple(meta.shape))
    return out


__all__ = ["PlainInput", "plain_inputs"]
