"""`ephost ops`: which ONNX ops, at which opsets, each execution provider runs.

    ephost ops                                # the built-in CPU EP
    ephost ops --plugin build/lib/libephost_example_v6.so --ep ExampleEP
    python -m host.cli ops --markdown > docs/ops.md

How each EP is read:
- CPU EP: its kernel table (host/cpu_ep/registry.py); a kernel registered for opsets since..until
  serves the part of that range inside the host's window (MIN_OPSET..MAX_OPSET) and at or after the
  op's first ONNX version.
- Plugin EPs: the host never imports plugin code, so it asks through the ABI. For every opset of the
  window it builds one probe graph holding one node per ai.onnx op (plus the ai.ephost ops): input 0 a
  graph input, the other inputs initializers (so shape/axes inputs are constants, as exporters leave
  them after folding), each of the first type its schema allows (float32 where allowed), required
  attributes set to a placeholder; then it calls the EP's GetCapability on that graph, as session
  creation does. An op counts at an opset when the EP claims its probe node there (alone or inside a
  fused group). The probe is an approximation: an EP that claims a node only for some dtypes, shapes
  or attribute values is reported by what it does for these probes.
The ai.onnx total counts the ops ONNX (onnx.defs) defines at some opset in the window, deprecated
ones (Upsample, Scatter) left out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache

import numpy as np
import onnx
import onnx.defs
from onnx import TensorProto, helper

from host.cpu_ep import EP_NAME as CPU_EP
from host.cpu_ep import registry
from host.errors import EpError
from host.runtime.model import MAX_OPSET, MIN_OPSET, Graph, ValueMeta
from host.runtime.node import node_info

EPHOST_DOMAIN = "ai.ephost"
ONNX_DOMAIN = ""
# The ai.ephost ops (docs/optimizer.md): (name, number of inputs the probe gives).
EPHOST_OPS = {"SkipLayerNormalization": 3, "FusedMatMul": 2, "BiasGelu": 2}
_PREFERRED_TYPES = ("tensor(float)", "tensor(int64)", "tensor(bool)", "tensor(int32)", "tensor(float16)",
                    "tensor(double)", "tensor(uint8)")
_TYPE_ENUMS = {"tensor(float)": TensorProto.FLOAT, "tensor(int64)": TensorProto.INT64,
               "tensor(bool)": TensorProto.BOOL, "tensor(int32)": TensorProto.INT32,
               "tensor(float16)": TensorProto.FLOAT16, "tensor(double)": TensorProto.DOUBLE,
               "tensor(uint8)": TensorProto.UINT8}
_PLACEHOLDERS = {onnx.AttributeProto.INT: 1, onnx.AttributeProto.FLOAT: 1.0, onnx.AttributeProto.INTS: [1],
                 onnx.AttributeProto.FLOATS: [1.0], onnx.AttributeProto.STRING: ""}


@dataclass
class EpOps:
    """One EP's coverage: op name -> sorted opsets it serves, per domain."""

    ep: str
    how: str  # "kernel table" or "GetCapability probe"
    onnx_ops: dict[str, list[int]]
    ephost_ops: dict[str, list[int]]


# ---- ONNX's side -------------------------------------------------------------------------------
@cache
def onnx_ops() -> dict[str, int]:
    """ai.onnx ops defined at some opset of the window, not deprecated there -> first version."""
    first: dict[str, int] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain == ONNX_DOMAIN and schema.since_version <= MAX_OPSET:
            first[schema.name] = min(first.get(schema.name, schema.since_version), schema.since_version)
    return {name: v for name, v in sorted(first.items())
            if not onnx.defs.get_schema(name, MAX_OPSET, ONNX_DOMAIN).deprecated}


def opset_ranges(opsets: list[int]) -> str:
    """[7, 8, 9, 13] -> "7-9, 13"; [] -> ""."""
    parts, start, prev = [], None, None
    for v in opsets:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(parts)


# ---- the CPU EP: its kernel table --------------------------------------------------------------
def cpu_ep_ops() -> EpOps:
    window = range(MIN_OPSET, MAX_OPSET + 1)
    known = onnx_ops()
    onnx_side: dict[str, list[int]] = {}
    ephost_side: dict[str, list[int]] = {}
    for domain, op in registry.supported_ops():
        if domain == ONNX_DOMAIN:
            first = known.get(op)
            if first is None:
                continue  # a kernel for an op ONNX no longer defines in the window (none today)
            served = [v for v in window if v >= first and registry.lookup(domain, op, v) is not None]
            if served:
                onnx_side[op] = served
        elif domain == EPHOST_DOMAIN:
            served = [v for v in range(1, 2) if registry.lookup(domain, op, v) is not None]
            if served:
                ephost_side[op] = served
    return EpOps(CPU_EP, "kernel table", onnx_side, ephost_side)


