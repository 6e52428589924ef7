"""What the optimizer returns: the optimized model and a report of each pass.

Kept apart from host.optimizer.pipeline (which imports onnxscript and onnx-ir, about 0.3 s) so that a
result read back from the optimized-model cache (host/optimizer/cache.py) costs no such import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from host.optimizer.levels import GraphOptimizationLevel


@dataclass
class PassReport:
    """What one pass changed: node counts and the op types it removed and added."""

    name: str
    nodes_before: int
    nodes_after: int
    removed: dict[str, int] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def __str__(self) -> str:
        parts = [f"{self.name}: {self.nodes_before} -> {self.nodes_after} nodes"]
        if self.removed:
            parts.append("removed " + ", ".join(f"{op} x{n}" for op, n in sorted(self.removed.items())))
        if self.added:
            parts.append("added " + ", ".join(f"{op} x{n}" for op, n in sorted(self.added.items())))
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


@dataclass
class OptimizeResult:
    """The optimized model and one PassReport per pass that changed something."""

    model: onnx.ModelProto
    level: GraphOptimizationLevel
    report: list[PassReport]
    nodes_before: int
    nodes_after: int
    # The opsets the model itself declares (domain -> version; '' for ai.onnx): the optimizer may
    # convert the model to a newer opset, but messages name the user's own.
    source_opsets: dict[str, int] = field(default_factory=dict)
    # False when the result is not the optimizer's answer for this model but a way round a failure
    # (a model onnx-ir cannot read runs unoptimized, with a warning): such a result is not cached, so
    # every session says so again.
    cacheable: bool = True

    def summary(self) -> str:
        lines = [f"optimizer ({self.level.name}): {self.nodes_before} -> {self.nodes_after} nodes"]
        lines += [f"  {r}" for r in self.report]
        return "\n".join(lines)
