"""The error of an ONNX rule broken by a node (its attributes or its input shapes)."""

from __future__ import annotations


class OpError(ValueError):
    """A node's attributes or input shapes break the op's ONNX rules; the message names the node,
    what arrived and what is allowed. The per-node kernels raise it as is (a ValueError, which the
    plugin reports as a failed node); the compiled plan's lowering turns it into a PlanError."""
