"""The rotary-embedding pattern (HF rotate_half) -> RotaryEmbedding (opset 23).

Three forms of `x * cos + rotate_half(x) * sin`, rotate_half(x) = Concat(-x[..., half:], x[..., :half]),
on a 4-D x (batch, heads, seq, head_size):

- cos / sin computed as Cos / Sin(Concat(freqs, freqs)) (onnxscript's rule);
- cos / sin folded into constant tables (what BASIC constant folding leaves of a static-shape
  export, the Llama fixtures): tables broadcastable to (batch | 1, 1, seq, head_size);
- cos / sin gathered from constant tables (max_position, head_size) by position ids, then
  Unsqueeze(axes=[1]) (the cos_cached[position_ids] form).

RotaryEmbedding-23 rotates the halves (x1, x2) by one angle per pair: y1 = x1*c - x2*s,
y2 = x2*c + x1*s. The unfused form equals it only when each table's two halves are the same
(HF builds them as cat(freqs, freqs)); tables whose halves differ are left alone. The caches are
the first halves: (batch, seq, head_size/2) without position ids (batch made explicit, since
onnxruntime does not broadcast a cache's batch of 1), (max_position, head_size/2) with them.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern
from onnxscript.rewriter.rules.fusion import _rotary_embedding as onnxscript_rope

from host.optimizer.rules.base import Family, constant_array, has_float_type


def _rotate_half(op, x):
    x1 = op.Slice(x, _allow_other_inputs=True, _outputs=["x1"])
    x2 = op.Slice(x, _allow_other_inputs=True, _outputs=["x2"])
    return op.Concat(op.Neg(x2), x1, _outputs=["rotated"])


class _TableRotary(pattern.RewriteRuleClassBase):
    """What the table forms share: the rotate_half checks and the caches' half-equality check."""

    def _check_x(self, result: pattern.MatchResult, x, x1, x2, rotated) -> pattern.MatchResult:
        """x is 4-D with static batch (where needed), seq and even head size; x1 / x2 are its halves."""
        if x is None or x.shape is None or x.shape.rank() != 4 or not has_float_type(x):
            return result.fail("x is not a 4-D float tensor of known rank", x)
        head = x.shape[3]
        if not isinstance(head, int) or head % 2:
            return result.fail("x's head size is not static and even", x)
        half = head // 2
        if not _is_slice(x1.producer(), 0, lambda e: e == half) or not _is_slice(x2.producer(), half,
                                                                                  lambda e: e >= head):
            return result.fail("the Slices do not split the last axis into halves", x1)
        axis = rotated.producer().attributes.get_int("axis", None)
        if axis not in (-1, 3):
            return result.fail(f"rotate_half concatenates on axis {axis}, not the last", rotated)
        return result

    @staticmethod
    def _halves(table: np.ndarray, half: int) -> np.ndarray | None:
        """The first half of the table's last axis, or None when the second half differs from it."""
        first, second = table[..., :half], table[..., half:]
        return np.ascontiguousarray(first) if np.array_equal(first, second) else None


