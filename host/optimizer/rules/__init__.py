"""ephost's fusion families, in the order the EXTENDED level applies them.

Order matters: QDQ groups first (their float ops must not be fused into float kernels; blocked
weight-only DQ -> MatMul into MatMulNBits, and quantize_dynamic's chains into DynamicQuantizeMatMul,
before the MatMul + Add fusions take their MatMul or Add), norms and GELU first (they turn arithmetic into ops the later rules match),
attention before MatMul + Add (its MatMuls must still be plain), the rotary fusion before the
3-D attention forms (Rotary3D moves the head split behind a RotaryEmbedding for Attention3D), FusedMatMul before its
activation and before BiasGelu (a MatMul's bias belongs to the MatMul), the residual Add
last (SkipLayerNormalization consumes whatever Add is left in front of a LayerNormalization).
"""

from __future__ import annotations

from host.optimizer.rules.attention import ATTENTION, ATTENTION_3D
from host.optimizer.rules.base import EPHOST_DOMAIN, EPHOST_OPSET, Family
from host.optimizer.rules.conv_bn import CONV_BN
from host.optimizer.rules.gelu import BIAS_GELU, GELU
from host.optimizer.rules.hardswish import HARDSWISH
from host.optimizer.rules.layer_norm import LAYER_NORM
from host.optimizer.rules.matmul import FUSED_MATMUL, GEMM
from host.optimizer.rules.qdq import QDQ
from host.optimizer.rules.qdq_dynamic import QDQ_DYNAMIC
from host.optimizer.rules.qdq_nbits import QDQ_NBITS
from host.optimizer.rules.rms_norm import RMS_NORM
from host.optimizer.rules.rotary import ROTARY
from host.optimizer.rules.skip_layer_norm import SKIP_LAYER_NORM

FAMILIES: tuple[Family, ...] = (
    QDQ, QDQ_NBITS, QDQ_DYNAMIC, CONV_BN, HARDSWISH, LAYER_NORM, RMS_NORM, GELU, ATTENTION, ROTARY, ATTENTION_3D, GEMM, FUSED_MATMUL, BIAS_GELU,
    SKIP_LAYER_NORM,
)

__all__ = ["EPHOST_DOMAIN", "EPHOST_OPSET", "FAMILIES", "Family"]
