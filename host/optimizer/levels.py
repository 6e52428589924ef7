"""Graph optimization levels, with onnxruntime's names and values."""

from __future__ import annotations

import enum

from host.errors import InvalidArgument


class OrtIntEnum(enum.IntEnum):
    """An IntEnum that prints as onnxruntime's enums do: str() and format() give 'Type.NAME' (Python
    3.11's IntEnum gives the bare number), repr() '<Type.NAME: value>'; it compares as its int."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class GraphOptimizationLevel(OrtIntEnum):
    """How much the optimizer does before partitioning (onnxruntime's values)."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_ALL = 99


# Short names for the command line and config strings.
LEVEL_NAMES = {
    "disable": GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def as_level(value) -> GraphOptimizationLevel:
    """A GraphOptimizationLevel from the enum, its int value, or a name ('basic', 'ORT_ENABLE_BASIC')."""
    if isinstance(value, GraphOptimizationLevel):
        return value
    allowed = ", ".join(f"{m.name}={m.value}" for m in GraphOptimizationLevel)
    if isinstance(value, bool):
        raise InvalidArgument(f"graph_optimization_level must be a GraphOptimizationLevel or int; got {value!r} "
                              f"(allowed: {allowed})")
    if isinstance(value, int):
        try:
            return GraphOptimizationLevel(value)
        except ValueError:
            raise InvalidArgument(f"graph_optimization_level {value} is not a level; allowed: {allowed}") from None
    if isinstance(value, str):
        key = value.strip()
        if key.lower() in LEVEL_NAMES:
            return LEVEL_NAMES[key.lower()]
        if key in GraphOptimizationLevel.__members__:
            return GraphOptimizationLevel[key]
        raise InvalidArgument(f"graph_optimization_level {value!r} is not a level name; allowed: "
                              f"{', '.join(LEVEL_NAMES)} or {allowed}")
    raise InvalidArgument(f"graph_optimization_level must be a GraphOptimizationLevel, int or name; "
                          f"got {type(value).__name__} (allowed: {allowed})")
