"""Run steps of the CPU EP: a segment of consecutive CPU nodes, and a control-flow node.

A segment runs a stretch of plan nodes that are all on the CPU EP in one tight loop: each kernel's
`_run` gets its inputs through a prebuilt getter, with floating-point errors ignored for the whole segment, and
chains of nodes whose inner values nothing else reads run as one step (host/cpu_ep/fusion.py).
Values that enter the segment from elsewhere (feeds, plugin outputs) are made host arrays once at
its start (copied from a device, or waited for on their producer's stream), so inside the segment
every value is a NumPy array (or a list, dict or None for non-tensor values). The same steps serve
a plan that is all CPU and a plan where plugin nodes sit between the segments.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from host.cpu_ep.base import NON_TENSOR
from host.cpu_ep.fusion import FusedNode, fuse
from host.errors import EpError, EphostError
from host.plugins.ep import CPU_LOCATION
from host.runtime.fp_errors import ignore_fp_errors, restore_fp_errors
from host.runtime.plan import PlanNode
from host.runtime.steps.cpu_hoist import Hoisted, escaping, own_copies, split_hoisted
from host.runtime.steps.cpu_replay import SegmentReplay
from host.runtime.tensor import DeviceTensor


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


def through_identities(nodes: list[PlanNode], constants: dict) -> dict:
    """constants plus the outputs of CPU Identity nodes over them: the Identity kernel passes its input
    object through, so at run time such an output is the initializer itself (the TorchScript exporter
    puts an Identity in front of many weights when the optimizer is off)."""
    more = dict(constants)
    for node in nodes:
        if (node.ep is None and node.op_type == "Identity" and node.kernel.node.domain in ("", "ai.onnx")
                and len(node.inputs) == 1 and node.inputs[0] in more and len(node.outputs) == 1
                and node.outputs[0] >= 0):
            more[node.outputs[0]] = more[node.inputs[0]]
    return more


class CpuSegment:
    """Consecutive CPU EP nodes of a plan, run as one step.

    `keep`: values that must survive the segment as they are (graph outputs, values read after it);
    `constants`: initializers, and Identity outputs over them (`through_identities`); `observer`: a
    profiler's, which times each node (then no chain is joined, so each node keeps its event).
    """

    def __init__(self, nodes: list[PlanNode], keep: set[int], constants: dict, plan, observer=None):
        self.nodes = nodes
        self.value_names = plan.value_names
        self.objects = plan.object_ids  # lists, None, dicts: kept as they are
        produced = {v for n in nodes for v in n.outputs if v >= 0}
        # Values read here but made elsewhere: feeds and plugin outputs may be on a device or pending.
        self.entering = tuple(sorted({v for n in nodes for v in n.inputs
                                      if v >= 0 and v not in produced and v not in constants}))
        for node in nodes:
            bound = {pos: constants[v] for pos, v in enumerate(node.inputs) if v in constants}
            if bound:
                node.kernel.bind_constants(bound)
        self.prelude: list[tuple[int, np.ndarray]] = []
        rest = []
        for node in nodes:
            out = node.outputs[0] if node.op_type == "Identity" and len(node.outputs) == 1 else -1
            if observer is None and out >= 0 and out in constants and out not in keep:
                self.prelude.append((out, constants[out]))  # stored up front instead of running the node
            else:
                rest.append(node)
        # Nodes over shape-program values and initializers only: once per signature (cpu_hoist.py).
        hoisted, rest = split_hoisted(rest, keep, constants, plan) if observer is None else ([], rest)
        self.hoisted = Hoisted(hoisted, plan) if hoisted else None
        self.escaping = escaping(hoisted, rest, keep)  # kept values that may be views of hoisted outputs
        joined = fuse(rest, keep, constants) if observer is None else rest
        self.steps = [self._entry(node, keep, observer) for node in joined]
        self.kept = frozenset(v for v in keep if v in produced)  # handed on by a replay (cpu_replay.py)
        # Compiled calls recorded per input signature and replayed: not with a profiler's events, nor
        # where hoisted outputs or their views are put in place around the loop.
        self.replay = (SegmentReplay(self) if observer is None and self.hoisted is None and not self.escaping
                       else None)

    @staticmethod
    def _entry(node, keep: set[int], observer) -> tuple:
        gather = _fused_gather(node) if isinstance(node, FusedNode) else _gather(node.inputs)
        run = node.kernel._run
        if observer is not None:
            run = observer.node_call(run, node, "cpu")
        outputs = tuple(node.outputs)
        single = outputs[0] if len(outputs) == 1 else -2
        return (node, run, gather, single, outputs, tuple(v for v in node.frees if v not in keep))

    def context(self, run, stream) -> None:
        return None

    def __call__(self, st, ctx=None) -> None:
        values = st.values
        if self.entering:
            self._enter(st, values)
        if self.hoisted is not None:
            self.hoisted.restore(values, self._failure)
        if self.replay is not None and self.replay.run(values):
            return
        ndarray, objects = np.ndarray, self.objects
        fp_state = ignore_fp_errors()  # np.errstate(all="ignore"), cheaper (host/runtime/fp_errors.py)
        try:
            for node, run, gather, single, outputs, frees in self.steps:
                try:
                    outs = run(*gather(values))
                except EphostError:
                    raise
                except Exception as exc:
                    raise self._failure(node, values, exc) from exc
                if single >= 0:  # one output (most nodes)
                    out = outs[0]
                    values[single] = out if type(out) is ndarray or single in objects else _value(out)
                elif single == -2:
                    for vid, out in zip(outputs, outs):
                        if vid >= 0:
                            values[vid] = out if type(out) is ndarray or vid in objects else _value(out)
                for v in frees:
                    values[v] = None
        finally:
            restore_fp_errors(fp_state)
        if self.escaping:
            own_copies(values, self.escaping)

    def run_step(self, step: tuple, values: list, free: bool = True) -> None:
        """One entry of `steps` on `values`, as the run loop makes it (its frees only with `free`): for the
        replay's recording and check (cpu_replay.py). `__call__` keeps the same body inline: a method call
        per step is about 0.1 us, a few per cent of a small model's run."""
        node, run, gather, single, outputs, frees = step
        try:
            outs = run(*gather(values))
        except EphostError:
            raise
        except Exception as exc:
            raise self._failure(node, values, exc) from exc
        for vid, out in zip(outputs, outs) if single != -1 else ():
            if vid >= 0:
                values[vid] = out if type(out) is np.ndarray or vid in self.objects else _value(out)
        if free:
            for v in frees:
                values[v] = None

    def _enter(self, st, values: list) -> None:
        producer = st.producer
        for vid in self.entering:
            v = values[vid]
            if isinstance(v, DeviceTensor) or vid in producer:
                st.executor.input_for(st, vid, CPU_LOCATION, None, None)

    def _failure(self, node, values: list, exc: Exception) -> EphostError:
        missing = [self.value_names[v] for v in node.inputs if v >= 0 and values[v] is None and v not in self.objects]
        if missing:
            return EpError(f"value '{missing[0]}' was not produced")
        return node.kernel.failure(exc)


