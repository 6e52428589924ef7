"""optimize(): the pass pipeline for each level, with a per-pass report."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
from onnxscript.optimizer import _constant_folding as constant_folding
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter.rules import common as onnxscript_rules

from host.errors import InvalidArgument
from host.optimizer import rules as families
from host.optimizer.declared import declared_casts, keep_declared_output_types
from host.optimizer.levels import GraphOptimizationLevel, as_level
from host.optimizer.opset import TARGET_OPSET, convert_opset, onnx_opset
from host.optimizer.quick import nothing_to_do
from host.optimizer.result import OptimizeResult, PassReport
from host.optimizer.rules.base import root_filtered
from host.optimizer.rules.casts import cast_rules
from host.optimizer.rules.reshape_dims import reshape_dims_rules
from host.optimizer.rules.views import view_rules
from host.optimizer.subgraphs import eliminate_identities
from host.runtime.model import initializers_back, typed_inputs
from host.runtime.warn import warn_caller

_LOCK = threading.Lock()


# Level 1: removal of what computes nothing (onnxscript's no-op rules), redundant casts and
# reshapes. Fusions (Conv+BN included) wait for level 2.
@functools.cache
def _basic_rules() -> RewriteRuleSet:
    r = onnxscript_rules
    return RewriteRuleSet(root_filtered([*cast_rules(), *view_rules(), *reshape_dims_rules(),
        r.add_0_rule, r.sub_0_rule, r.mul_by_1_rule, r.div_by_1_rule, r.dropout_inference_rule, r.dropout_zero_rule,
        r.no_op_cast_rule, r.cast_cast_rule, r.no_op_expand_rule, r.no_op_transpose_rule, r.transpose_transpose_rule,
        r.reshape_reshape_rule, r.unsqueeze_unsqueeze_rule, r.squeeze_reshape_1d_rule,
        r.cast_constant_of_shape_rule, r.cast_constant_of_shape_without_value_rule,
    ]))


def _op_key(node: ir.Node) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _histogram(model: ir.Model) -> Counter:
    # Subgraphs included: a pass that changes an If branch or a Loop body is reported too.
    return Counter(_op_key(n) for n in ir.traversal.RecursiveGraphIterator(model.graph))


class _Recorder:
    """Runs passes on one ir.Model and records a PassReport for each one that changed the graph."""

    def __init__(self, model: ir.Model, verbose: bool):
        self.model = model
        self.verbose = verbose
        self.report: list[PassReport] = []

    def run(self, name: str, fn: Callable[[ir.Model], object], note: str = "", always: bool = False) -> bool:
        """Run one pass; True when it modified the model. It is reported when it changed the op
        histogram, applied rewrites (an int > 0), or (with `always`) reported a change at all."""
        before = _histogram(self.model)
        outcome = fn(self.model)
        after = _histogram(self.model)
        count = outcome if isinstance(outcome, int) and not isinstance(outcome, bool) else 0
        if before != after or count > 0 or (always and outcome):
            entry = PassReport(name, before.total(), after.total(), dict(before - after), dict(after - before),
                               f"{note}{count}" if count else "")
            self.report.append(entry)
            if self.verbose:
                print(f"[optimizer] {entry}")
        return before != after or bool(outcome)


# onnxscript never folds ConstantOfShape (to keep models small); the shape subgraphs exporters write
# (Where(Equal(shape, -1), ConstantOfShape(...), shape) -> Expand) need small ones folded.
SMALL_CONSTANT_OF_SHAPE = 4096


def _makes_strings(node: ir.Node) -> bool:
    if node.op_type in ("Cast", "CastLike") and node.domain in ("", "ai.onnx"):
        to = node.attributes.get_int("to", None)
        if to == ir.DataType.STRING or (node.op_type == "CastLike" and len(node.inputs) > 1
                                        and node.inputs[1] is not None
                                        and node.inputs[1].dtype == ir.DataType.STRING):
            return True
    return any(out.dtype == ir.DataType.STRING for out in node.outputs)


def _should_fold(node: ir.Node) -> bool | None:
    if _makes_strings(node):
        # onnx's reference kernels return NumPy text arrays ('<U21'), which onnx-ir cannot serialize
        # (the whole optimization then failed): string results stay computed at run time.
        return False
    if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx"):
        return None  # onnxscript's own rules
    shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
    if shape is None:
        return False
    return int(np.prod(shape.numpy())) <= SMALL_CONSTANT_OF_SHAPE


def _gather_elements(data: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray | None:
    """ONNX GatherElements in NumPy; None for inputs the op refuses (the run reports those)."""
    if data.ndim != indices.ndim or data.ndim == 0 or not -data.ndim <= axis < data.ndim:
        return None
    axis %= data.ndim
    if any(i > d for a, (i, d) in enumerate(zip(indices.shape, data.shape)) if a != axis):
        return None
    size = data.shape[axis]
    if indices.size and (indices.min() < -size or indices.max() >= size):
        return None
    window = tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape))
    return np.take_along_axis(data[window], np.where(indices < 0, indices + size, indices), axis)


def _fold_gather_elements(model: ir.Model) -> bool:
    """GatherElements of two constants, computed here. onnxscript's folding evaluates it with onnx's
    reference kernel, which fails when the indices are shorter than the data along the axis
    ("cannot reshape array of size 1 into shape (1,16)": BERT's token-type ids, sliced by position
    ids, in the dynamo export), so the node and the Gather after it used to stay in the model."""
    graph = model.graph
    changed = False
    for node in list(graph):
        if node.op_type != "GatherElements" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        consts = [None if v is None else ir.convenience.get_const_tensor(v) for v in node.inputs]
        out = node.outputs[0]
        if None in consts or out in graph.outputs:
            continue
        axis = node.attributes.get_int("axis", 0)
        value = _gather_elements(consts[0].numpy(), consts[1].numpy(), axis)
        if value is None or value.size > constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT:
            continue
        folded = ir.Value(name=f"{out.name}_folded", shape=ir.Shape(value.shape), type=out.type,
                          const_value=ir.tensor(value))
        graph.register_initializer(folded)
        ir.convenience.replace_all_uses_with(out, folded)
        graph.remove(node, safe=True)
        changed = True
    return changed


def _fold(model: ir.Model) -> bool:
    result = constant_folding.FoldConstantsPass(
        shape_inference=True, input_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT, should_fold=_should_fold)(model)
    return result.modified


def _apply(rules: RewriteRuleSet) -> Callable[[ir.Model], int]:
    def run(model: ir.Model) -> int:
        return rules.apply_to_model(model)

    return run


def _dead_code(model: ir.Model) -> bool:
    modified = False
    for p in (ir_passes.RemoveUnusedNodesPass(), ir_passes.RemoveUnusedFunctionsPass(),
              ir_passes.RemoveUnusedOpsetsPass()):
        modified |= p(model).modified
    return modified


def _basic(rec: _Recorder) -> None:
    model = rec.model
    if model.functions:
        rec.run("inline functions", lambda m: ir_passes.InlinePass()(m).modified)
    rules = _basic_rules()
    for _ in range(2):  # a second round folds what the rewrites exposed
        changed = rec.run("GatherElements of constants", _fold_gather_elements)
        changed |= rec.run("constant folding", _fold)
        changed |= rec.run("redundant nodes", _apply(rules), note="rewrites: ")
        changed |= rec.run("identity elimination", eliminate_identities)
        changed |= rec.run("dead nodes", _dead_code)
        if not changed:
            break
    rec.run("common subexpressions", lambda m: ir_passes.CommonSubexpressionEliminationPass()(m).modified)
    rec.run("dead nodes", _dead_code)


def _present(model: ir.Model) -> set[str]:
    return {n.op_type for n in model.graph}


def _needed_opset(model: ir.Model) -> int:
    """The highest opset a family that may fire here needs (0 when none needs more than the model has)."""
    ops = _present(model)
    return max((families.family(n).min_opset for n in families.NAMES if families.may_fire(n, ops)), default=0)


def _extended(rec: _Recorder) -> None:
    model = rec.model
    start = onnx_opset(model)
    if _needed_opset(model) > start:
        ok = rec.run(f"opset conversion {start} -> {TARGET_OPSET}", lambda m: convert_opset(m, TARGET_OPSET),
                     always=True)
        if not ok and rec.verbose:
            print(f"[optimizer] opset conversion {start} -> {TARGET_OPSET} failed; fusions needing a newer opset "
                  "are skipped")
        if ok:
            _fold(model)  # the converter writes axes and similar as Constant nodes: fold them to values
    # Patterns name attributes such as keepdims=1; exporters and the converter often leave them at
    # their defaults (absent), which onnxscript's matcher does not treat as equal.
    ir_passes.AddDefaultAttributesPass()(model)
    opset = onnx_opset(model)
    for name in families.NAMES:
        if not families.may_fire(name, _present(model)):
            continue  # its module is not even imported
        family = families.family(name)
        if family.min_opset > opset:
            continue
        # The rules apply inside If / Loop bodies too: the ops there count for the rules built.
        *prepare, fusions = family.rule_sets(frozenset(_histogram(model)))
        for rules in prepare:
            _apply(rules)(model)
        rec.run(f"fuse {family.name}", _apply(fusions), note="fused: ")
    rec.run("dead nodes", _dead_code)


def unique_node_names(graph: ir.Graph) -> None:
    """Give every node a name, unique in the graph (the session and expand_unclaimed go by name)."""
    seen: set[str] = set()
    for node in graph:
        base = node.name or node.op_type
        name, k = base, 1
        while name in seen:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        seen.add(name)


def _finish(model: ir.Model) -> None:
    for p in (ir_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
              ir_passes.DeduplicateInitializersPass(), ir_passes.OutputFixPass(), ir_passes.NameFixPass()):
        p(model)
    unique_node_names(model.graph)


@contextlib.contextmanager
def _quiet_onnxscript():
    """onnxscript logs a warning for every node its folding cannot evaluate (and then leaves it
    unfolded, which is right); those are not the user's concern, so they are kept below ERROR."""
    # A filter, not setLevel: setLevel clears every logger's cache (milliseconds per call).
    loggers = [logging.getLogger(n) for n in ("onnxscript.optimizer._constant_folding",
                                               "onnxscript.version_converter")]
    for lg in loggers:
        lg.addFilter(_below_error)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_below_error)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _with_fresh_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with the intermediate shapes re-inferred from the declared input shapes.

    Exporters leave value_info from tracing with symbolic dims ('unk__1') even where the inputs
    are static; onnxscript keeps those, and the fusions that compare dims then miss. ONNX shape
    inference with data propagation (what the session's loader runs) resolves them.
    """
    # On a view without the large weights (typed inputs instead): inference never reads them, and
    # would serialise them (seconds for a BERT-sized model); they are copied back once at the end.
    light = typed_inputs(model)
    if light is model:  # no large weights: a plain copy
        light = onnx.ModelProto()
        light.CopyFrom(model)
    # Kept: dims that are expressions over the inputs' symbols (the dynamo exporter's '2*s0', the
    # session's Range lengths): inference cannot find them again, and shape arithmetic needs them.
    kept = [vi for vi in light.graph.value_info if _symbolic_over_inputs(vi, model)]
    del light.graph.value_info[:]
    light.graph.value_info.extend(kept)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help here; the loader reports real errors
        inferred = light
    return initializers_back(inferred, model)


def _symbolic_over_inputs(vi: onnx.ValueInfoProto, model: onnx.ModelProto) -> bool:
    """A value_info entry whose every dim is an int or an expression over the graph inputs' symbols,
    one at least symbolic or the inputs' shapes symbolic (host/runtime/dims.py)."""
    from host.runtime import dims

    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return False
    names = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim
             if d.dim_param.isidentifier()}
    params = [d.dim_param for d in t.shape.dim if not d.HasField("dim_value")]
    # In a model with symbolic inputs, all-int entries count too: host/runtime/symbolic_shapes.py
    # writes them where inference could not find them (a rotary Expand to [1, 8, 1]).
    return bool(params or names) and all(dims.compile_dim(p, names) is not None for p in params)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def optimize(model: onnx.ModelProto, level=GraphOptimizationLevel.ORT_ENABLE_ALL, *,
             verbose: bool = False) -> OptimizeResult:
    """Optimize `model` at `level` (a GraphOptimizationLevel, its int value or name).

    DISABLE_ALL returns the model untouched. BASIC folds constants (shape subgraphs included,
    input shapes as declared), removes Identity / Dropout / no-op arithmetic, redundant Cast and
    Reshape, dead nodes and common subexpressions. EXTENDED (and ALL) add the fusions of
    host.optimizer.rules, converting the model to opset 23 first when a fusion needs it.
    """
    level = as_level(level)
    if not isinstance(model, onnx.ModelProto):
        raise InvalidArgument(f"optimize() takes an onnx.ModelProto; got {type(model).__name__}")
    count = len(model.graph.node)
    if level == GraphOptimizationLevel.ORT_DISABLE_ALL or nothing_to_do(model):
        return OptimizeResult(model, level, [], count, count)
    try:
        ir_model = ir.serde.deserialize_model(_with_fresh_shapes(declared_casts(model)))
    except Exception as exc:  # noqa: BLE001 - onnx-ir cannot represent everything ONNX can
        # (map types: skl2onnx's ZipMap outputs); the model still runs, just unoptimized.
        warn_caller(f"the optimizer cannot read this model ({_first_line(exc)}); "
                    "it runs unoptimized")
        return OptimizeResult(model, level, [], count, count, cacheable=False)
    rec = _Recorder(ir_model, verbose)
    # Rule objects are shared and keep match state between check() and rewrite() (onnxscript's
    # rules do too), so sessions created on several threads optimize one at a time.
    with _LOCK, _quiet_onnxscript():
        _basic(rec)
        if level >= GraphOptimizationLevel.ORT_ENABLE_EXTENDED:
            _extended(rec)
        _finish(ir_model)
    out = keep_declared_output_types(model, ir.serde.serialize_model(ir_model))
    result = OptimizeResult(out, level, rec.report, count, len(out.graph.node))
    if verbose:
        print(result.summary())
    return result
