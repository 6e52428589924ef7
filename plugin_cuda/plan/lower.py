"""Lowering: a partition's ONNX nodes become a small program of plan ops with static shapes.

Pure Python and NumPy (no CuPy): tested without a GPU.

The program and its ops are described in program.py; the rules, registered per (domain, op_type)
in one table (lowering.LOWERINGS), live in lower_math, lower_rows, lower_layout and lower_conv:
the import list below is the whole registration.
"""

from __future__ import annotations

import numpy as np

# The rule modules register their lowerings when imported: this list is the whole registration.
from plugin_cuda.plan import lower_conv, lower_layout, lower_math, lower_rows  # noqa: F401
from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.lowering import LOWERINGS, LowerCtx, domain_of, mask_only_expand, run_rule
from plugin_cuda.plan.program import F32, PLAN_DTYPES, Program, Value, plan_dtype
from plugin_cuda.plan.symint import dim, symbols_of

FLOAT32 = 1  # ONNX TensorProto.FLOAT
# The element types a plan runs (float32, float16, bfloat16: program.PLAN_DTYPES); 0 / None: unknown.
RUN_TYPES = tuple(PLAN_DTYPES)
TYPES_TEXT = "plans run float32, float16 and bfloat16"
MAX_OPSET = 23
# The size a node's symbolic dims take when its lowering rule is checked at claim time (a plan is
# then built per input-shape signature): small and odd, so no rule passes only on a round size.
PROBE_DIM = 7

# ---------------------------------------------------------------------------------------------
# Entry points


HOST_INPUTS = {("", "Reshape"): (1,), ("", "Squeeze"): (1,), ("", "Unsqueeze"): (1,), ("", "Clip"): (1, 2),
               ("", "Expand"): (1,), ("", "Split"): (1,), ("", "ReduceMean"): (1,)}

# Host inputs a symbolic plan takes per input-shape signature when the host computes them (its shape
# program; ValueSpec.host_computed): the value reaches Compute in host memory (abi/host_inputs.py) and
# signatures.specialize makes it a constant of that signature's plan. A dynamo export's Reshapes
# (allowzero=1, targets such as [batch, seq, heads, -1] or [batch, seq, hidden]) need this.
SIGNATURE_INPUTS = {("", "Reshape"): (1,)}


def signature_input(graph, node, pos: int) -> bool:
    """Whether input `pos` of `node` is a host-computed value a symbolic plan takes per signature."""
    vid = node.inputs[pos]
    return (pos in SIGNATURE_INPUTS.get((domain_of(node), node.op_type), ()) and vid >= 0
            and graph.values[vid].constant is None and bool(getattr(graph.values[vid], "host_computed", False)))


def _elem_type(v) -> int | None:
    t = getattr(v, "elem_type", None)
    return getattr(v, "dtype", None) if t is None else t


def unsupported_reason(graph, node, need_static: bool = True, probe: int | None = None) -> str:
    """'' when a plan can run `node` (op, opset, float32 / float16 / bfloat16, static shapes); otherwise
    the reason.

    need_static: also ask for static shapes of every input (the planner infers the rest itself).
    probe: accept symbolic dims (-1) too, checking the lowering rule with each of them set to
    `probe` (the partition is then planned per input-shape signature)."""
    key = (domain_of(node), node.op_type)
    if key not in LOWERINGS:
        return f"no plan lowering for {key[0] or 'ai.onnx'}::{node.op_type}"
    if node.opset > MAX_OPSET:
        return f"opset {node.opset} is newer than {MAX_OPSET}"
    host = HOST_INPUTS.get(key, ())
    for pos, vid in enumerate(node.inputs):
        if vid < 0:
            continue
        v = graph.values[vid]
        if pos in host:
            if probe is not None and signature_input(graph, node, pos):
                continue  # planned per signature (host memory, known at plan build)
            if v.constant is None and not mask_only_expand(graph, node):
                return f"input {pos} must be a constant" + (" or a host-computed shape" if key in SIGNATURE_INPUTS
                                                               and probe is not None else "")
            continue
        if _elem_type(v) not in RUN_TYPES + (0, None) or need_static and _elem_type(v) not in RUN_TYPES:
            return f"input {pos} has element type {_elem_type(v)}; {TYPES_TEXT}"
        if need_static and v.shape is None:
            return f"input {pos} has no static shape"
        if need_static and probe is None and any(d is None or d < 0 for d in v.shape):
            return f"input {pos} has no static shape"
    for vid in node.outputs:
        if vid >= 0 and _elem_type(graph.values[vid]) not in RUN_TYPES + (0, None):
            return f"an output has element type {_elem_type(graph.values[vid])}; {TYPES_TEXT}"
    return _lowering_error(graph, node, probe) if need_static else ""


def _value(i: int, v, probe: int | None = None) -> Value:
    """The program value of graph value `v`: its shape, its constant and its plan dtype (None when
    its element type is unknown: run_rule then gives it its node's input type)."""
    const = None if v.constant is None else np.asarray(v.constant)
    if const is not None and const.dtype == np.float64:
        const = const.astype(np.float32)
    unknown = -1 if probe is None else probe
    shape = None if v.shape is None else tuple(unknown if d is None or d < 0 else dim(d) for d in v.shape)
    dtype = plan_dtype(_elem_type(v))
    if const is not None:
        shape = tuple(const.shape)
        if const.dtype in PLAN_DTYPES.values():
            dtype = const.dtype
    return Value(i, v.name, shape, const, dtype)


