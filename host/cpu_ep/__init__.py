"""The built-in CPU execution provider's kernels (NumPy).

Importing the package imports every op module, which fills the registry table.
"""

from __future__ import annotations

from host.cpu_ep import (  # noqa: F401  (registration)
    ops_bitwise,
    ops_elementwise,
    ops_index,
    ops_layout,
    ops_loss,
    ops_math,
    ops_nn,
    ops_norm,
    ops_reduce,
    ops_resize,
    ops_shape,
    ops_signal,
    ops_transformer,
    ops_unary,
)
from host.cpu_ep.base import EP_NAME, OpKernel
from host.cpu_ep.registry import CPU_KERNELS, lookup, register, supported_ops
from host.errors import ModelError
from host.runtime.node import NodeInfo


def create_kernel(node: NodeInfo) -> OpKernel:
    """Builds the kernel of `node`; ModelError when no kernel serves its op at its opset."""
    cls = lookup(node.domain, node.op_type, node.opset)
    if cls is None:
        domain = node.domain or "ai.onnx"
        raise ModelError(
            f"{EP_NAME} has no kernel for op '{node.op_type}' (domain '{domain}', opset {node.opset}) "
            f"used by node '{node.name}'"
        )
    return cls(node)


__all__ = ["CPU_KERNELS", "EP_NAME", "OpKernel", "create_kernel", "lookup", "register", "supported_ops"]
