"""ephost's fusion families, in the order the EXTENDED level applies them.

Order matters: QDQ groups first (their float ops must not be fused into float kernels; blocked
weight-only DQ -> MatMul into MatMulNBits, and quantize_dynamic's chains into DynamicQuantizeMatMul,
before the MatMul + Add fusions take their MatMul or Add), norms and GELU first (they turn arithmetic into ops the later rules match),
attention before MatMul + Add (its MatMuls must still be plain), the rotary fusion before the
3-D attention forms (Rotary3D moves the head split behind a RotaryEmbedding for Attention3D), FusedMatMul before its
activation and before BiasGelu (a MatMul's bias belongs to the MatMul), the residual Add
last (SkipLayerNormalization consumes whatever Add is left in front of a LayerNormalization).

A family's module is imported when the family may fire (`family(name)` after `may_fire(name, ops)`,
which reads the trigger table of host/optimizer/quick.py): a first session imports only the rule
modules, and onnxscript's fusion modules, of the fusions its model can use. `FAMILIES` imports them all.
"""

from __future__ import annotations

import importlib

from host.optimizer.quick import FAMILY_TRIGGERS
from host.optimizer.rules.base import EPHOST_DOMAIN, EPHOST_OPSET, Family

# (family name, module under host.optimizer.rules, attribute), in the order they apply.
ORDER: tuple[tuple[str, str, str], ...] = (
    ("QdqToInteger", "qdq", "QDQ"),
    ("QdqToMatMulNBits", "qdq_nbits", "QDQ_NBITS"),
    ("DynamicQuantMatMul", "qdq_dynamic", "QDQ_DYNAMIC"),
    ("ConvBatchNorm", "conv_bn", "CONV_BN"),
    ("HardSwish", "hardswish", "HARDSWISH"),
    ("LayerNormalization", "layer_norm", "LAYER_NORM"),
    ("RMSNormalization", "rms_norm", "RMS_NORM"),
    ("Gelu", "gelu", "GELU"),
    ("Attention", "attention", "ATTENTION"),
    ("RotaryEmbedding", "rotary", "ROTARY"),
    ("Attention3D", "attention", "ATTENTION_3D"),
    ("Gemm", "matmul", "GEMM"),
    ("FusedMatMul", "matmul", "FUSED_MATMUL"),
    ("BiasGelu", "gelu", "BIAS_GELU"),
    ("SkipLayerNormalization", "skip_layer_norm", "SKIP_LAYER_NORM"),
)
NAMES = tuple(name for name, _, _ in ORDER)
_WHERE = {name: (module, attr) for name, module, attr in ORDER}


def family(name: str) -> Family:
    """The family called `name`, its module imported on first use."""
    module, attr = _WHERE[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def may_fire(name: str, ops) -> bool:
    """Family.may_fire from the trigger table, without importing the family's module."""
    triggers, requires = FAMILY_TRIGGERS[name]
    return bool(triggers & ops) and requires <= ops


def __getattr__(name: str):
    if name == "FAMILIES":
        return tuple(family(n) for n in NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EPHOST_DOMAIN", "EPHOST_OPSET", "FAMILIES", "NAMES", "Family", "family", "may_fire"]