def _lowering_error(graph, node, probe: int | None = None) -> str:
    """'' when the node's lowering rule accepts it alone (attributes, axes, shapes), else its
    PlanError: a claimed group then never fails to compile because of one of its nodes.
    `probe`: the size symbolic input dims take for the check (outputs keep theirs unknown)."""
    values = {v: _value(v, graph.values[v]) for v in node.outputs if v >= 0}
    values.update({v: _value(v, graph.values[v], probe) for v in node.inputs if v >= 0})
    for pos, vid in enumerate(node.inputs):
        if probe is not None and vid >= 0 and signature_input(graph, node, pos):
            target = _probe_target(graph, node)
            if target is None:
                return f"input {pos} is a host-computed shape and the output's rank is unknown"
            values[vid] = Value(vid, graph.values[vid].name, target.shape, target, None)
    ctx = LowerCtx(Program(values, [], [], []), graph, set())
    try:
        run_rule(ctx, node)
    except PlanError as exc:
        return str(exc)
    return ""


def _probe_target(graph, node) -> np.ndarray | None:
    """A stand-in for a host-computed Reshape target at claim time: the output's declared dims, its
    first unknown one -1 and the others 1 (so any probe input size fits); None without a rank."""
    shape = graph.values[node.outputs[0]].shape
    if shape is None:
        return None
    dims = [int(d) if d is not None and d >= 0 else 1 for d in shape]
    unknown = [i for i, d in enumerate(shape) if d is None or d < 0]
    if unknown:
        dims[unknown[0]] = -1
    return np.array(dims, np.int64)


def _ids_by_name(graph, specs, what: str) -> list:
    index = {v.name: i for i, v in enumerate(graph.values)}
    out = []
    for s in specs:
        name = s if isinstance(s, str) else s.name
        if name not in index:
            raise PlanError(f"partition {what} {name!r} is not a value of the graph")
        out.append(index[name])
    return out


def partition_io(graph, inputs=None, outputs=None) -> tuple[list, list]:
    """Input and output value ids: given (names or ValueSpecs), from the graph's own lists, or derived."""
    if inputs is None and getattr(graph, "input_ids", None):
        inputs = [graph.values[i] for i in graph.input_ids]
    if outputs is None and getattr(graph, "output_ids", None):
        outputs = [graph.values[i] for i in graph.output_ids]
    if inputs is None:
        inputs = getattr(graph, "inputs", None) or None  # an empty list: not given, derive them
    if outputs is None:
        outputs = getattr(graph, "outputs", None) or None
    produced = {v for n in graph.nodes for v in n.outputs if v >= 0}
    consumed = {v for n in graph.nodes for v in n.inputs if v >= 0}
    if inputs is not None:
        ins = _ids_by_name(graph, inputs, "input")
    else:
        ins, seen = [], set()
        for n in graph.nodes:
            for v in n.inputs:
                if v >= 0 and v not in produced and graph.values[v].constant is None and v not in seen:
                    seen.add(v)
                    ins.append(v)
    if outputs is not None:
        outs = _ids_by_name(graph, outputs, "output")
    else:
        outs = [v for n in graph.nodes for v in n.outputs
                if v >= 0 and (v not in consumed or graph.values[v].kind == 2)]
    return ins, outs


def topo_order(graph) -> list:
    """The graph's nodes in a dependency order (the given order when it already is one)."""
    producer = {v: n.index for n in graph.nodes for v in n.outputs if v >= 0}
    by_index = {n.index: n for n in graph.nodes}
    done, order = set(), []
    for start in graph.nodes:
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node.index in done:
                continue
            if expanded:
                done.add(node.index)
                order.append(node)
                continue
            stack.append((node, True))
            for v in node.inputs:
                p = producer.get(v)
                if p is not None and p not in done and p != node.index:
                    stack.append((by_index[p], False))
    return order


def lower(graph, inputs=None, outputs=None) -> Program:
    """The partition `graph` (a GraphSpec) as a Program; PlanError names the first node it cannot run."""
    ins, outs = partition_io(graph, inputs, outputs)
    values = {i: _value(i, v) for i, v in enumerate(graph.values)}
    for vid in ins:
        shape = values[vid].shape
        if shape is None or any(d < 0 for d in shape):
            raise PlanError(f"partition input '{values[vid].name}' has shape {shape}; a compiled plan needs "
                            "static shapes")
    prog = Program(values, [], ins, outs, symbols_of(values[v].shape for v in ins))
    ctx = LowerCtx(prog, graph, set(outs))
    for node in topo_order(graph):
        reason = unsupported_reason(graph, node, need_static=False)
        if reason:
            raise PlanError(f"node '{node.name}' ({node.op_type}) cannot run in a compiled plan: {reason}")
        for vid in node.inputs:
            if vid >= 0 and values[vid].shape is None and values[vid].const is None:
                raise PlanError(f"node '{node.name}': input '{values[vid].name}' has an unknown shape")
        run_rule(ctx, node)
    for v in values.values():
        if v.dtype is None:  # never read by a step (a host input's value): planned as float32
            v.dtype = F32
    for vid in outs:
        if vid in ins:
            raise PlanError(f"partition output '{values[vid].name}' is also a partition input; nothing computes it")
    return prog

