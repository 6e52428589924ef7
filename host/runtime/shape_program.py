"""Shape arithmetic evaluated on the host, once per input-shape signature (issue 23, item 1).

Dynamic-axes exports compute shapes with small integer subgraphs (Shape -> Gather -> Unsqueeze ->
Concat -> Reshape, Shape -> Slice -> Concat -> Expand, Range over a dim...). As plan nodes they run
at every run, each a CPU-EP step (and, next to a device EP, a copy). At session creation
`build(graph)` finds the nodes whose outputs depend only on the shapes fed to a run:

- a `Shape` or `Size` node whose input's shape is computable from the inputs' shapes: a graph input
  (its fed shape), or a value whose inferred dims are ints, the inputs' symbols or expressions over
  them (host/runtime/dims.py; Range lengths come from host/runtime/range_lengths.py);
- any node of `PROGRAM_OPS` whose inputs are all initializers or outputs of such nodes, one at least
  of such nodes (constants alone are the optimizer's to fold, and the CPU EP binds them to kernels);

and whose outputs are small: known rank, at most one dim that is not a fixed int, at most
`MAX_FIXED_ELEMENTS` elements over the fixed dims, and no graph output among them. Those nodes
leave the plan; the program runs them with the CPU EP's own kernels on the first run of each
signature (the feeds' shapes) and keeps the values in a bounded LRU cache (`capacity` signatures).
The run stores the cached values into its value list like initializers (`with_values`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from host import cpu_ep
from host.errors import InvalidArgument
from host.runtime import dims

DEFAULT_CAPACITY = 64
CACHE_KEY = "session.ephost.shape_cache_signatures"  # session config entry: the cache bound
MAX_FIXED_ELEMENTS = 1024
# Deterministic ops cheap on small integer tensors: what exporters compute shapes with.
PROGRAM_OPS = frozenset({
    "Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Identity", "Reshape",
    "Expand", "Range", "ConstantOfShape", "Tile", "Flatten", "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs",
    "Max", "Min", "Sqrt", "Reciprocal", "Pow", "Floor", "Ceil", "Sign", "Clip", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Where", "ReduceProd", "ReduceSum", "ReduceMax",
    "ReduceMin"})


@dataclass(frozen=True)
class _Step:
    node: int             # index in graph.nodes
    kernel: object        # the CPU EP's OpKernel
    inputs: tuple         # value ids (-1: absent)
    outputs: tuple
    shape_of: tuple | None = None  # Shape/Size: (input id, fed directly?, dim functions)


class ShapeProgram:
    """The absorbed nodes (`nodes`) and their evaluation, cached per input-shape signature."""

    def __init__(self, steps: list[_Step], constants: dict[int, np.ndarray], exported: tuple[int, ...],
                 bindings: dict[str, list[tuple[int, int, str]]], capacity: int):
        self.steps = steps
        self.nodes = frozenset(s.node for s in steps)
        self.constants = constants
        self.exported = exported  # values read outside the program
        self.bindings = bindings  # symbol -> (input id, axis, input name) for the symbols used
        # The inputs whose shapes the program reads: fed to a Shape directly, or binding a symbol it uses.
        read_directly = {s.shape_of[0] for s in steps if s.shape_of is not None and s.shape_of[1]}
        self.signature_ids = tuple(sorted(read_directly | {vid for b in bindings.values() for vid, _, _ in b}))
        self.capacity = capacity
        self.evaluations = 0  # programs run (cache misses)
        self._cache: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.steps)

    def with_values(self, feeds: dict[int, object]) -> dict[int, object]:
        """`feeds` plus the program's values for their shapes (evaluated on a new signature)."""
        if not self.steps:
            return feeds
        sig = tuple(tuple(feeds[v].shape) for v in self.signature_ids)
        with self._lock:
            values = self._cache.get(sig)
            if values is not None:
                self._cache.move_to_end(sig)
            else:
                values = self._evaluate(feeds)
                self._cache[sig] = values
                if len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)  # least recently used
        out = dict(feeds)
        out.update(values)
        return out

    def cached_signatures(self) -> int:
        return len(self._cache)

    def _sizes(self, feeds) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for sym, where in self.bindings.items():
            seen = {(name, axis, feeds[vid].shape[axis]) for vid, axis, name in where}
            values = {n for _, _, n in seen}
            if len(values) > 1:
                given = ", ".join(f"'{name}' dim {axis} = {n}" for name, axis, n in sorted(seen))
                raise InvalidArgument(f"inputs declare the same symbolic dim '{sym}' but were fed different sizes "
                                      f"({given}); this session computes shapes from the declared dims: feed equal "
                                      "sizes (docs/dynamic_shapes.md)")
            sizes[sym] = values.pop()
        return sizes

    def _evaluate(self, feeds) -> tuple:
        self.evaluations += 1
        sizes = self._sizes(feeds)
        env: dict[int, object] = dict(self.constants)
        for step in self.steps:
            if step.shape_of is not None:
                vid, fed, fns = step.shape_of
                shape = tuple(feeds[vid].shape) if fed else _dims(fns, sizes)
                # Shape and Size read only the shape: a zero-stride view allocates nothing.
                args = (np.broadcast_to(np.zeros((), np.uint8), shape),)
            else:
                args = tuple(None if v < 0 else env[v] for v in step.inputs)
            outs = step.kernel.run(*args)
            for vid, arr in zip(step.outputs, outs):
                if vid >= 0:
                    env[vid] = np.asarray(arr)
        values = tuple((vid, env[vid]) for vid in self.exported)
        for _, arr in values:
            arr.flags.writeable = False  # shared by every run of this signature
        return values


