"""Reading a node's attributes with ONNX's types and defaults: the one parser that the per-node
kernels (at construction) and the compiled plan's lowering both use."""

from __future__ import annotations

from typing import Any

import numpy as np

from plugin_cuda.semantics.errors import OpError

__all__ = ["Attributes"]


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class Attributes:
    """A node's attributes (name -> value, as the host hands them over), read by type.

    Every reader takes a default (None: the attribute is optional and None comes back when it is
    absent) and raises OpError naming the node, the attribute, what arrived and what is allowed."""

    def __init__(self, attrs: dict, op_type: str, node_name: str):
        self.values = attrs
        self.where = f"{op_type} node '{node_name}'"

    def bad(self, name: str, value: Any, allowed: str) -> OpError:
        """The error for attribute `name` holding `value` where `allowed` is expected."""
        return OpError(f"{self.where}: attribute '{name}' is {value!r}; allowed: {allowed}")

    def integer(self, name: str, default: int | None = None, allowed=None) -> int | None:
        value = self.values.get(name, default)
        if value is None:
            return None
        if not _is_int(value):
            raise self.bad(name, value, "an integer")
        value = int(value)
        if allowed is not None and value not in allowed:
            raise self.bad(name, value, " or ".join(str(v) for v in allowed))
        return value

    def flag(self, name: str, default: int = 0) -> bool:
        """A 0/1 integer attribute (transA, keepdims, allowzero, ...) as a bool."""
        return bool(self.integer(name, default, (0, 1)))

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.values.get(name, default)
        if value is None:
            return None
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise self.bad(name, value, "a number")
        return float(value)

    def string(self, name: str, default: str | None = None, allowed=None) -> str | None:
        value = self.values.get(name, default)
        if value is None:
            return None
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not isinstance(value, str):
            raise self.bad(name, value, "a string")
        if allowed is not None and value not in allowed:
            raise self.bad(name, value, ", ".join(repr(v) for v in allowed))
        return value

    def integers(self, name: str, default=None, length: int | None = None,
                 minimum: int | None = None) -> tuple[int, ...] | None:
        value = self.values.get(name, default)
        if value is None:
            return None
        if isinstance(value, np.ndarray):
            value = value.reshape(-1).tolist()
        if _is_int(value):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
            raise self.bad(name, value, "a list of integers")
        value = tuple(int(v) for v in value)
        if length is not None and len(value) != length:
            raise self.bad(name, value, f"{length} integers")
        if minimum is not None and any(v < minimum for v in value):
            raise self.bad(name, value, f"integers >= {minimum}")
        return value
