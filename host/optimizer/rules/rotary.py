"""The rotary-embedding pattern (HF rotate_half) -> RotaryEmbedding (opset 23), onnxscript's rule."""

from __future__ import annotations

from onnxscript.rewriter.rules.fusion import _rotary_embedding as onnxscript_rope

from host.optimizer.rules.base import Family


def rotary_rules() -> list:
    return [onnxscript_rope.RotaryEmbedding23Fusion.rule()]


ROTARY = Family("RotaryEmbedding", rotary_rules, min_opset=23, triggers=frozenset({"Cos", "Sin"}),
                emits=(("", "RotaryEmbedding"),))
