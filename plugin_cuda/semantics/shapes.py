"""ONNX shape rules, written once for the per-node kernels and the compiled plan's lowering.

Every function takes `where` (e.g. "Reshape node 'r'") for its messages and raises OpError when
the node breaks the op's rule. Where the two paths disagreed, the rule is ONNX's (checked against
onnx.reference): Reshape refuses a dimension below -1, Unsqueeze refuses repeated axes, Transpose's
perm must be a permutation of the input's rank.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from plugin_cuda.semantics.errors import OpError

__all__ = [
    "AUTO_PADS",
    "broadcast",
    "broadcast_shape",
    "concat_shape",
    "flatten_shape",
    "gather_shape",
    "gemm_shape",
    "matmul_shape",
    "normalize_axis",
    "output_geometry",
    "reshape_shape",
    "slice_indices",
    "softmax_default_axis",
    "squeeze_shape",
    "transpose_perm",
    "unsqueeze_shape",
]


def normalize_axis(axis: int, rank: int, where: str, name: str = "axis", allow_end: bool = False) -> int:
    """A possibly negative axis as 0..rank-1 (`allow_end`: `rank` itself is allowed, as in Flatten)."""
    top = rank if allow_end else rank - 1
    if not -rank <= axis <= top:
        raise OpError(f"{where}: {name} {axis} is out of range for rank {rank}; allowed: {-rank}..{top}")
    return axis + rank if axis < 0 else axis


@functools.lru_cache(maxsize=4096)
def _broadcast_ints(*shapes: tuple) -> tuple:
    return tuple(np.broadcast_shapes(*shapes))


def broadcast_shape(*shapes: tuple) -> tuple:
    """numpy.broadcast_shapes, memoised (shapes repeat from call to call); ValueError when they do
    not. Symbolic sizes (a compiled plan's int subclasses) keep their type where the result takes
    their value; the memo is keyed by plain ints, which compare equal to them."""
    if all(type(d) is int for s in shapes for d in s):
        return _broadcast_ints(*shapes)
    return _keep_symbolic(_broadcast_ints(*(tuple(int(d) for d in s) for s in shapes)), shapes)


def broadcast(where: str, *shapes) -> tuple:
    """The multidirectional broadcast of `shapes`; OpError when they do not broadcast."""
    try:
        return broadcast_shape(*(tuple(s) for s in shapes))
    except ValueError:
        raise OpError(f"{where}: input shapes {[tuple(s) for s in shapes]} do not broadcast") from None


def _keep_symbolic(out: tuple, shapes) -> tuple:
    """`out` with each dim taken from an input that has it as an int subclass (a compiled plan's
    symbolic size, plugin_cuda/plan/symint.py), so that the size keeps its expression."""
    if all(type(d) is int for s in shapes for d in s):
        return out
    res = list(out)
    for s in shapes:
        off = len(res) - len(s)
        for i, d in enumerate(s):
            if type(d) is not int and isinstance(d, int) and int(d) == res[off + i] and type(res[off + i]) is int:
                res[off + i] = d
    return tuple(res)


def reshape_shape(in_shape: tuple, shape: tuple, allowzero: bool, where: str) -> tuple:
    """Reshape's output shape: 0 copies the input's dimension (unless allowzero), one -1 is inferred."""
    out = list(shape)
    for i, d in enumerate(out):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise OpError(f"{where}: shape {shape} copies dim {i} that input shape {in_shape} lacks")
            out[i] = in_shape[i]
    if out.count(-1) > 1:
        raise OpError(f"{where}: shape {shape} has more than one -1")
    if any(d < -1 for d in out):
        raise OpError(f"{where}: shape {shape} has a dimension below -1; allowed: -1, 0 or more")
    size = math.prod(in_shape)
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        if known == 0 or size % known:
            raise OpError(f"{where}: cannot infer -1 in {shape} for input shape {in_shape}")
        out[out.index(-1)] = size // known
    if math.prod(out) != size:
        raise OpError(f"{where}: input shape {in_shape} does not fit {shape}")
    return tuple(out)


def squeeze_shape(in_shape: tuple, axes, where: str) -> tuple:
    """Squeeze's output shape (axes None: every dimension of size 1 goes)."""
    if axes is None:
        return tuple(d for d in in_shape if d != 1)
    rank = len(in_shape)
    drop = {normalize_axis(a, rank, where, "axes") for a in axes}
    for a in sorted(drop):
        if in_shape[a] != 1:
            raise OpError(f"{where}: axis {a} of shape {in_shape} is not 1")
    return tuple(d for i, d in enumerate(in_shape) if i not in drop)


def unsqueeze_shape(in_shape: tuple, axes, where: str) -> tuple:
    """Unsqueeze's output shape: axes (required, distinct) index the output."""
    if not axes:
        raise OpError(f"{where}: axes are required")
    rank = len(in_shape) + len(axes)
    insert = sorted({normalize_axis(a, rank, where, "axes") for a in axes})
    if len(insert) != len(axes):
        raise OpError(f"{where}: axes {tuple(axes)} repeat an axis")
    dims = iter(in_shape)
    return tuple(1 if i in insert else next(dims) for i in range(rank))


def flatten_shape(in_shape: tuple, axis: int, where: str) -> tuple:
    """Flatten's 2-D output shape (axis in -rank..rank)."""
    axis = normalize_axis(axis, len(in_shape), where, allow_end=True)
    return (math.prod(in_shape[:axis]), math.prod(in_shape[axis:]))


def transpose_perm(perm, rank: int, where: str) -> tuple:
    """Transpose's permutation: the attribute, or the reversed axes when it is absent."""
    if perm is None:
        return tuple(range(rank))[::-1]
    perm = tuple(perm)
    if sorted(perm) != list(range(rank)):
        raise OpError(f"{where}: perm {perm} does not fit rank {rank}; allowed: a permutation of 0..{rank - 1}")
    return perm


def concat_shape(shapes, axis: int, where: str) -> tuple[int, tuple]:
    """(normalised axis, output shape) of Concat; OpError when the inputs differ off the axis."""
    shapes = [tuple(s) for s in shapes]
    rank = len(shapes[0])
    axis = normalize_axis(axis, rank, where)
    for s in shapes:
        if len(s) != rank or s[:axis] != shapes[0][:axis] or s[axis + 1:] != shapes[0][axis + 1:]:
            raise OpError(f"{where}: input shapes {shapes} differ outside axis {axis}")
    return axis, shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]


