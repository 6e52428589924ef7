"""Shape and data-movement ops, constants and generators; Dropout (the identity at inference).

Several of these take as inputs what older opsets had as attributes (Split `split`,
Squeeze/Unsqueeze `axes`, Slice `starts`..., Pad `pads`); kernels accept both.
"""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep.base import OpKernel, int_list, normalize_axes, normalize_axis, scalar
from host.cpu_ep.registry import register

MEMO_ELEMENTS = 16  # a computed shape-like input up to this size is a memo key by its contents


def contents_key(arr):
    """A small integer array as a dict key by value (dtype, shape, bytes): the shape program's values of one
    signature (a Reshape's target, Slice bounds) repeat at every run of it; None for anything else."""
    if type(arr) is np.ndarray and arr.size <= MEMO_ELEMENTS:
        return arr.dtype.num, arr.shape, arr.tobytes()
    return None


class _ShapeMemo(OpKernel):
    """A kernel whose output shape follows from x's shape and a shape-like second input (target shape,
    axes): the shape is worked out once per input shape and kept (validation included: it runs on the
    first call for each), for that input an initializer or absent (attributes decide), or computed at run
    time and small (keyed by its contents, `contents_key`)."""

    def __init__(self, node):
        super().__init__(node)
        self._bound_arg = None
        self._memo: dict[tuple, tuple] = {}

    def bind_constants(self, constants):
        self._bound_arg, self._memo = constants.get(1), {}

    def out_shape(self, x, arg) -> tuple:
        if arg is None or arg is self._bound_arg:
            key = x.shape
        else:
            value = contents_key(arg)
            if value is None:
                return self._out_shape(x, arg)
            key = (x.shape, value)  # a tuple first: never equal to a bare shape key
        shape = self._memo.get(key)
        if shape is None:
            if len(self._memo) >= 64:  # many input shapes (dynamic axes): start over
                self._memo = {}
            shape = self._memo[key] = tuple(self._out_shape(x, arg))
        return shape

    def _out_shape(self, x, arg):
        raise NotImplementedError


@register("Identity")
class Identity(OpKernel):
    def _run(self, x):
        return (x,)


@register("Constant")
class Constant(OpKernel):
    """The value is built once; it is returned read-only so no consumer can alter it."""

    _FORMS = ("value", "value_float", "value_floats", "value_int", "value_ints",
              "value_string", "value_strings")

    def __init__(self, node):
        super().__init__(node)
        given = [k for k in node.attrs if k in self._FORMS or k == "sparse_value"]
        if len(given) != 1:
            raise self.bad_attr("value", sorted(given),
                                "exactly one of " + ", ".join(self._FORMS) + " (sparse_value unsupported)")
        key = given[0]
        raw = node.attrs[key]
        if key == "value":
            if not isinstance(raw, np.ndarray):
                raise self.bad_attr(key, raw, "a tensor")
            value = raw.copy()
        elif key in ("value_float", "value_floats"):
            value = np.array(raw, dtype=np.float32)
        elif key in ("value_int", "value_ints"):
            value = np.array(raw, dtype=np.int64)
        elif key in ("value_string", "value_strings"):
            value = np.empty(len(raw) if key == "value_strings" else (), dtype=object)
            value[...] = raw
        else:
            raise self.bad_attr(key, "<sparse tensor>", "a dense value (sparse_value is not supported)")
        value.flags.writeable = False
        self.value = value

    def _run(self):
        return (self.value,)


