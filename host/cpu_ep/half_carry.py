"""Half-precision values that stay float32 between CPU EP nodes.

A float16 or bfloat16 node of the CPU EP computes in float32 (half.py). Stored as its declared type,
each result would be narrowed and widened again by the next node: two conversions per value, the
larger part of a small half model's time. So when every reader of a half value is a CPU EP node
that widens its inputs anyway (or moves elements as they are), and the value is not a graph output,
the value stays as the producer computed it, float32; it is rounded to its declared type only where
something else reads it: a graph output, a plugin EP's kernel, a control-flow body, a sequence.

This is what onnxruntime's CPU EP does for float16 (it runs those ops in float32 through Casts it
inserts and drops the float32 -> float16 -> float32 pairs between them): inner values keep float32
precision, the graph's outputs have their declared types. `EPHOST_HALF_ROUNDING=node` in the
environment turns it off (every value rounded to its declared type, as the graph's types say).
"""

from __future__ import annotations

import os

# Readers that take a float32 value where half is declared and give what they would give on the half
# value, widened: element movers whose result is stored as declared, or widened by its own readers.
# (BitCast reads bits; control flow, sequences and optionals hand values to bodies and lists.)
_MOVERS = frozenset(("", op) for op in (
    "Cast", "CastLike", "Compress", "Concat", "DepthToSpace", "Expand", "Flatten", "Gather", "GatherElements",
    "GatherND", "Identity", "Reshape", "ReverseSequence", "Scatter", "ScatterElements", "ScatterND", "Shape",
    "Size", "Slice", "SpaceToDepth", "Split", "Squeeze", "Tile", "Transpose", "Unsqueeze",
))


def enabled() -> bool:
    return os.environ.get("EPHOST_HALF_ROUNDING", "") != "node"


def _domain(kernel) -> str:
    d = kernel.node.domain
    return "" if d in ("", "ai.onnx") else d


def _reads_float32(plan_node) -> bool:
    """Whether this reader may get float32 where half is declared."""
    if plan_node.ep is not None:  # a plugin EP's kernel or compiled partition: the declared type
        return False
    kernel = plan_node.kernel
    state = getattr(kernel, "half", None)
    if state is None or getattr(kernel, "takes_device_values", False) or kernel.object_outputs:
        return False
    return state.widens or (_domain(kernel), kernel.op_type) in _MOVERS


def carry_float32(nodes, keep: set[int]) -> int:
    """Marks, on the CPU EP kernels of plan `nodes`, the half outputs that stay float32 (see the module
    docstring); `keep`: value ids read from outside the plan (its outputs). Returns how many."""
    if not enabled():
        return 0
    readers: dict[int, list] = {}
    for pn in nodes:
        for v in pn.inputs:
            if v >= 0:
                readers.setdefault(v, []).append(pn)
    carried = 0
    for pn in nodes:
        state = getattr(pn.kernel, "half", None) if pn.ep is None else None
        if state is None or pn.kernel.object_outputs:
            continue
        for j in state.half_outputs():
            v = pn.outputs[j] if j < len(pn.outputs) else -1
            if v < 0 or v in keep or not readers.get(v):
                continue
            if all(_reads_float32(r) for r in readers[v]):
                state.carry(j)
                carried += 1
    return carried


__all__ = ["carry_float32", "enabled"]