# ---- plugin EPs: GetCapability on probe graphs -------------------------------------------------
def _probe_type(type_strs) -> int:
    for t in _PREFERRED_TYPES:
        if t in type_strs:
            return _TYPE_ENUMS[t]
    return TensorProto.FLOAT


def _input_types(schema) -> list[int]:
    """One elem type per formal input the probe fills (required ones; one for a variadic input)."""
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    types = []
    for formal in schema.inputs:
        if formal.option == onnx.defs.OpSchema.FormalParameterOption.Optional:
            break
        allowed = constraints.get(formal.type_str, [formal.type_str])
        types.append(_probe_type(allowed))
        if formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            break
    return types


def _probe_node(k: int, op: str, domain: str, opset: int, types: list[int], n_outputs: int, attrs: dict):
    """NodeInfo and ValueMetas/initializers of probe node `k`."""
    ins = [f"p{k}_in{i}" for i in range(len(types))]
    outs = [f"p{k}_out{i}" for i in range(max(n_outputs, 1))]
    proto = helper.make_node(op, ins, outs, name=f"probe_{op}", domain=domain, **attrs)
    values = {n: ValueMeta(n, t, (2, 3)) for n, t in zip(ins, types)}
    values.update({n: ValueMeta(n, TensorProto.FLOAT, None) for n in outs})
    inits = {n: np.ones((1,), dtype=helper.tensor_dtype_to_np_dtype(t)) for n, t in zip(ins[1:], types[1:])}
    for n in inits:
        values[n] = ValueMeta(n, values[n].elem_type, (1,))
    return node_info(proto, opset), values, inits, ins[:1], outs


def probe_graph(opset: int) -> tuple[Graph, list[tuple[str, str]]]:
    """One node per op defined at `opset` (and per ai.ephost op): the graph and (domain, op) per node."""
    nodes, values, inits, inputs, outputs, which = [], {}, {}, [], [], []
    specs = []
    for op, first in onnx_ops().items():
        if first > opset:
            continue
        schema = onnx.defs.get_schema(op, opset, ONNX_DOMAIN)
        attrs = {name: _PLACEHOLDERS[a.type] for name, a in schema.attributes.items()
                 if a.required and a.type in _PLACEHOLDERS}
        specs.append((op, ONNX_DOMAIN, opset, _input_types(schema), schema.min_output, attrs))
    for op, n_in in EPHOST_OPS.items():
        specs.append((op, EPHOST_DOMAIN, 1, [TensorProto.FLOAT] * n_in, 1, {}))
    for k, (op, domain, version, types, n_out, attrs) in enumerate(specs):
        info, vals, consts, ins, outs = _probe_node(k, op, domain, version, types, n_out, attrs)
        nodes.append(info)
        values.update(vals)
        inits.update(consts)
        inputs += [values[n] for n in ins]
        outputs += [values[n] for n in outs]
        which.append((domain, op))
    model = helper.make_model(helper.make_graph([], f"ops_probe_{opset}", [], []),
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(EPHOST_DOMAIN, 1)])
    graph = Graph(model, nodes, values, inits, inputs, outputs, {"": opset, EPHOST_DOMAIN: 1})
    return graph, which


def claimed_nodes(ep, graph: Graph) -> set[int]:
    """Indices of `graph`'s nodes that plugin EP `ep` claims through GetCapability (alone or fused)."""
    from host.runtime.graphview import GraphView
    from host.runtime.partition.claims import collect_claims

    claims = collect_claims([ep], GraphView(graph), graph, Counter())
    return set(claims.single) | {i for _, group in claims.groups for i in group}


