"""Nodes that only re-view their input -> Reshape (BASIC level), so that reshape chains collapse.

- Gather(data, indices, axis) whose constant indices list 0, 1, ..., n-1 over an axis of static
  length n picks every slice in order: it is data reshaped to data.shape[:axis] + indices.shape +
  data.shape[axis+1:]. The TorchScript exporter writes one for `mask[:, None, None, :]` on Llama's
  attention mask (Flatten -> Gather -> Reshape).
- Flatten(x, axis) of a static shape is Reshape(x, [prod(shape[:axis]), prod(shape[axis:])]).

onnxscript's ReshapeReshape then joins the Reshapes that follow each other.
"""

from __future__ import annotations

import math

import numpy as np
from onnxscript.rewriter import pattern

from host.optimizer.rules.base import constant_array, static_dims


class IdentityGather(pattern.RewriteRuleClassBase):
    """Gather(data, arange(n) in any shape, axis) over a static axis of length n -> Reshape."""

    def pattern(self, op, data, indices):
        return op.Gather(data, indices, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, data, indices, y, **_):
        result = pattern.MatchResult()
        dims = static_dims(data)
        index = constant_array(indices)
        if dims is None or index is None or index.dtype.kind not in "iu":
            return result.fail("data's shape is not static or the indices are not constant integers", data)
        axis = y.producer().attributes.get_int("axis", 0)
        axis = axis + len(dims) if axis < 0 else axis
        if not 0 <= axis < len(dims):
            return result.fail(f"axis {axis} is out of range for rank {len(dims)}", data)
        if index.size != dims[axis] or not np.array_equal(index.ravel(), np.arange(dims[axis])):
            return result.fail("the indices are not 0, 1, ..., n-1 over the whole axis", indices)
        self._shape = [*dims[:axis], *index.shape, *dims[axis + 1:]]
        return result

    def rewrite(self, op, data, **_):
        return op.Reshape(data, op.Constant(value_ints=self._shape))


class StaticFlatten(pattern.RewriteRuleClassBase):
    """Flatten(x, axis) of a statically shaped x -> Reshape."""

    def pattern(self, op, x):
        return op.Flatten(x, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, y, **_):
        result = pattern.MatchResult()
        dims = static_dims(x)
        if dims is None:
            return result.fail("x's shape is not static", x)
        axis = y.producer().attributes.get_int("axis", 1)
        axis = axis + len(dims) if axis < 0 else axis
        if not 0 <= axis <= len(dims):
            return result.fail(f"axis {axis} is out of range for rank {len(dims)}", x)
        self._shape = [math.prod(dims[:axis]), math.prod(dims[axis:])]
        return result

    def rewrite(self, op, x, **_):
        return op.Reshape(x, op.Constant(value_ints=self._shape))


def view_rules() -> list:
    return [IdentityGather.rule(), StaticFlatten.rule()]


__all__ = ["IdentityGather", "StaticFlatten", "view_rules"]
