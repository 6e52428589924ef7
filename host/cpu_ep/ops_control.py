"""Control flow: If, Loop, Scan and SequenceMap, run by the host over prepared subgraph plans.

A kernel here holds no graph of its own: at session creation the planner calls `prepare(planner)`,
which turns each subgraph attribute into a runner (host/runtime/subgraph.py) once; a run of the
node only walks those runners. A runner takes the body's formal inputs and the outer-scope values
(the node's trailing `implicit` inputs) and returns the body's outputs, where they were produced:
a value a plugin EP made on its device stays there from one iteration to the next. The loop
counters, conditions and scan slices are read on the host (`runner.to_host`).
"""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, normalize_axis
from host.cpu_ep.registry import register
from host.errors import EphostError, KernelError


class ControlFlowKernel(OpKernel):
    """A node with subgraphs; `prepare` must run before the first `_run`."""

    takes_device_values = True
    graph_attrs: tuple[str, ...] = ()

    def __init__(self, node):
        super().__init__(node)
        self.n_explicit = len(node.inputs) - node.implicit
        self.runners: dict[str, object] = {}

    def prepare(self, planner) -> None:
        """`planner(attribute name)` -> the runner of that subgraph (built once per session)."""
        for name in self.graph_attrs:
            self.attr(name)  # a missing branch or body is a ModelError naming the attribute
            self.runners[name] = planner(name)

    def runner(self, name: str):
        r = self.runners.get(name)
        if r is None:
            raise KernelError(f"node '{self.name}' ({self.op_type}): its subgraphs were not prepared; "
                              "control-flow nodes run inside an InferenceSession", self.name)
        return r

    def run(self, *inputs) -> tuple:
        """As OpKernel.run, except that outputs pass through as the subgraphs made them: a body's device
        values (DeviceTensor) stay on their device (np.asarray would wrap them in object arrays)."""
        try:
            outputs = self._run(*inputs)
        except EphostError:
            raise
        except Exception as exc:
            raise self.failure(exc) from exc
        return tuple(outputs)

    def split(self, inputs: tuple) -> tuple[tuple, tuple]:
        return inputs[:self.n_explicit], inputs[self.n_explicit:]


def _flag(runner, value) -> bool:
    arr = runner.to_host(value)
    if arr.size != 1:
        raise ValueError(f"a condition must hold one element; got shape {list(arr.shape)}")
    return bool(arr.reshape(-1)[0])


def _stack(runner, values: list, index: int, axis: int = 0) -> np.ndarray:
    """Per-iteration values of scan output `index`, stacked along a new `axis` (on the host)."""
    if values:
        return np.stack([runner.to_host(v) for v in values], axis=axis)
    dtype, shape = runner.output_type(index)
    return np.empty((0, *shape) if shape is not None else (0,), dtype)


@register("If", since=1)
class If(ControlFlowKernel):
    graph_attrs = ("then_branch", "else_branch")

    def _run(self, cond, *outer):
        branch = self.runner("then_branch") if _flag(self.runner("then_branch"), cond) else self.runner("else_branch")
        return branch.run((), outer)


@register("Loop", since=1)
class Loop(ControlFlowKernel):
    """for i in range(M) while cond: carried = body(i, cond, carried); scan outputs stacked."""

    graph_attrs = ("body",)

    def _run(self, *inputs):
        body = self.runner("body")
        (trip, cond, *carried), outer = self.split(inputs)
        limit = None if trip is None else int(body.to_host(trip).reshape(-1)[0])
        going = True if cond is None else _flag(body, cond)
        n_carried = len(carried)
        scans: list[list] = []
        i = 0
        while going and (limit is None or i < limit):
            outs = body.run((np.array(i, np.int64), np.array(going), *carried), outer)
            # The body's condition ends the loop even without a cond input, as onnxruntime and
            # onnx's reference evaluator do (the spec's pseudo-code says it is ignored then).
            going = _flag(body, outs[0])
            carried = outs[1:1 + n_carried]
            if not scans:
                scans = [[] for _ in outs[1 + n_carried:]]
            for acc, v in zip(scans, outs[1 + n_carried:]):
                acc.append(v)
            i += 1
        n_scan = len(body.output_names) - 1 - n_carried
        return (*carried, *(_stack(body, scans[k] if scans else [], 1 + n_carried + k) for k in range(n_scan)))


