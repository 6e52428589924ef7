"""HardSigmoid / HardSwish decompositions (Clip(x + 3, 0, 6) / 6, times x) -> HardSigmoid / HardSwish."""

from __future__ import annotations

from onnxscript.rewriter.rules import common as onnxscript_common

from host.optimizer.rules.base import Family


def hardswish_rules() -> list:
    return list(onnxscript_common.fuse_hardswish_rules().rules)


HARDSWISH = Family("HardSwish", hardswish_rules, min_opset=14, triggers=frozenset({"Clip", "HardSigmoid"}),
                   emits=(("", "HardSwish"), ("", "HardSigmoid")))
