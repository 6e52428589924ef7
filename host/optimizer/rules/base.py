"""What every fusion family declares: its rules, the opset its ops need, the ops that trigger it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, _ir_utils, pattern

EPHOST_DOMAIN = "ai.ephost"
EPHOST_OPSET = 1
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


@dataclass(frozen=True)
class Family:
    """One fusion family: a rule set applied as a whole, after the families before it.

    `min_opset` is the ai.onnx opset its fused ops need (the model is converted up first);
    `triggers` are op types whose presence means the family may fire (a cheap pre-check that
    also decides whether converting the opset is worth it); `requires` are op types that must all
    be present as well (for a trigger as common as Neg). With `by_trigger`, `rules` takes the
    triggers present in the graph and builds only the rules that can match one of them: building
    a pattern costs about 0.1 ms, and a first session pays for every rule it builds.
    """

    name: str
    rules: Callable[[], list[pattern.RewriteRule]]
    min_opset: int
    triggers: frozenset[str]
    emits: tuple[tuple[str, str], ...]  # (domain, op_type) of the fused ops it creates
    prepare: Callable[[], list[pattern.RewriteRule]] | None = None  # canonicalising rules run first
    requires: frozenset[str] = frozenset()
    by_trigger: bool = False

    def may_fire(self, ops) -> bool:
        """Whether the family may fire on a graph with these op types (see triggers, requires)."""
        return bool(self.triggers & ops) and self.requires <= ops

    def rule_sets(self, ops=frozenset()) -> list[pattern.RewriteRuleSet]:
        """The compiled rule sets (prepare, then the fusions) for a graph with these op types, built once
        per process (per set of triggers present, for a family `by_trigger`)."""
        present = frozenset(self.triggers & ops) if self.by_trigger else None
        sets = _COMPILED.get((self.name, present))
        if sets is None:
            fusions = (lambda: self.rules(present)) if self.by_trigger else self.rules
            sets = [pattern.RewriteRuleSet(root_filtered(make())) for make in (self.prepare, fusions) if make]
            _COMPILED[(self.name, present)] = sets
        return sets


_COMPILED: dict[tuple[str, frozenset[str] | None], list[pattern.RewriteRuleSet]] = {}


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant data (an initializer or Constant), or None."""
    return _ir_utils.get_numpy_value(value)


def static_dims(value: ir.Value | None) -> list[int] | None:
    """The value's shape as ints when every dim is known, else None."""
    if value is None or value.shape is None:
        return None
    dims = list(value.shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def rank(value: ir.Value | None) -> int | None:
    if value is None or value.shape is None:
        return None
    return value.shape.rank()


def last_dim(value: ir.Value | None):
    """The last dim of a value (int, symbolic, or None when the rank is unknown)."""
    if value is None or value.shape is None or value.shape.rank() == 0:
        return None
    return value.shape[-1]


def has_float_type(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in FLOAT_TYPES


class RootFilteredRule(RewriteRule):
    """A RewriteRule that skips nodes whose op type differs from its pattern's output node.

    onnxscript tries every rule on every node and builds a failure message for each miss
    (tens of microseconds); checking the root op type first makes large rule sets cheap.
    """

    def __init__(self, rule: RewriteRule):
        super().__init__(rule._target_pattern, rule._replacement_pattern, rule._condition_function, rule._matcher,
                         rule._verbose, rule.name, rule.remove_nodes, rule.graph_pre_visitor, rule.graph_post_visitor,
                         rule.as_function)
        root = self._target_pattern.output_nodes[0].op_identifier() if self._target_pattern.output_nodes else None
        self._root = (_domain(root[0]), root[1]) if root is not None else None

    def try_rewrite(self, model, graph_or_function, node, **kwargs):
        if self._root is not None and (_domain(node.domain), node.op_type) != self._root:
            return None
        delta = super().try_rewrite(model, graph_or_function, node, **kwargs)
        if delta is not None and node.name:
            # Name new nodes after the node they replace ("attn.q/Add" -> "attn.q/FusedMatMul"), so
            # node_assignment() and the report stay readable; the pipeline makes names unique.
            prefix = node.name.rsplit("/", 1)[0] if "/" in node.name else node.name
            for new in delta.new_nodes:
                if not new.name:
                    new.name = f"{prefix}/{new.op_type}"
        return delta


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def root_filtered(rules) -> list[RewriteRule]:
    """The rules, each wrapped in RootFilteredRule."""
    return [RootFilteredRule(r) for r in rules]