@register("ConstantOfShape", since=9)
class ConstantOfShape(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        value = self.attr("value", np.zeros(1, dtype=np.float32))
        if not isinstance(value, np.ndarray) or value.size != 1:
            raise self.bad_attr("value", value, "a one-element tensor")
        self.fill = value.reshape(-1)[0]
        self.dtype = value.dtype

    def _run(self, shape):
        dims = int_list(shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shape {dims} has a negative dimension")
        return (np.full(dims, self.fill, dtype=self.dtype),)


@register("Shape")
class Shape(OpKernel):
    """start/end (opset 15) slice the shape; python slicing clamps exactly as ONNX says."""

    def __init__(self, node):
        super().__init__(node)
        self.start = self.attr_int("start", 0)
        end = self.attr("end", None)
        self.end = None if end is None else self.attr_int("end")

    def _run(self, x):
        return (np.array(x.shape[self.start:self.end], dtype=np.int64),)


@register("Size")
class Size(OpKernel):
    def _run(self, x):
        return (np.array(x.size, dtype=np.int64),)


@register("Reshape", since=5)
class Reshape(_ShapeMemo):
    """0 copies the input dimension unless allowzero (opset 14); -1 is inferred."""

    def __init__(self, node):
        super().__init__(node)
        self.allowzero = self.attr_bool("allowzero", 0)

    def _run(self, x, shape):
        return (x.reshape(self.out_shape(x, shape)),)

    def _out_shape(self, x, shape):
        dims = int_list(shape)
        if not self.allowzero:
            if any(d == 0 for d in dims[x.ndim:]):
                raise ValueError(f"shape {dims}: a 0 past the input rank {x.ndim} has nothing to copy")
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return dims  # a -1 is resolved (and the size checked) by ndarray.reshape at each run


@register("Flatten")
class Flatten(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 1)

    def _run(self, x):
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        if not 0 <= axis <= x.ndim:
            raise ValueError(f"axis {self.axis} is out of range for rank {x.ndim}")
        return (x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:])),)