def _dims(fns, sizes: dict[str, int]) -> tuple[int, ...]:
    try:
        return tuple(fn(sizes) for fn in fns)
    except ValueError as exc:  # a declared dim such as 's0/2' that these sizes do not divide
        raise InvalidArgument(f"the fed shapes do not fit the model's declared dims: {exc}") from None


def capacity(entries: dict[str, str]) -> int:
    """The cache bound (signatures kept) from the session config entries; 0 turns the program off."""
    text = entries.get(CACHE_KEY, str(DEFAULT_CAPACITY))
    if not (text.isascii() and text.isdigit()):
        raise InvalidArgument(f"session config '{CACHE_KEY}' = {text!r}: expected a decimal integer >= 0 "
                              f"(signatures kept; 0 evaluates shapes as nodes; default {DEFAULT_CAPACITY})")
    return int(text)


def _small(meta) -> bool:
    if meta is None or meta.shape is None:
        return False
    free = [d for d in meta.shape if not (isinstance(d, int) and d >= 0)]
    fixed = int(np.prod([d for d in meta.shape if isinstance(d, int) and d >= 0], dtype=np.int64))
    return len(free) <= 1 and fixed <= MAX_FIXED_ELEMENTS


def build(graph, value_ids: dict[str, int], capacity: int = DEFAULT_CAPACITY) -> ShapeProgram:
    """The program of `graph`'s shape arithmetic (empty when there is none, or when `capacity` is 0)."""
    if capacity <= 0:
        return ShapeProgram([], {}, (), {}, 0)
    symbols = dims.input_symbols(graph.inputs)
    input_names = {v.name for v in graph.inputs}
    outputs = {v.name for v in graph.outputs}
    inits = graph.initializers
    produced: set[str] = set()
    used_symbols: set[str] = set()
    steps: list[_Step] = []
    for i, n in enumerate(graph.nodes):
        if n.domain not in ("", "ai.onnx") or n.implicit or n.op_type not in PROGRAM_OPS:
            continue
        outs = [x for x in n.outputs if x]
        if not outs or any(x in outputs or not _small(graph.values.get(x)) for x in outs):
            continue
        if cpu_ep.lookup(n.domain, n.op_type, n.opset) is None:
            continue
        shape_of = None
        if n.op_type in ("Shape", "Size"):
            shape_of = _shape_source(graph, n.inputs[0], input_names, set(symbols), used_symbols, value_ids)
            if shape_of is None:
                continue
        elif not all(x == "" or x in produced or (x in inits and inits[x].dtype != object) for x in n.inputs) \
                or not any(x in produced for x in n.inputs):
            # Constants alone (an Identity over a weight) stay: the CPU EP binds them to kernels.
            continue
        ids = tuple(value_ids[x] if x else -1 for x in n.inputs)
        steps.append(_Step(i, cpu_ep.create_kernel(n), ids, tuple(value_ids[x] if x else -1 for x in n.outputs),
                           shape_of))
        produced.update(outs)
    absorbed = {s.node for s in steps}
    read_outside = {x for i, n in enumerate(graph.nodes) if i not in absorbed for x in n.inputs if x}
    exported = tuple(value_ids[x] for x in sorted(produced & read_outside))
    constants = {value_ids[x]: inits[x] for s in steps for x in (graph.nodes[s.node].inputs) if x in inits}
    bindings = {sym: [(value_ids[name], axis, name) for name, axis in symbols[sym]] for sym in sorted(used_symbols)}
    return ShapeProgram(steps, constants, exported, bindings, capacity)


def _shape_source(graph, name: str, input_names: set[str], symbols: set[str], used: set[str], value_ids):
    """(value id, read from the feed?, dim functions) for the input of a Shape/Size node, or None when
    its shape cannot be computed from the inputs' shapes."""
    if name in input_names:
        meta = graph.values.get(name)
        if meta is None or meta.type is not None:
            return None
        return value_ids[name], True, ()
    meta = graph.values.get(name)
    if meta is None or meta.shape is None or meta.type is not None:
        return None
    fns = []
    reads: set[str] = set()
    for d in meta.shape:
        compiled = dims.compile_dim(d, symbols)
        if compiled is None:
            return None
        fns.append(compiled[0])
        reads |= compiled[1]
    used |= reads
    return value_ids[name], False, tuple(fns)
