"""BatchNormalization folded into the Conv / ConvTranspose / Gemm before it (onnxscript's rules)."""

from __future__ import annotations

from onnxscript.rewriter.rules import common as onnxscript_common

from host.optimizer.rules.base import Family


def conv_bn_rules() -> list:
    return [onnxscript_common.fuse_batchnorm_into_conv_rule, onnxscript_common.fuse_batchnorm_into_conv_transpose_rule,
            onnxscript_common.fuse_batchnorm_into_gemm_rule]


CONV_BN = Family("ConvBatchNorm", conv_bn_rules, min_opset=7, triggers=frozenset({"BatchNormalization"}), emits=())
