"""The lowering rules' registry and what a rule sees: `lowers` registers a rule per (domain,
op_type) in one table (`LOWERINGS`); `LowerCtx` holds the program being built; the helpers below
(`broadcast`, `norm_axis`, `attributes`, `ew`, `view`) are shared by the rule modules
(lower_math, lower_rows, lower_layout, lower_conv). Shape and attribute rules come from
plugin_cuda.semantics, as for the per-node kernels; `run_rule` turns their OpError into PlanError.
"""

from __future__ import annotations

import numpy as np

from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.program import F32, Op, Program
from plugin_cuda.plan.symint import dim
from plugin_cuda.semantics import Attributes, OpError, shapes

__all__ = ["EPHOST_DOMAIN", "LOWERINGS", "LowerCtx", "attributes", "broadcast", "domain_of", "ew", "lowers",
           "mask_only_expand", "norm_axis", "present", "run_rule", "view", "where"]

EPHOST_DOMAIN = "ai.ephost"

# ---------------------------------------------------------------------------------------------
# Registry


LOWERINGS: dict = {}


def lowers(*op_types: str, domain: str = ""):
    """Decorator: register a lowering rule fn(ctx, node) for op types of `domain`."""

    def decorate(fn):
        for op in op_types:
            key = (domain, op)
            if key in LOWERINGS:
                raise RuntimeError(f"plan lowering for {domain or 'ai.onnx'}::{op} registered twice")
            LOWERINGS[key] = fn
        return fn

    return decorate



def domain_of(node) -> str:
    """The node's domain as the registry keys it ('' for ONNX)."""
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _consumers(graph) -> dict:
    """value id -> [(node, input position)], worked out once per graph object."""
    cached = graph.__dict__.get("_plan_consumers")
    if cached is None:
        cached = {}
        for n in graph.nodes:
            for pos, vid in enumerate(n.inputs):
                if vid >= 0:
                    cached.setdefault(vid, []).append((n, pos))
        graph.__dict__["_plan_consumers"] = cached
    return cached


def mask_only_expand(graph, node) -> bool:
    """An Expand whose result only feeds Attention masks (input 3; the optimizer's Attention fusion
    expands a [B, 1, 1, Skv] mask over the query length for onnxruntime's sake): Attention broadcasts
    the mask itself, so a plan reads the mask unexpanded and the Expand's shape (a value the host
    computes per input shape) need not be a constant."""
    if node.op_type != "Expand" or domain_of(node) != "":
        return False
    out = node.outputs[0]
    if out < 0 or graph.values[out].kind == 2:  # a graph output needs the expanded bytes
        return False
    uses = _consumers(graph).get(out, [])
    return bool(uses) and all(n.op_type == "Attention" and domain_of(n) == "" and pos == 3 for n, pos in uses)


class LowerCtx:
    """What a lowering rule sees: the program so far and helpers for shapes, constants and ops."""

    def __init__(self, prog: Program, graph, partition_outputs: set):
        self.prog = prog
        self.graph = graph
        self.partition_outputs = partition_outputs

    def shape(self, vid: int) -> tuple:
        return self.prog.values[vid].shape

    def const(self, vid: int):
        return self.prog.values[vid].const

    def host_ints(self, node, vid: int, what: str) -> tuple:
        c = self.const(vid)
        if c is None:
            raise PlanError(f"{node.op_type} node '{node.name}': {what} must be a constant for a compiled plan")
        # dim(): a host-computed shape specialized per signature holds SymInts (signatures.specialize)
        return tuple(dim(v) for v in np.asarray(c).reshape(-1))

    def set_shape(self, node, vid: int, shape: tuple) -> None:
        """Record an inferred output shape; a static shape the graph gave must agree with it."""
        shape = tuple(dim(d) for d in shape)
        v = self.prog.values[vid]
        known = v.shape
        if known is not None and (len(known) != len(shape) or any(k not in (-1, s) for k, s in zip(known, shape))):
            raise PlanError(f"{node.op_type} node '{node.name}': output '{v.name}' has shape {shape}; "
                            f"the graph says {known}")
        v.shape = shape

    def emit(self, op_kind: str, node, inputs, outputs, **attrs) -> None:
        self.prog.ops.append(Op(op_kind, node.name, list(inputs), list(outputs), attrs))

    def dtype(self, vid: int):
        """The plan dtype of a value (float32 when not known)."""
        return self.prog.values[vid].dtype or F32

    def temp(self, node, shape: tuple, suffix: str, dtype=None) -> int:
        """An intermediate of `node`; by default in the type of its first input (the node's type)."""
        dtype = dtype if dtype is not None else self.dtype(node.inputs[0])
        return self.prog.new_value(f"{node.name}/{suffix}", shape, dtype=dtype)



def where(node) -> str:
    """How messages name a node: "<op_type> node '<name>'"."""
    return f"{node.op_type} node '{node.name}'"


def attributes(node) -> Attributes:
    """The node's attributes, read with ONNX's types and defaults (plugin_cuda.semantics)."""
    return Attributes(node.attrs, node.op_type, node.name)


def broadcast(node, *in_shapes) -> tuple:
    """The broadcast of `in_shapes` (OpError naming the node when they do not)."""
    return shapes.broadcast(where(node), *in_shapes)


def norm_axis(node, axis: int, rank: int) -> int:
    """`axis` normalised against `rank` (OpError naming the node when out of range)."""
    return shapes.normalize_axis(axis, rank, where(node))


def present(node, i: int) -> bool:
    """Whether optional input `i` is given."""
    return i < len(node.inputs) and node.inputs[i] >= 0


def ew(ctx: LowerCtx, node, inputs: list, out: int, expr: str) -> None:
    """One elementwise op over broadcast inputs."""
    ctx.set_shape(node, out, broadcast(node, *(ctx.shape(i) for i in inputs)))
    ctx.emit("ew", node, inputs, [out], expr=expr)


def view(ctx: LowerCtx, node, x: int, out: int) -> None:
    """A view; but a partition output needs its own bytes, so it gets a copy instead."""
    if out in ctx.partition_outputs:
        alias = ctx.temp(node, ctx.shape(out), "view")
        ctx.emit("alias", node, [x], [alias])
        ctx.emit("ew", node, [alias], [out], expr="{0}")
    else:
        ctx.emit("alias", node, [x], [out])


def run_rule(ctx: LowerCtx, node) -> None:
    """Run the node's lowering rule; a broken ONNX rule (OpError) becomes a PlanError naming the node."""
    try:
        LOWERINGS[(domain_of(node), node.op_type)](ctx, node)
    except OpError as exc:
        message = str(exc)
        prefix = where(node)
        raise PlanError(message if message.startswith(prefix) else f"{prefix}: {message}") from None
    _infer_dtypes(ctx, node)


def _infer_dtypes(ctx: LowerCtx, node) -> None:
    """Outputs whose element type the graph left unknown take the node's first known input type
    (every op a plan runs keeps its float type but Cast, whose rule sets it)."""
    known = [ctx.prog.values[v].dtype for v in node.inputs if v >= 0 and ctx.prog.values[v].dtype is not None]
    for vid in node.outputs:
        if vid >= 0 and vid in ctx.prog.values and ctx.prog.values[vid].dtype is None:
            ctx.prog.values[vid].dtype = known[0] if known else F32