class _ScanBase(ControlFlowKernel):
    graph_attrs = ("body",)

    def _sweep(self, body, states: list, xs: list, axes: list, reverse: list, outer) -> tuple[list, list]:
        """One scan over `xs` (host arrays): the final states and each scan output's slices, in order."""
        lengths = {x.shape[a] for x, a in zip(xs, axes)}
        if len(lengths) > 1:
            raise ValueError(f"scan inputs have different lengths along their scan axes: {sorted(lengths)}")
        steps = lengths.pop() if lengths else 0
        cuts = [(slice(None),) * a for a in axes]
        slices: list[list] = [[] for _ in range(len(body.output_names) - len(states))]
        for t in range(steps):
            sl = [x[(*c, steps - 1 - t if r else t)] for x, c, r in zip(xs, cuts, reverse)]
            outs = body.run((*states, *sl), outer)
            states = list(outs[:len(states)])
            for acc, v in zip(slices, outs[len(states):]):
                acc.append(v)
        return states, slices


@register("Scan", since=9)
class Scan(_ScanBase):
    """Scan-9+: states carried over slices of the scan inputs along their axes, in either direction."""

    def __init__(self, node):
        super().__init__(node)
        self.m = self.attr_int("num_scan_inputs", lo=1)
        self.in_axes = self.attr_ints("scan_input_axes", [0] * self.m, length=self.m)
        self.in_dirs = self.attr_ints("scan_input_directions", [0] * self.m, length=self.m)
        self.out_axes = self.attr_ints("scan_output_axes", None)
        self.out_dirs = self.attr_ints("scan_output_directions", None)

    def _run(self, *inputs):
        body = self.runner("body")
        explicit, outer = self.split(inputs)
        n_states = len(explicit) - self.m
        xs = [body.to_host(x) for x in explicit[n_states:]]
        axes = [normalize_axis(a, x.ndim) for a, x in zip(self.in_axes, xs)]
        states, slices = self._sweep(body, list(explicit[:n_states]), xs, axes, self.in_dirs, outer)
        k = len(slices)
        out_axes = self.out_axes if self.out_axes is not None else [0] * k
        out_dirs = self.out_dirs if self.out_dirs is not None else [0] * k
        outs = []
        for j, acc in enumerate(slices):
            if out_dirs[j]:
                acc = acc[::-1]
            stacked = _stack(body, acc, n_states + j)
            outs.append(np.moveaxis(stacked, 0, normalize_axis(out_axes[j], stacked.ndim)))
        return (*states, *outs)


@register("Scan", since=8, until=8)
class Scan8(_ScanBase):
    """Scan-8: a batch axis first, the scan axis second, optional per-batch sequence lengths."""

    def __init__(self, node):
        super().__init__(node)
        self.m = self.attr_int("num_scan_inputs", lo=1)
        self.dirs = self.attr_ints("directions", [0] * self.m, length=self.m)

    def _run(self, *inputs):
        body = self.runner("body")
        (lens, *explicit), outer = self.split(inputs)
        n_states = len(explicit) - self.m
        states = [body.to_host(s) for s in explicit[:n_states]]
        xs = [body.to_host(x) for x in explicit[n_states:]]
        batch = xs[0].shape[0]
        full = xs[0].shape[1]
        lengths = [full] * batch if lens is None else [int(v) for v in body.to_host(lens).reshape(-1)]
        finals, per_batch = [], []
        for b in range(batch):
            st, sl = self._sweep(body, [s[b] for s in states], [x[b, :lengths[b]] for x in xs],
                                 [0] * self.m, self.dirs, outer)
            finals.append([body.to_host(v) for v in st])
            per_batch.append(sl)
        outs = [np.stack([f[i] for f in finals]) for i in range(n_states)]
        for j in range(len(body.output_names) - n_states):
            rows = []
            for b in range(batch):
                stacked = _stack(body, per_batch[b][j], n_states + j)
                pad = [(0, full - stacked.shape[0])] + [(0, 0)] * (stacked.ndim - 1)
                rows.append(np.pad(stacked, pad))
            outs.append(np.stack(rows))
        return tuple(outs)


@register("SequenceMap", since=17)
class SequenceMap(ControlFlowKernel):
    """The body once per element of the input sequence; sequences in step, tensors whole."""

    graph_attrs = ("body",)

    def _run(self, *inputs):
        body = self.runner("body")
        explicit, outer = self.split(inputs)
        seqs = [isinstance(x, list) for x in explicit]
        count = len(explicit[0])
        if any(s and len(x) != count for s, x in zip(seqs, explicit)):
            raise ValueError(f"SequenceMap's input sequences differ in length: {[len(x) for x in explicit if isinstance(x, list)]}")
        outs: list[list] = [[] for _ in body.output_names]
        for i in range(count):
            got = body.run(tuple(x[i] if s else x for x, s in zip(explicit, seqs)), outer)
            for acc, v in zip(outs, got):
                acc.append(body.to_host(v))
        return tuple(outs)