@register("Transpose")
class Transpose(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.perm = self.attr_ints("perm", None)

    def _run(self, x):
        # The method: np.transpose's Python wrapper costs as much again on small tensors.
        return (x.transpose(self.perm) if self.perm is not None else x.transpose(),)


class _AxesKernel(_ShapeMemo):
    """An op whose axes are an attribute before opset 13 and an input from then on."""

    def __init__(self, node):
        super().__init__(node)
        self.axes_attr = self.attr_ints("axes", None)

    def axes(self, axes_input) -> list[int]:
        return self.axes_attr if self.axes_attr is not None else int_list(axes_input)


@register("Squeeze")
class Squeeze(_AxesKernel):
    """Without axes every 1-dimension goes; listed axes must be 1."""

    def _run(self, x, axes=None):
        axes = self.axes(axes)
        if not axes:
            return (np.squeeze(x),)
        return (np.squeeze(x, axis=normalize_axes(axes, x.ndim)),)


@register("Unsqueeze")
class Unsqueeze(_AxesKernel):
    """Axes index the output, whose rank is input rank + len(axes)."""

    def _run(self, x, axes=None):
        return (x.reshape(self.out_shape(x, axes)),)

    def _out_shape(self, x, axes):
        axes = self.axes(axes)
        if not axes:
            raise ValueError("axes is empty")
        rank = x.ndim + len(axes)
        inserted = set(normalize_axes(axes, rank))
        dims = iter(x.shape)
        return [1 if i in inserted else next(dims) for i in range(rank)]


@register("Concat", since=4)
class Concat(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis")

    def _run(self, *xs):
        axis = normalize_axis(self.axis, xs[0].ndim)
        return (np.concatenate(xs, axis=axis),)


@register("Split", since=2)
class Split(OpKernel):
    """Sizes come from `split` (attribute < 13, input since), else equal chunks: one per
    output, or `num_outputs` (opset 18) with a smaller last chunk."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)
        self.split_attr = self.attr_ints("split", None, lo=0)
        num = self.attr("num_outputs", None)
        self.num_outputs = None if num is None else self.attr_int("num_outputs", lo=1)
        if self.num_outputs is not None and self.num_outputs != self.n_outputs:
            raise self.bad_attr("num_outputs", self.num_outputs,
                                f"the node's number of outputs ({self.n_outputs})")
        self._memo: dict[tuple, tuple] = {}  # (x's shape, the sizes' contents) -> the outputs' indices

    def _run(self, x, split=None):
        key = (x.shape, None if split is None else contents_key(split))
        index = self._memo.get(key)
        if index is None:
            index = self._index(x, split)
            if split is None or key[1] is not None:
                if len(self._memo) >= 64:
                    self._memo = {}
                self._memo[key] = index
        return tuple([x[i] for i in index])

    def _index(self, x, split) -> tuple:
        """The NumPy index of each output's block of x (validation included)."""
        axis = normalize_axis(self.axis, x.ndim)
        dim = x.shape[axis]
        sizes = self.split_attr if self.split_attr is not None else int_list(split)
        if not sizes:
            n = self.n_outputs
            if self.num_outputs is None and dim % n:
                raise ValueError(f"dimension {dim} does not split into {n} equal parts")
            chunk = -(-dim // n)
            sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
        if sum(sizes) != dim or any(s < 0 for s in sizes):
            raise ValueError(f"split sizes {sizes} do not add up to dimension {dim}")
        lead = (slice(None),) * axis
        index, start = [], 0
        for size in sizes:
            index.append((*lead, slice(start, start + size)))
            start += size
        return tuple(index)


@register("Slice")
class Slice(OpKernel):
    """starts/ends/axes are attributes before opset 10, inputs (with steps) since."""

    def __init__(self, node):
        super().__init__(node)
        self.attr_form = self.opset < 10
        if self.attr_form:
            self.starts = self.attr_ints("starts")
            self.ends = self.attr_ints("ends")
            self.axes = self.attr_ints("axes", None)
        self._memo: dict[tuple, tuple] = {}  # (x's shape, the bounds' contents) -> the index

    def _run(self, x, starts=None, ends=None, axes=None, steps=None):
        if self.attr_form:
            return (x[self._index(x, starts, ends, axes, steps)],)
        key = (x.shape, contents_key(starts), contents_key(ends), contents_key(axes), contents_key(steps))
        index = self._memo.get(key)
        if index is None:
            index = self._index(x, starts, ends, axes, steps)
            if None not in key[1:3] and (axes is None or key[3]) and (steps is None or key[4]):
                if len(self._memo) >= 64:
                    self._memo = {}
                self._memo[key] = index
        return (x[index],)

    def _index(self, x, starts, ends, axes, steps) -> tuple:
        """The NumPy index of x's slice (validation included)."""
        if self.attr_form:
            starts, ends, axes, steps = self.starts, self.ends, self.axes, None
        else:
            starts, ends = int_list(starts), int_list(ends)
            axes = None if axes is None else int_list(axes)
            steps = None if steps is None else int_list(steps)
        axes = list(range(len(starts))) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        if not len(starts) == len(ends) == len(axes) == len(steps):
            raise ValueError(f"starts {starts}, ends {ends}, axes {axes}, steps {steps} differ in length")
        index = [slice(None)] * x.ndim
        for axis, start, end, step in zip(normalize_axes(axes, x.ndim), starts, ends, steps):
            index[axis] = _clamped_slice(start, end, step, x.shape[axis])
        return tuple(index)


def _clamped_slice(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX clamping: negatives count from the end; a negative step may stop before 0."""
    if step == 0:
        raise ValueError("slice step cannot be 0")
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start = min(max(start, 0), dim - 1)
    end = min(max(end, -1), dim - 1)
    # end == -1 means "through index 0", which python spells None.
    return slice(start, None if end < 0 else end, step)


@register("Gather")
class Gather(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", 0)

    def _run(self, x, indices):
        axis = normalize_axis(self.axis, x.ndim)
        # np.take accepts negative indices and raises on out-of-range ones.
        return (np.take(x, indices.astype(np.int64, copy=False), axis=axis),)


@register("Expand", since=8)
class Expand(_ShapeMemo):
    """Bidirectional broadcast of x against `shape`; the result owns its memory."""

    def _out_shape(self, x, shape):
        return broadcast_shape(x.shape, int_list(shape))

    def _run(self, x, shape):
        y = np.empty(self.out_shape(x, shape), dtype=x.dtype)
        np.copyto(y, x)
        return (y,)


def broadcast_shape(a, b) -> tuple[int, ...]:
    """Multidirectional (numpy) broadcast of two shapes; ValueError when they do not broadcast."""
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + tuple(a)
    b = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


@register("Tile", since=6)
class Tile(OpKernel):
    def _run(self, x, repeats):
        reps = int_list(repeats)
        if len(reps) != x.ndim:
            raise ValueError(f"repeats {reps} must have one entry per input dimension ({x.ndim})")
        return (np.tile(x, reps),)


@register("Range", since=11)
class Range(OpKernel):
    """max(ceil((limit - start) / delta), 0) values start + i * delta, in start's dtype."""

    def _run(self, start, limit, delta):
        dtype = start.dtype
        return (np.arange(scalar(start).item(), scalar(limit).item(), scalar(delta).item()).astype(dtype),)


@register("Trilu", since=14)
class Trilu(OpKernel):
    """Keeps the upper (or lower) triangle of the last two axes, shifted by k."""

    def __init__(self, node):
        super().__init__(node)
        self.upper = self.attr_bool("upper", 1)

    def _run(self, x, k=None):
        k = 0 if k is None else int(scalar(k))
        return ((np.triu if self.upper else np.tril)(x, k),)


@register("Pad", since=2)
class Pad(OpKernel):
    """pads = [begin per axis..., end per axis...]; negative pads crop.

    pads/value are attributes before opset 11; pads, constant_value and (opset 18) axes
    are inputs since. Modes: constant, reflect, edge, wrap (opset 19).
    """

    def __init__(self, node):
        super().__init__(node)
        self.mode = self.attr_str("mode", "constant", choices=("constant", "reflect", "edge", "wrap"))
        self.pads_attr = self.attr_ints("pads", None) if self.opset < 11 else None
        self.value_attr = self.attr_float("value", 0.0) if self.opset < 11 else None

    def _run(self, x, pads=None, constant_value=None, axes=None):
        pads = self.pads_attr if self.pads_attr is not None else int_list(pads)
        axes = normalize_axes(int_list(axes), x.ndim) if axes is not None else range(x.ndim)
        n = len(axes)
        if len(pads) != 2 * n:
            raise ValueError(f"pads {pads} must hold 2 values per padded axis ({n} axes)")
        width = [(0, 0)] * x.ndim
        for i, axis in enumerate(axes):
            width[axis] = (pads[i], pads[i + n])
        # Negative pads remove elements: crop first, then pad what remains.
        crop = tuple(slice(max(-b, 0), dim - max(-e, 0)) for (b, e), dim in zip(width, x.shape))
        x = x[crop]
        width = [(max(b, 0), max(e, 0)) for b, e in width]
        if self.mode != "constant":
            return (np.pad(x, width, mode=self.mode),)
        if constant_value is not None and constant_value.size:
            value = scalar(constant_value)
        else:
            value = self.value_attr if self.value_attr is not None else 0
        return (np.pad(x, width, mode="constant", constant_values=value).astype(x.dtype, copy=False),)


@register("Dropout", since=7)
class Dropout(OpKernel):
    """Inference (the default) is the identity with an all-true mask. ratio is an
    attribute before opset 12; ratio and training_mode are inputs since."""

    def __init__(self, node):
        super().__init__(node)
        self.ratio_attr = self.attr_float("ratio", 0.5)
        seed = self.attr("seed", None)
        # Seeded once per kernel: runs differ, the first one matches np.random.seed(seed)
        # followed by uniform(), which is how the ONNX test data were drawn.
        self.rng = np.random.RandomState(None if seed is None else self.attr_int("seed") % 2**32)
        self.want_mask = self.n_outputs > 1 and bool(node.outputs[1])

    def _run(self, x, ratio=None, training_mode=None):
        training = training_mode is not None and bool(scalar(training_mode))
        r = self.ratio_attr if ratio is None else float(scalar(ratio))
        if not 0 <= r < 1:
            raise ValueError(f"ratio {r} is outside [0, 1)")
        if not training or r == 0:
            y, mask = x, (np.ones(x.shape, dtype=bool) if self.want_mask else None)
        else:
            mask = self.rng.uniform(0, 1.0, x.shape) >= r
            y = (x * mask / (1 - r)).astype(x.dtype, copy=False)
        return (y, mask) if self.want_mask else (y,)