class ControlFlowStep:
    """A node the host runs over subgraph plans (If, Loop, Scan). Device values go into the bodies where
    they are (the bodies' own steps copy them where their consumers need them; the kernel reads
    conditions and counters through `runner.to_host`); device outputs carry their producer stream for
    consumers here."""

    def __init__(self, node: PlanNode, observer=None):
        self.node = node
        self.run = node.kernel.run
        if observer is not None:
            self.run = observer.node_call(self.run, node, "cpu")

    def context(self, run, stream) -> None:
        return None

    def __call__(self, st, ctx=None) -> None:
        node, vals, objects = self.node, st.values, st.plan.object_ids
        args = []
        for v in node.inputs:
            value = None if v < 0 else vals[v]
            if value is None and v >= 0 and v not in objects:
                raise EpError(f"value '{st.plan.value_names[v]}' was not produced")
            if v >= 0 and isinstance(value, np.ndarray) and v in st.producer:
                st.producer.pop(v).notify_and_wait(None)  # host memory a plugin stream wrote: the host reads it
            args.append(value)
        outs = self.run(*args)
        for vid, value in zip(node.outputs, outs):
            if vid >= 0:
                vals[vid] = value
                stream = getattr(value, "stream", None) if isinstance(value, DeviceTensor) else None
                if stream is not None:
                    st.producer[vid] = stream


__all__ = ["ControlFlowStep", "CpuSegment", "through_identities"]
