"""A Scaler and the LinearClassifier that alone reads it, run as one step (fusion.fuse's hook): skl2onnx's
StandardScaler + LogisticRegression pipeline (and any scaler before a linear classifier).

At one row such a pipeline is a few hundred multiply-adds; its time was the run loop's step per node and
the NumPy calls around each kernel. The join makes it one compiled call (native ep_ml_linear through
LinearClassifier.compiled_run: the Scaler's (x - offset) * scale, the GEMM, the binary label and score
columns), the same float32 operations in the same order as the two kernels, so the results are theirs bit
for bit. Input that call does not take (another dtype or rank, a width the coefficients do not expect, no
library) runs the two kernels in turn, which give their own results and errors.
"""

from __future__ import annotations

from host.cpu_ep import native
from host.cpu_ep.fusion import _call, _fused, _op, _private, _wrapped

ML = "ai.onnx.ml"


def _scaler_args(scaler, k: int) -> tuple | None:
    """ep_ml_linear's (offset, step, scale, step) for the Scaler's constants over k features: a step is
    1 for one value per feature, 0 for one value for all; None for other sizes (NumPy broadcasting decides
    those, or raises: the kernels run)."""
    offset, scale = scaler.offset, scaler.scale
    if offset.size not in (1, k) or scale.size not in (1, k) or offset.dtype != native.F32 or scale.dtype != native.F32:
        return None
    return (native.ptr(offset), int(offset.size == k), native.ptr(scale), int(scale.size == k))


class ScalerLinear:
    """The kernel of a joined Scaler -> LinearClassifier (a FusedNode's): `_run(values, (x,))` returns the
    classifier's (labels, scores)."""

    def __init__(self, scaler, linear, scaler_args: tuple, arg_ids: tuple[int, ...]):
        self.scaler, self.linear = scaler, linear
        self.scaler_args = scaler_args  # pointers into the Scaler kernel's own arrays, which it keeps
        self.arg_ids = arg_ids  # the Scaler's input: the run loop gathers it
        self.name, self.op_type = scaler.name, scaler.op_type

    def failure(self, exc):
        return self.linear.failure(exc)

    def _run(self, values, args):
        x = args[0]
        out = self.linear.compiled_run(x, self.scaler_args)
        if out is not None:
            return out
        return _call(self.linear, *_call(self.scaler, x))


def match_scaler_linear(nodes, i: int, consumers, keep, constants):
    """(FusedNode, 2) for a Scaler at nodes[i] whose output only the LinearClassifier after it reads, or
    None."""
    if i + 1 >= len(nodes):
        return None
    first, second = nodes[i], nodes[i + 1]
    if _op(first) != (ML, "Scaler") or _op(second) != (ML, "LinearClassifier") or _wrapped(first) or _wrapped(second):
        return None
    if len(first.inputs) != 1 or first.inputs[0] < 0 or len(first.outputs) != 1:
        return None
    y = first.outputs[0]
    if second.inputs != (y,) or not _private(y, consumers, keep):
        return None
    linear = second.kernel
    if linear.compiled is None:
        return None
    args = _scaler_args(first.kernel, linear.compiled.k)
    if args is None:
        return None
    kernel = ScalerLinear(first.kernel, linear, args, first.inputs)
    return _fused(kernel, [first, second], first.inputs, tuple(second.outputs)), 2


__all__ = ["ScalerLinear", "match_scaler_linear"]
