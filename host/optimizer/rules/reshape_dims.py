"""Reshape(x, a shape built from x's own dims) -> Reshape(x, a constant with 0 for each copied dim).

Dynamic-axes exports (TorchScript exporter's `x.view(x.size(0), x.size(1), heads, -1)`) compute the
target shape at run time: Concat(Unsqueeze(Gather(Shape(x), 0)), Unsqueeze(Gather(Shape(x), 1)),
[heads], [-1]). With allowzero=0 a 0 in Reshape's shape copies the input's dim at that position, so
where position j of the shape is dim j of x itself, the whole shape is the constant [0, 0, heads, -1].
The shape subgraph then dies, and the fusions that need constant reshapes and single-use values
(Attention3D: its output Transpose was also read by that Shape) match as on a static export.
"""

from __future__ import annotations

import numpy as np
from onnxscript.rewriter import pattern

from host.optimizer.rules.base import constant_array


def _op(value, op_type: str):
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _copied_dim(part, x) -> int | None:
    """i when `part` is Unsqueeze(Gather(Shape(x), i), [0]) (or Slice(Shape(x), [i], [i+1])), else None."""
    unsq = _op(part, "Unsqueeze")
    if unsq is not None:
        axes = constant_array(unsq.inputs[1]) if len(unsq.inputs) > 1 else np.array(unsq.attributes.get_ints("axes", []))
        gather = _op(unsq.inputs[0], "Gather")
        if axes is None or list(np.ravel(axes)) != [0] or gather is None or gather.attributes.get_int("axis", 0) != 0:
            return None
        index = constant_array(gather.inputs[1])
        if index is None or index.ndim != 0:
            return None
        shape_of, i = _op(gather.inputs[0], "Shape"), int(index)
    else:
        sl = _op(part, "Slice")
        if sl is None or len(sl.inputs) not in (3, 4):
            return None
        if len(sl.inputs) == 4 and sl.inputs[3] is not None:
            axes = constant_array(sl.inputs[3])
            if axes is None or list(np.ravel(axes)) != [0]:
                return None
        starts, ends = constant_array(sl.inputs[1]), constant_array(sl.inputs[2])
        if starts is None or ends is None or starts.size != 1 or ends.size != 1 \
                or int(ends.ravel()[0]) != int(starts.ravel()[0]) + 1:
            return None
        shape_of, i = _op(sl.inputs[0], "Shape"), int(starts.ravel()[0])
    if shape_of is None or shape_of.inputs[0] is not x or shape_of.attributes.get_int("start", 0) != 0 \
            or shape_of.attributes.get("end") is not None:
        return None
    return i


class ReshapeCopiedDims(pattern.RewriteRuleClassBase):
    """Reshape(x, Concat(x's dims at their own positions, constants)) -> Reshape(x, constant)."""

    def pattern(self, op, x, shape):
        return op.Reshape(x, shape, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, shape, y, **_):
        result = pattern.MatchResult()
        if y.producer().attributes.get_int("allowzero", 0) != 0:
            return result.fail("allowzero=1: a 0 would not copy a dim", y)
        concat = _op(shape, "Concat")
        rank = x.shape.rank() if x.shape is not None else None
        if concat is None or concat.attributes.get_int("axis", 0) not in (0, -1) or rank is None:
            return result.fail("the shape is not a Concat, or x's rank is unknown", shape)
        out, copied = [], 0
        for part in concat.inputs:
            i = _copied_dim(part, x)
            if i is not None:
                if (i + rank if i < 0 else i) != len(out):
                    return result.fail(f"dim {i} of x goes to position {len(out)}", part)
                out.append(0)
                copied += 1
                continue
            value = constant_array(part)
            if value is None or value.dtype.kind not in "iu" or value.ndim > 1:
                return result.fail("a part is neither one of x's dims in place nor a constant vector", part)
            out += [int(v) for v in np.ravel(value)]
        if not copied:
            return result.fail("no dim of x is copied (constant folding's case)", shape)
        self._shape = out
        return result

    def rewrite(self, op, x, **_):
        return op.Reshape(x, op.Constant(value_ints=self._shape))


def reshape_dims_rules() -> list:
    return [ReshapeCopiedDims.rule()]


__all__ = ["ReshapeCopiedDims", "reshape_dims_rules"]
