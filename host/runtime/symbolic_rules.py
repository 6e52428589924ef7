"""The output shapes host/runtime/symbolic_shapes.py computes where ONNX inference gives an unknown dim.

Each rule takes (node, shapes, env, symbols): `shapes` the current dims of every value (int, dim
string or None), `env` the symbolic values of small integer tensors (host/runtime/range_lengths.py),
`symbols` the graph inputs' symbols; it returns the first output's dims, None where unknown, or None
for the whole shape. A dim is *known* when it is an int or an expression over the symbols
(host/runtime/dims.py); unknown dims never enter an expression.
"""

from __future__ import annotations

import re

import onnx

from host.runtime import dims, range_lengths

_BIG = 2**31  # an end at least this large means "to the end" (exporters write INT64_MAX)


def known(d, symbols) -> bool:
    return d is not None and dims.compile_dim(d, symbols) is not None


def _min(a, b):
    """Min(a, b) for known dims (ints fold)."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return f"Min({a}, {b})"


_MIN = re.compile(r"^Min\((.+), (\d+)\)$")


def merge(a, b, symbols):
    """The broadcast of two dims: equal dims stay, a 1 gives the other, two different known dims give
    their Max (a valid broadcast has them equal or one of them 1), written as the plain one where the
    other is `Min(plain, N)`; an unknown dim with anything but 1 stays unknown."""
    if a == b:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    if not (known(a, symbols) and known(b, symbols)):
        return None
    if isinstance(a, int) or isinstance(b, int):
        return a if isinstance(a, int) else b  # the symbolic one must be that size (or 1)
    for x, y in ((a, b), (b, a)):
        m = _MIN.match(y)
        if m and m.group(1) == x:
            return x
    return f"Max({a}, {b})"


def broadcast(shapes_in, symbols):
    """numpy's broadcast of several shapes, dim by dim with `merge`; None when a rank is unknown."""
    if any(s is None for s in shapes_in):
        return None
    rank = max(len(s) for s in shapes_in)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes_in]
    out = []
    for column in zip(*padded):
        d = column[0]
        for other in column[1:]:
            d = merge(d, other, symbols)
        out.append(d)
    return out


def _elementwise(node, shapes, env, symbols):
    return broadcast([shapes.get(x) for x in node.input if x], symbols)


def _term(t, symbols):
    """An env term as a dim: ints and known expressions; None otherwise."""
    return t if known(t, symbols) else None


def _expand(node, shapes, env, symbols):
    target = env.get(node.input[1])
    if target is None:
        return None
    return broadcast([shapes.get(node.input[0]), [_term(t, symbols) for t in target]], symbols)


def _constant_of_shape(node, shapes, env, symbols):
    target = env.get(node.input[0])
    return None if target is None else [_term(t, symbols) for t in target]


def _slice_dim(dim, start, end, step, symbols):
    """The length of dim[start:end:step] (ONNX clamps as Python does)."""
    if isinstance(dim, int) and all(isinstance(v, int) for v in (start, end, step)):
        return len(range(dim)[start:end:step])
    if step != 1 or not isinstance(start, int) or start < 0:
        return None
    if isinstance(end, int) and end >= _BIG:
        return dims.term_sub(dim, start) if known(dim, symbols) else None
    if start == 0 and known(end, symbols) and not isinstance(end, int) and known(dim, symbols):
        # Slice(buffer[N], 0, seq): seq elements where seq <= N (Min says so for any seq).
        return end if dim == end else _min(end, dim)
    return None


def _slice(node, shapes, env, symbols):
    data = shapes.get(node.input[0])
    ins = list(node.input) + [""] * (5 - len(node.input))
    starts, ends = env.get(ins[1]), env.get(ins[2])
    if data is None or starts is None or ends is None:
        return None
    axes = env.get(ins[3]) if ins[3] else list(range(len(starts)))
    steps = env.get(ins[4]) if ins[4] else [1] * len(starts)
    if axes is None or steps is None or not all(isinstance(a, int) for a in axes):
        return None
    out = list(data)
    for axis, start, end, step in zip(axes, starts, ends, steps):
        axis = axis + len(data) if axis < 0 else axis
        out[axis] = _slice_dim(data[axis], start, end, step, symbols) if known(data[axis], symbols) else None
    return out


def _concat(node, shapes, env, symbols):
    parts = [shapes.get(x) for x in node.input if x]
    if any(p is None for p in parts) or len({len(p) for p in parts}) != 1:
        return None
    axis = range_lengths._attr(node, "axis", 0)
    axis = axis + len(parts[0]) if axis < 0 else axis
    out = []
    for i, column in enumerate(zip(*parts)):
        if i == axis:
            total = 0
            for d in column:
                total = dims.term_add(total, d) if known(d, symbols) and known(total, symbols) else None
            out.append(total)
        else:
            d = column[0]
            for other in column[1:]:
                d = d if d == other else (d if known(d, symbols) else other)  # Concat forces them equal
            out.append(d)
    return out