class FoldedTableRotary(_TableRotary):
    """x * cos + rotate_half(x) * sin with cos / sin constant tables (folded from static positions)."""

    def __init__(self):
        super().__init__(name="RotaryEmbeddingFoldedTables")

    def pattern(self, op, x, cos, sin):
        return op.Add(op.Mul(x, cos), op.Mul(_rotate_half(op, x), sin))

    def check(self, context, x, cos, sin, x1, x2, rotated, **_):
        result = self._check_x(pattern.MatchResult(), x, x1, x2, rotated)
        if not result:
            return result
        batch, seq, head = x.shape[0], x.shape[2], x.shape[3]
        if not isinstance(batch, int) or not isinstance(seq, int):
            return result.fail("x's batch and seq dims are not static (the caches need them)", x)
        caches = []
        for name, value in (("cos", cos), ("sin", sin)):
            table = constant_array(value)
            if table is None or value.dtype != x.dtype or table.ndim > 4:
                return result.fail(f"{name} is not a constant table of x's type and rank <= 4", value)
            table = table.reshape((1,) * (4 - table.ndim) + table.shape)
            if table.shape[1] != 1 or table.shape[0] not in (1, batch) or not _broadcasts(table.shape, (
                    batch, 1, seq, head)):
                return result.fail(f"{name} {list(table.shape)} does not broadcast to (batch | 1, 1, seq, head)",
                                   value)
            full = np.broadcast_to(table, (batch, 1, seq, head))[:, 0]
            cache = self._halves(full, head // 2)
            if cache is None:
                return result.fail(f"the two halves of the {name} table differ", value)
            caches.append(cache)
        self._caches = caches
        return result

    def rewrite(self, op, x, **_):
        cos, sin = (op.Constant(value=ir.tensor(c)) for c in self._caches)
        return op.RotaryEmbedding(x, cos, sin, interleaved=0)


class GatheredTableRotary(_TableRotary):
    """x * cos + rotate_half(x) * sin with cos / sin = Unsqueeze(Gather(table, position_ids), [1])."""

    def __init__(self):
        super().__init__(name="RotaryEmbeddingGatheredTables")

    def pattern(self, op, x, cos_table, sin_table, position_ids, cos_axes, sin_axes):
        cos = op.Unsqueeze(op.Gather(cos_table, position_ids, axis=0), cos_axes)
        sin = op.Unsqueeze(op.Gather(sin_table, position_ids, axis=0), sin_axes)
        return op.Add(op.Mul(x, cos), op.Mul(_rotate_half(op, x), sin))

    def check(self, context, x, cos_table, sin_table, position_ids, cos_axes, sin_axes, x1, x2, rotated, **_):
        result = self._check_x(pattern.MatchResult(), x, x1, x2, rotated)
        if not result:
            return result
        for axes in (cos_axes, sin_axes):
            if not _ir_utils.is_singleton_value(axes, 1):
                return result.fail("the gathered table is not unsqueezed at axis 1", axes)
        pos_shape = position_ids.shape
        if position_ids.dtype != ir.DataType.INT64 or pos_shape is None or pos_shape.rank() != 2:
            return result.fail("position_ids are not 2-D int64", position_ids)
        if pos_shape[0] != x.shape[0] or pos_shape[1] != x.shape[2]:
            return result.fail("position_ids are not (batch, seq) of x", position_ids)
        head = x.shape[3]
        caches = []
        for name, value in (("cos", cos_table), ("sin", sin_table)):
            table = constant_array(value)
            if table is None or value.dtype != x.dtype or table.ndim != 2 or table.shape[1] != head:
                return result.fail(f"the {name} table is not a constant (positions, head size) of x's type", value)
            cache = self._halves(table, head // 2)
            if cache is None:
                return result.fail(f"the two halves of the {name} table differ", value)
            caches.append(cache)
        self._caches = caches
        return result

    def rewrite(self, op, x, position_ids, **_):
        cos, sin = (op.Constant(value=ir.tensor(c)) for c in self._caches)
        return op.RotaryEmbedding(x, cos, sin, position_ids, interleaved=0)


class CastTableRotary(onnxscript_rope.RotaryEmbedding23Fusion):
    """onnxscript's form with the tables computed in float32 and cast to x's type: what `ephost convert`
    writes for a half-precision model (a rotary angle stays float32; host/precision.py). The fused op
    takes the casts of Cos / Sin of the float32 angles, so the tables are still rounded once."""

    def __init__(self):
        pattern.RewriteRuleClassBase.__init__(self, name="RotaryEmbedding23CastTables", remove_nodes=False)

    def pattern(self, op, x, freqs, start1, end1, start2, end2, one1, one2):
        freqs_repeated = op.Concat(freqs, freqs, axis=-1)
        cos_4d = op.Unsqueeze(op.Cast(op.Cos(freqs_repeated), _outputs=["cos"]), one1)
        sin_4d = op.Unsqueeze(op.Cast(op.Sin(freqs_repeated), _outputs=["sin"]), one2)
        rotated = onnxscript_rope._rotate_half_pattern(op, x, start1, end1, start2, end2)
        return x * cos_4d + rotated * sin_4d

    def check(self, op, x, cos, sin, **kwargs) -> pattern.MatchResult:
        result = super().check(op, x, **kwargs)
        if result and not (x.dtype == cos.dtype == sin.dtype):
            return result.fail("the casts do not give x's type", cos)
        return result

    def rewrite(self, op, x, freqs, **_):
        to = x.dtype.value
        return op.RotaryEmbedding(x, op.Cast(op.Cos(freqs), to=to), op.Cast(op.Sin(freqs), to=to),
                                  interleaved=0, num_heads=x.shape[1])


def _is_slice(node: ir.Node, start: int, end_ok) -> bool:
    """A Slice of the last axis of a 4-D input from `start` to an end accepted by `end_ok`, step 1."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    _, starts, ends, axes, steps = inputs[:5]
    if axes is None or not _ir_utils.is_singleton_value(axes, lambda a: a in (3, -1)):
        return False
    if steps is not None and not _ir_utils.is_singleton_value(steps, 1):
        return False
    return _ir_utils.is_singleton_value(starts, start) and _ir_utils.is_singleton_value(ends, end_ok)


def _broadcasts(shape: tuple, target: tuple) -> bool:
    """Whether `shape` broadcasts to `target` without growing it."""
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def rotary_rules() -> list:
    table_rules = [r for cls in (FoldedTableRotary, GatheredTableRotary) for r in cls.rule().commute()]
    return [onnxscript_rope.RotaryEmbedding23Fusion.rule(), CastTableRotary.rule(), *table_rules]


# Every form has rotate_half's Neg, Slice and Concat; Cos / Sin are gone once the tables are folded.
ROTARY = Family("RotaryEmbedding", rotary_rules, min_opset=23, triggers=frozenset({"Cos", "Sin", "Neg"}),
                emits=(("", "RotaryEmbedding"),), requires=frozenset({"Neg", "Slice", "Concat"}))