def gather_shape(data_shape: tuple, index_shape: tuple, axis: int, where: str) -> tuple[int, tuple]:
    """(normalised axis, output shape) of Gather."""
    axis = normalize_axis(axis, len(data_shape), where)
    return axis, tuple(data_shape[:axis]) + tuple(index_shape) + tuple(data_shape[axis + 1:])


def softmax_default_axis(opset: int) -> int:
    """Softmax / LogSoftmax's default axis: -1 from opset 13 on, 1 before (coerced to 2-D there)."""
    return -1 if opset >= 13 else 1


def slice_indices(in_shape: tuple, starts, ends, axes, steps, where: str) -> tuple[tuple, tuple]:
    """(index of Python slices, output shape) of Slice, bounds clamped the ONNX way."""
    rank = len(in_shape)
    if axes is None:
        axes = tuple(range(len(starts)))
    if steps is None:
        steps = (1,) * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise OpError(f"{where}: starts {starts}, ends {ends}, axes {axes} and steps {steps} differ in length")
    index = [slice(None)] * rank
    seen = set()
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = normalize_axis(axis, rank, where, "axes")
        if axis in seen:
            raise OpError(f"{where}: axes {axes} repeat axis {axis}")
        seen.add(axis)
        if step == 0:
            raise OpError(f"{where}: steps {steps} contain 0")
        # Clamp the ONNX way (which is Python's), then rebuild a slice CuPy reads the same way:
        # a negative-step stop of -1 from indices() means "past the first element", i.e. None.
        lo, hi, st = slice(start, end, step).indices(in_shape[axis])
        if not range(lo, hi, st):
            index[axis] = slice(0, 0, 1)
        else:
            index[axis] = slice(lo, None if hi < 0 else hi, st)
    index = tuple(index)
    return index, tuple(len(range(*s.indices(d))) for s, d in zip(index, in_shape))


AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def output_geometry(node: str, in_sizes, kernel, strides, dilations, pads, auto_pad, ceil_mode=False):
    """(out_sizes, pads_begin, pads_end) per spatial dim, as the ONNX spec computes them."""
    n = len(in_sizes)
    outs, begins, ends = [], [], []
    for i in range(n):
        size, k, s, d = in_sizes[i], kernel[i], strides[i], dilations[i]
        eff = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = -(-size // s)
            total = max(0, (out - 1) * s + eff - size)
            begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            end = total - begin
        elif auto_pad == "VALID":
            begin = end = 0
            out = (size - eff) // s + 1
        else:
            begin, end = pads[i], pads[i + n]
            span = size + begin + end - eff
            if ceil_mode:
                out = -(-span // s) + 1
                if (out - 1) * s >= size + begin:  # the last window would start in the end padding
                    out -= 1
            else:
                out = span // s + 1
        if out <= 0:
            raise OpError(
                f"node '{node}': spatial size {size} with kernel {k}, stride {s}, dilation {d} and pads "
                f"({begin}, {end}) leaves no output"
            )
        outs.append(out)
        begins.append(begin)
        ends.append(end)
    return tuple(outs), tuple(begins), tuple(ends)


def matmul_shape(a_shape: tuple, b_shape: tuple) -> tuple:
    """ONNX MatMul's output shape (numpy.matmul rules)."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) == 0 or len(b_shape) == 0:
        raise OpError(f"MatMul got shapes {a_shape} and {b_shape}; allowed: rank 1 or more")
    a2 = (1,) + a_shape if len(a_shape) == 1 else a_shape
    b2 = b_shape + (1,) if len(b_shape) == 1 else b_shape
    if a2[-1] != b2[-2]:
        raise OpError(f"MatMul got shapes {a_shape} and {b_shape}; the inner dimensions {a2[-1]} and {b2[-2]} "
                      "must match")
    try:
        batch = broadcast_shape(a2[:-2], b2[:-2])
    except ValueError:
        raise OpError(f"MatMul got shapes {a_shape} and {b_shape}; their batch dimensions do not broadcast") from None
    return batch + ((a2[-2],) if len(a_shape) > 1 else ()) + ((b2[-1],) if len(b_shape) > 1 else ())


def gemm_shape(a_shape: tuple, b_shape: tuple, trans_a: bool, trans_b: bool) -> tuple:
    """ONNX Gemm's output shape (M, N) of op(A) (M, K) and op(B) (K, N)."""
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise OpError(f"Gemm got shapes {a_shape} and {b_shape}; allowed: two 2-D matrices")
    m, k = (a_shape[1], a_shape[0]) if trans_a else a_shape
    k2, n = (b_shape[1], b_shape[0]) if trans_b else b_shape
    if k != k2:
        raise OpError(f"Gemm got shapes {a_shape} (transA={int(trans_a)}) and {b_shape} (transB={int(trans_b)}); "
                      f"the inner dimensions {k} and {k2} must match")
    return (m, n)
