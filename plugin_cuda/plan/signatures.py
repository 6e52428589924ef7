"""Compiled partitions with symbolic dims: one plan per input-shape signature, kept in a bounded LRU.

A partition whose inputs have dims unknown at session creation (dynamic batch, sequence, image
size) is compiled for each distinct tuple of input shapes it is called with (its *signature*):
the fused subgraph is specialized to those shapes (plugin_cuda/plan/lower.py infers the rest), and
planned as a static partition is (lowering, fusion, codegen, memory plan, prepacked launches,
`plan_auto_graph` capture per signature). The plans of one partition

- share the device copies of its constants (`ConstantStore`): the weights are uploaded once, not
  once per shape;
- are kept in an LRU bounded by a count (`plan_shape_cache`) and by the bytes of their arenas
  (`plan_shape_cache_mb`); an evicted plan is closed (arenas, graphs and packed launches freed) as
  soon as no run holds it;
- reuse NVRTC output through the source-hash cache (device/nvrtc.py): a signature seen before, in
  this process or (through CuPy's disk cache) an earlier one, compiles nothing.

Pure Python (no CuPy import here): the plans are built by a callable the caller passes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import numpy as np

from abi.host_inputs import host_only_values
from plugin_cuda.plan.symint import SymInt

__all__ = ["ConstantStore", "PlanCache", "host_value_inputs", "is_dynamic", "specialize"]


def is_dynamic(graph, input_ids) -> bool:
    """Whether a partition input has a dim not known at compile time (-1 or None)."""
    for vid in input_ids:
        shape = graph.values[vid].shape
        if shape is None or any(d is None or d < 0 for d in shape):
            return True
    return False


def host_value_inputs(graph, input_ids) -> tuple[int, ...]:
    """Positions in `input_ids` of the inputs the host hands over in host memory: values its shape
    program computes (ValueSpec.host_computed) that the partition's nodes read only on the host (a
    Reshape's target; the host applies the same rule: abi/host_inputs.host_only_values). A plan
    takes them per value: they are part of the signature and constants of its plan."""
    flagged = [v for v in input_ids if getattr(graph.values[v], "host_computed", False)]
    if not flagged:
        return ()
    host = host_only_values([(n.op_type, n.domain, n.inputs) for n in graph.nodes], flagged)
    return tuple(pos for pos, v in enumerate(input_ids) if v in host)


def specialize(graph, input_ids, shapes, symbolic: bool = True, host: tuple[int, ...] = ()):
    """A copy of the GraphSpec `graph` whose partition inputs have the concrete `shapes`.

    Only the inputs change (lowering infers every other shape from them); values and constants are
    shared with `graph`, so constant arrays keep their identity across specializations.
    `symbolic`: each dim unknown in `graph` becomes a SymInt S0, S1, ... (in input order), so the
    plan's source takes it as a kernel argument (plan/symint.py); else a plain int.
    `host`: positions whose entry in `shapes` is the host value itself (host_value_inputs); each
    becomes a constant of the copy and leaves its inputs."""
    values = list(graph.values)
    k = 0
    placed = []  # (axis, SymInt): where each symbol sits in its input, for host_constant
    for pos, (vid, shape) in enumerate(zip(input_ids, shapes)):
        if pos in host:
            continue
        declared = values[vid].shape or (None,) * len(shape)
        dims = []
        for axis, (d, known) in enumerate(zip(shape, declared)):
            if symbolic and (known is None or known < 0):
                dims.append(SymInt(int(d), f"S{k}"))
                placed.append((axis, dims[-1]))
                k += 1
            else:
                dims.append(int(d))
        values[vid] = replace(values[vid], shape=tuple(dims))
    for pos in host:
        vid = input_ids[pos]
        values[vid] = replace(values[vid], constant=host_constant(shapes[pos], placed, _declared_target(graph, vid)))
    kept = tuple(v for pos, v in enumerate(input_ids) if pos not in host)
    return replace(graph, values=values, inputs=[values[v] for v in kept], input_ids=kept)


def _declared_target(graph, vid) -> tuple | None:
    """The declared output shape of the Reshape reading `vid` as its target (-1: a symbolic dim)."""
    for node in graph.nodes:
        if node.op_type == "Reshape" and len(node.inputs) > 1 and node.inputs[1] == vid:
            shape = graph.values[node.outputs[0]].shape
            return None if shape is None else tuple(-1 if d is None else d for d in shape)
    return None


def host_constant(entries, placed, declared=None) -> np.ndarray:
    """A host-computed shape as the constant of one signature's plan. `placed`: (axis, SymInt) for
    each symbol of the partition's inputs, in order. A positive entry equal to a symbol's value
    becomes that SymInt, so a Reshape to [batch, seq, heads, -1] gives [S0, S1, 12, -1] and the
    plan's source stays the same across signatures. `declared`: the Reshape's output dims as the
    graph declares them; an entry where that dim is a known int stays a literal (12 heads beside a
    sequence of 12). Among symbols of equal value (batch = seq, or seq read from several inputs) an
    entry takes the first one at its own axis in an input, else the first: a square (8, 8) plans the
    source of (8, 128). A wrong pick costs one more compile for that signature, never a wrong result
    (the values are equal in it). 0 and -1 keep their Reshape meaning as literals."""
    fixed = [declared is not None and len(declared) == len(entries) and declared[i] >= 0
             for i in range(len(entries))]
    out = [_symbol_for(int(e), i, placed) if e > 0 and not fixed[i] else int(e) for i, e in enumerate(entries)]
    if any(isinstance(e, SymInt) for e in out):
        arr = np.empty(len(out), dtype=object)
        arr[:] = out
        return arr
    return np.array(out, np.int64)


def _symbol_for(value: int, axis: int, placed) -> int:
    """The symbol an entry of `value` at `axis` stands for (host_constant), or the plain int."""
    same = [(a, s) for a, s in placed if int(s) == value]
    at_axis = [s for a, s in same if a == axis]
    return at_axis[0] if at_axis else same[0][1] if same else value


class ConstantStore:
    """Device copies of a partition's constants, shared by its per-signature plans.

    Keyed by the constant's name and shape; a hit is confirmed by identity of the host array (the
    graph's initializers keep theirs across specializations) or, for constants a lowering rule
    derived, by equal contents. One allocation per batch of new constants."""

    def __init__(self, upload):
        self._upload_block = upload  # host uint8 array -> a device allocation holding it (with .ptr)
        self._entries: dict = {}  # (name, shape) -> (host array, device address)
        self._blocks: list = []
        self.nbytes = 0

    def addresses(self, items, align: int) -> list:
        """Device addresses of `items` [(name, float32 array)], uploading those not held yet."""
        out, missing = [], []
        for name, arr in items:
            hit = self._entries.get((name, arr.shape))
            if hit is not None and (hit[0] is arr or np.array_equal(hit[0], arr)):
                out.append(hit[1])
            else:
                out.append(None)
                missing.append(len(out) - 1)
        if missing:
            self._upload(items, out, missing, align)
        return out

    def _upload(self, items, out, missing, align) -> None:
        sizes = [-(-max(items[i][1].nbytes, 1) // align) * align for i in missing]
        total = sum(sizes)
        host = np.zeros(total, np.uint8)
        top = 0
        for i, size in zip(missing, sizes):
            arr = items[i][1]
            host[top:top + arr.nbytes] = arr.reshape(-1).view(np.uint8)
            top += size
        block = self._upload_block(host)
        self._blocks.append(block)
        self.nbytes += total
        base, top = int(block.ptr), 0
        for i, size in zip(missing, sizes):
            name, arr = items[i]
            out[i] = base + top
            self._entries[(name, arr.shape)] = (arr, base + top)
            top += size

    def close(self) -> None:
        self._entries.clear()
        self._blocks.clear()
        self.nbytes = 0


class _Entry:
    __slots__ = ("plan", "users", "retired", "nbytes")

    def __init__(self, plan, nbytes: int):
        self.plan = plan
        self.users = 0
        self.retired = False
        self.nbytes = nbytes


class PlanCache:
    """Plans by signature, least recently used first out, bounded by count and bytes.

    `acquire(signature)` returns the plan (building it on a miss) and holds it until `release`; an
    evicted plan that a run still holds is closed by that run's release."""

    def __init__(self, build, max_plans: int, max_bytes: int):
        if max_plans < 1:
            raise ValueError(f"max_plans must be >= 1, got {max_plans}")
        self._build = build  # signature -> plan (with .arena_bytes and .close())
        self.max_plans = int(max_plans)
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.RLock()
        self.bytes = 0
        self._retired: dict = {}  # id(plan) -> _Entry: evicted while a run held it
        self.stats = {"builds": 0, "hits": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def signatures(self) -> list:
        """Cached signatures, least recently used first."""
        with self._lock:
            return list(self._entries)

    def plans(self) -> list:
        """Every plan the cache holds, evicted ones that a run still holds included."""
        with self._lock:
            return [e.plan for e in self._entries.values()] + [e.plan for e in self._retired.values()]

    def acquire(self, signature):
        with self._lock:
            entry = self._entries.get(signature)
            if entry is None:
                entry = self._add(signature)
            else:
                self._entries.move_to_end(signature)
                self.stats["hits"] += 1
            entry.users += 1
            return entry.plan

    def release(self, signature, plan) -> None:
        with self._lock:
            entry = self._entries.get(signature)
            if entry is not None and entry.plan is plan:
                entry.users -= 1
                return
            retired = self._retired.get(id(plan))
            if retired is not None:
                retired.users -= 1
                if retired.users == 0:
                    del self._retired[id(plan)]
                    plan.close()

    def _add(self, signature) -> _Entry:
        plan = self._build(signature)
        self.stats["builds"] += 1
        entry = _Entry(plan, plan_bytes(plan))
        self._entries[signature] = entry
        self.bytes += entry.nbytes
        self._evict(keep=signature)
        return entry

    def _evict(self, keep) -> None:
        while len(self._entries) > 1 and (len(self._entries) > self.max_plans or self.bytes > self.max_bytes):
            signature = next(iter(self._entries))
            if signature == keep:
                break
            entry = self._entries.pop(signature)
            self.bytes -= entry.nbytes
            self.stats["evictions"] += 1
            if entry.users:
                entry.retired = True
                self._retired[id(entry.plan)] = entry
            else:
                entry.plan.close()

    def close(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                entry.plan.close()
            self._entries.clear()
            for entry in self._retired.values():
                entry.plan.close()
            self._retired = {}
            self.bytes = 0


def plan_bytes(plan) -> int:
    """What a plan holds besides the shared constants: one arena per stream it ran on (at least
    one), and its private constants."""
    streams = max(1, len(getattr(plan, "_instances", ())))
    return int(plan.arena_bytes) * streams + int(getattr(plan, "const_bytes", 0))
