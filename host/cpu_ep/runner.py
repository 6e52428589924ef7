"""The CPU EP's run loop for plans whose every node is on the CPU EP.

The general executor path checks, per input, where the value lives and whether a stream must be
waited on, and `OpKernel.run` enters `np.errstate` per node: a few microseconds per node, which is
most of the time of a small model. With no plugin EP in the plan every value is a NumPy array in
host memory, so this loop hands inputs straight to each kernel's `_run`, under one `np.errstate`
for the whole run, and keeps `run`'s contract: failures become a KernelError naming the node,
NumPy scalars become arrays.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from host.cpu_ep.base import NON_TENSOR
from host.cpu_ep.fusion import FusedNode, fuse
from host.errors import EpError, EphostError


def _value(out):
    """A kernel's output other than a plain ndarray: a NumPy scalar becomes an array; arrays and
    non-tensor values (lists, dicts) stay as they are."""
    return out if isinstance(out, NON_TENSOR) else np.asarray(out)


def _gather(inputs: tuple[int, ...]):
    """values -> the node's argument list (None for an absent optional input), as cheaply as possible."""
    if inputs and all(v >= 0 for v in inputs):
        if len(inputs) == 1:
            only = inputs[0]
            return lambda values: (values[only],)
        return itemgetter(*inputs)
    return lambda values: [values[v] if v >= 0 else None for v in inputs]


def _fused_gather(node: FusedNode):
    """A chain's kernel takes (values, its first node's arguments)."""
    first = _gather(node.kernel.arg_ids)
    return lambda values: (values, first(values))


def _through_identities(nodes, constants: dict) -> dict:
    """constants plus the outputs of Identity nodes over them: the Identity kernel passes its input
    object through, so at run time such an output is the initializer itself (the TorchScript exporter
    puts an Identity in front of many weights when the optimizer is off)."""
    more = dict(constants)
    for node in nodes:
        if (node.op_type == "Identity" and node.kernel.node.domain in ("", "ai.onnx") and len(node.inputs) == 1
                and node.inputs[0] in more and len(node.outputs) == 1 and node.outputs[0] >= 0):
            more[node.outputs[0]] = more[node.inputs[0]]
    return more


def _steps(nodes, keep: set[int], constants: dict) -> tuple[list[tuple], tuple]:
    """Per node (or joined chain, fusion.py), built once per plan: (node, the kernel's instance dict, its
    `_run`, argument getter, the one output's id (-1: not kept; -2: several outputs), output ids, values
    to free), and the prelude: (value id, initializer) for each Identity over an initializer,
    which a run stores up front instead of running the node (unless it is a graph output or profiled).
    Each kernel is told first which of its inputs are initializers (`OpKernel.bind_constants`)."""
    constants = _through_identities(nodes, constants)
    for node in nodes:
        bound = {pos: constants[v] for pos, v in enumerate(node.inputs) if v in constants}
        if bound:
            node.kernel.bind_constants(bound)
    prelude, rest = [], []
    for node in nodes:
        out = node.outputs[0] if node.op_type == "Identity" and len(node.outputs) == 1 else -1
        if out >= 0 and out in constants and out not in keep and "run" not in node.kernel.__dict__:
            prelude.append((out, constants[out]))
        else:
            rest.append(node)
    steps = []
    for node in fuse(rest, keep, constants):
        gather = _fused_gather(node) if isinstance(node, FusedNode) else _gather(node.inputs)
        outputs = tuple(node.outputs)
        single = outputs[0] if len(outputs) == 1 else -2
        steps.append((node, node.kernel.__dict__, node.kernel._run, gather, single, outputs,
                      tuple(v for v in node.frees if v not in keep)))
    return steps, tuple(prelude)


def run_plan(nodes, values: list, keep: set[int], value_names: list[str], owner=None) -> None:
    """Runs plan `nodes` (all CPU EP) in order over `values` (indexed by value id); frees what each
    node's `frees` lists unless it is in `keep`. `owner` (the executor) keeps the per-node steps
    between runs; they are rebuilt when the nodes or `keep` change."""
    cached = getattr(owner, "_cpu_run_steps", None)
    if cached is None or cached[0] is not nodes or cached[1] != keep:
        plan = getattr(owner, "plan", None)
        cached = (nodes, frozenset(keep), *_steps(nodes, keep, getattr(plan, "constants", None) or {}))
        if owner is not None:
            owner._cpu_run_steps = cached
    for vid, arr in cached[3]:
        values[vid] = arr
    ndarray = np.ndarray
    objects = getattr(getattr(owner, "plan", None), "object_ids", None) or ()  # lists, None, dicts: kept as they are
    with np.errstate(all="ignore"):
        for node, kdict, run, gather, single, outputs, frees in cached[2]:
            # A profiler (host/runtime/profiling.py) times a kernel by wrapping its `run` on the
            # instance: call that wrapper when it is there.
            fn = kdict.get("run") or run
            try:
                outs = fn(*gather(values))
            except EphostError:
                raise
            except Exception as exc:
                missing = [value_names[v] for v in node.inputs if v >= 0 and values[v] is None and v not in objects]
                if missing:
                    raise EpError(f"value '{missing[0]}' was not produced") from exc
                raise node.kernel.failure(exc) from exc
            if single >= 0:  # one output (most nodes)
                out = outs[0]
                values[single] = out if type(out) is ndarray or single in objects else _value(out)
            elif single == -2:
                for vid, out in zip(outputs, outs):
                    if vid >= 0:
                        values[vid] = out if type(out) is ndarray or vid in objects else _value(out)
            for v in frees:
                values[v] = None