def plugin_ep_ops(ep) -> EpOps:
    """Coverage of a created plugin EP (a host.plugins.ep.PluginEp), by probing every opset of the window."""
    onnx_side: dict[str, list[int]] = {}
    ephost_side: dict[str, list[int]] = {}
    for opset in range(MIN_OPSET, MAX_OPSET + 1):
        graph, which = probe_graph(opset)
        for i in claimed_nodes(ep, graph):
            domain, op = which[i]
            if domain == ONNX_DOMAIN:
                onnx_side.setdefault(op, []).append(opset)
            elif opset == MIN_OPSET:  # ai.ephost ops sit at their own opset 1: count them once
                ephost_side.setdefault(op, []).append(1)
    return EpOps(ep.name, "GetCapability probe", dict(sorted(onnx_side.items())), dict(sorted(ephost_side.items())))


# ---- output ---------------------------------------------------------------------------------------
def summary_line(e: EpOps) -> str:
    total = len(onnx_ops())
    full = sum(1 for op, v in e.onnx_ops.items() if v[-1] == MAX_OPSET)
    return (f"{e.ep} ({e.how}): {len(e.onnx_ops)} of {total} ai.onnx ops (opsets {MIN_OPSET}..{MAX_OPSET}), "
            f"{full} of them through opset {MAX_OPSET}; {len(e.ephost_ops)} {EPHOST_DOMAIN} ops")


def format_text(eps: list[EpOps]) -> str:
    lines = []
    for e in eps:
        lines.append(summary_line(e))
        rows = [(op, v) for op, v in e.onnx_ops.items()]
        rows += [(f"{EPHOST_DOMAIN}::{op}", v) for op, v in e.ephost_ops.items()]
        width = max((len(op) for op, _ in rows), default=0)
        lines += [f"  {op:<{width}}  {opset_ranges(versions)}" for op, versions in rows]
    return "\n".join(lines)


def format_markdown(eps: list[EpOps]) -> str:
    """docs/ops.md: the summary, then one row per ai.onnx op (every one ONNX defines) and per ai.ephost op."""
    names = [e.ep for e in eps]
    lines = ["# Operator coverage", "",
             "Generated by `python -m host.cli ops --markdown` (host/cli/ops.py), up to the section "
             "\"The ONNX backend suite\" (written by hand); tests/host/test_cpu_ops_doc.py checks that this "
             "part matches the code. Each cell gives the "
             f"opsets (of ephost's window {MIN_OPSET}..{MAX_OPSET}) at which the EP runs the op; blank: not "
             "at all. Plugin EPs can be listed with `ephost ops --plugin PATH` (they are probed through "
             "GetCapability, see host/cli/ops.py).", ""]
    lines += [f"- {summary_line(e)}" for e in eps]
    lines += ["", "| op | first ONNX version | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for op, first in onnx_ops().items():
        cells = [opset_ranges(e.onnx_ops.get(op, [])) for e in eps]
        lines.append(f"| {op} | {first} | " + " | ".join(cells) + " |")
    for op in EPHOST_OPS:
        cells = [opset_ranges(e.ephost_ops.get(op, [])) for e in eps]
        lines.append(f"| {EPHOST_DOMAIN}::{op} | 1 | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def collect(env, ep_names: list[str]) -> list[EpOps]:
    """The CPU EP plus each named plugin EP (created through a throwaway session, closed after the probe)."""
    result = [cpu_ep_ops()]
    for name in ep_names:
        if name == CPU_EP:
            continue
        session = _session_for(env, name)
        try:
            ep = next((e for e in session._eps if e.name == name), None)
            if ep is None:  # the plugin loaded but made no EP: no device here (it warned why)
                raise EpError(f"{name} has no device on this machine, so its ops cannot be probed; its "
                              "kernel table is in docs/cuda_ops.md (CUDA) or the plugin's documentation")
            result.append(plugin_ep_ops(ep))
        finally:
            session.close()
    return result


def _session_for(env, name: str):
    """A session on a one-node model with EP `name` as its only provider: it creates the EP."""
    from host.runtime.session import InferenceSession

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ops_probe", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
                              opset_imports=[helper.make_opsetid("", MAX_OPSET)], ir_version=10)
    return InferenceSession(model.SerializeToString(), providers=[name], env=env)


def cmd_ops(args) -> int:
    """`ephost ops`: print the coverage (text, or the Markdown of docs/ops.md)."""
    from host.cli import session_cmds as app  # the plugin and --ep handling of run/bench

    env = app._environment(args.plugin)
    try:
        eps = collect(env, app._chosen_eps(env, args.ep) if (args.ep or args.plugin) else [])
        print(format_markdown(eps) if args.markdown else format_text(eps), end="" if args.markdown else "\n")
    finally:
        env.close()
    return 0