def _reshape(node, shapes, env, symbols):
    target, data = env.get(node.input[1]), shapes.get(node.input[0])
    if target is None:
        return None
    allowzero = range_lengths._attr(node, "allowzero", 0)
    out = []
    for i, t in enumerate(target):
        if t == 0 and not allowzero:
            t = data[i] if data is not None and i < len(data) else None
        out.append(t if t == -1 else _term(t, symbols))
    if -1 in out:
        out[out.index(-1)] = _inferred_dim(data, [d for d in out if d != -1], symbols)
    return out


def _inferred_dim(data, others, symbols):
    """The dim a Reshape's -1 stands for: the input's dims not matched by the other target dims, when
    what is left divides exactly."""
    if data is None or not all(known(d, symbols) for d in data) or not all(known(d, symbols) for d in others):
        return None
    left = list(data)
    divisor = 1
    for d in others:
        if d in left:
            left.remove(d)
        elif isinstance(d, int):
            divisor *= d
        else:
            return None
    fixed = 1
    for d in [d for d in left if isinstance(d, int)]:
        fixed *= d
    if fixed % divisor:
        return None
    result = fixed // divisor
    for d in [d for d in left if not isinstance(d, int)]:
        result = dims.term_mul(result, d)
    return result


def _range(node, shapes, env, symbols):
    length = range_lengths._range_length(node, env, shapes, symbols)
    return None if length is None else [length]


_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Equal", "Less", "Greater",
                "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "BitShift", "Sum", "Mean")
RULES = {op: _elementwise for op in _ELEMENTWISE}
RULES.update({"Expand": _expand, "ConstantOfShape": _constant_of_shape, "Slice": _slice, "Concat": _concat,
              "Reshape": _reshape, "Range": _range})


def follow(node, env, scalar, shapes) -> list | None:
    """The symbolic value of the node's first output (range_lengths' ops, and the ones the TorchScript
    exporter's `expand(-1)` pattern adds: `Where(Equal(shape, ConstantOfShape * -1), ..., shape)`)."""
    value = range_lengths._follow(node, env, scalar, shapes)
    if value is not None:
        return value
    op, ins = node.op_type, [x for x in node.input if x]
    args = [env.get(x) for x in ins]
    if op == "ConstantOfShape" and args and args[0] is not None and all(isinstance(t, int) for t in args[0]):
        count = 1
        for t in args[0]:
            count *= t
        attr = range_lengths._attr(node, "value")  # absent: a float 0, no shape value
        if attr is None or attr.data_type not in range_lengths._INT_TYPES:
            return None
        fill = int(onnx.numpy_helper.to_array(attr).ravel()[0])
        return [fill] * count if count <= 64 else None
    if any(a is None for a in args):
        return None
    if op == "Reshape" and len(args) == 2:  # of a small 1-D value: the same values
        return args[0]
    if op == "Div" and len(args) == 2:  # Llama's head_dim // 2 (integer Div truncates; dims are >= 0)
        return _pairwise(args, _divide)
    if op == "Equal" and len(args) == 2:
        return _pairwise(args, _equal)
    if op == "Where" and len(args) == 3:
        n = max(len(a) for a in args)
        c, a, b = (x * n if len(x) == 1 else x for x in args)
        if len({len(c), len(a), len(b)}) != 1 or any(not isinstance(t, bool) for t in c):
            return None
        return [x if t else y for t, x, y in zip(c, a, b)]
    return None


def _pairwise(args, fn):
    a, b = args
    n = max(len(a), len(b))
    a, b = (x * n if len(x) == 1 else x for x in (a, b))
    if len(a) != len(b):
        return None
    out = [fn(x, y) for x, y in zip(a, b)]
    return None if any(t is None for t in out) else out


def _divide(x, y):
    if not isinstance(y, int) or isinstance(y, bool) or y <= 0:
        return None
    if isinstance(x, int) and not isinstance(x, bool):
        return x // y if x >= 0 else None
    return f"({x} // {y})" if isinstance(x, str) else None


def _equal(x, y):
    """x == y for dim terms: ints compare; a dim's name (never negative) differs from a negative int."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    if x == y and x is not None:
        return True
    for s, i in ((x, y), (y, x)):
        if isinstance(s, str) and s.isidentifier() and isinstance(i, int) and i < 0:
            return False
    return None
