"""The built-in CPU execution provider's kernels (NumPy).

Importing the package imports every op module, which fills the registry table.
"""

from __future__ import annotations

from collections.abc import Mapping

from host.cpu_ep import (  # noqa: F401  (registration)
    half,
    ops_attention,
    ops_bitwise,
    ops_control,
    ops_conv_transpose,
    ops_deform_conv,
    ops_detection,
    ops_elementwise,
    ops_geometry,
    ops_gridsample,
    ops_index,
    ops_layout,
    ops_linear_attention,
    ops_loss,
    ops_math,
    ops_ml_linear,
    ops_ml_preprocess,
    ops_ml_trees,
    ops_nn,
    ops_norm,
    ops_pool,
    ops_quant,
    ops_quant_ms,
    ops_quant_nbits,
    ops_recent,
    ops_reduce,
    ops_resize,
    ops_rnn,
    ops_sequence,
    ops_shape,
    ops_signal,
    ops_standardize,
    ops_string,
    ops_transformer,
    ops_unary,
    ops_unique,
)
from host.cpu_ep.base import EP_NAME, OpKernel
from host.cpu_ep.registry import CPU_KERNELS, lookup, register, supported_ops
from host.errors import ModelError
from host.runtime.node import NodeInfo


def create_kernel(node: NodeInfo, values: Mapping[str, object] | None = None) -> OpKernel:
    """Builds the kernel of `node`; ModelError when no kernel serves its op at its opset. `values`
    (value name -> ValueMeta) gives the declared types: a node reading or writing float16 or bfloat16
    gets a kernel that computes in float32 and stores what the graph declares (half.py)."""
    cls = lookup(node.domain, node.op_type, node.opset)
    if cls is None:
        domain = node.domain or "ai.onnx"
        raise ModelError(
            f"{EP_NAME} has no kernel for op '{node.op_type}' (domain '{domain}', opset {node.opset}) "
            f"used by node '{node.name}'"
        )
    kernel = cls(node)
    if values is not None:
        half.adapt(kernel, half.declared_types(node.inputs, values), half.declared_types(node.outputs, values))
    return kernel


__all__ = ["CPU_KERNELS", "EP_NAME", "OpKernel", "create_kernel", "lookup", "register", "supported_ops"]
