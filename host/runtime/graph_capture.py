"""Graph capture orchestration: warm-up, capture, replay, annotation ids, asynchronous replay.

An EP takes part only when its v3 slots are present and IsGraphCaptureEnabled says yes. The
EP counts warm-up runs itself and captures in OnRunStart/OnRunEnd; the host drives the runs
(the first run_with_iobinding for an id runs as many times as the EP needs, bounded), checks the
node-assignment policy once, and replays afterwards. Each input-shape signature under an id gets its
own graph (host/runtime/shape_graphs.py). Unlike ONNX Runtime, a replay whose bound buffers moved
from the captured ones is an error instead of stale results.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import numpy as np

import abi
from host.errors import GraphCaptureError, InvalidArgument
from host.plugins import hostapi
from host.runtime import shape_graphs
from host.runtime.shape_graphs import Graph, GraphsOfId
from host.runtime.warn import warn_caller

_log = logging.getLogger("ephost")
MAX_INTERNAL_RUNS = 16
SHAPE_ELEM_TYPES = {7}  # int64: what shape arithmetic produces


def _signature_of(value) -> tuple:
    if isinstance(value, np.ndarray):
        return (int(value.__array_interface__["data"][0]), tuple(value.shape), value.dtype.str)
    return (int(value.ptr), tuple(value.shape), value.dtype.str)


def parse_graph_id(value: str | None) -> int:
    if value is None:
        return 0
    try:
        gid = int(value)
    except (TypeError, ValueError):
        gid = None
    if gid is None or gid < -1:
        raise InvalidArgument(f"run option gpu_graph_id must be an integer >= -1 (-1 runs without capture); "
                              f"got {value!r}")
    if gid >= shape_graphs.INTERNAL_BASE:
        raise InvalidArgument(f"run option gpu_graph_id must be an integer >= -1 and < {shape_graphs.INTERNAL_BASE} "
                              f"(larger ids name the per-shape graphs ephost captures itself); got {value!r}")
    return gid


def run_flags(ro) -> tuple[int, bool]:
    """(gpu_graph_id, synchronize at the end) of RunOptions `ro`, parsed once and cached on it
    (RunOptions drops the cache when an entry changes)."""
    parsed = ro.parsed
    if parsed is None:
        parsed = ro.parsed = (parse_graph_id(ro._get("gpu_graph_id")),
                              ro._get("disable_synchronize_execution_providers") != "1")
    return parsed


def _shape_only(plan, node, shape_values: set[int]) -> bool:
    """A CPU node a replay may skip: int64 outputs computed only from input shapes (Shape, Size) or
    from constants, the host's shape-program values and other such nodes, so the values it gave at
    capture hold for every replay of that input-shape signature's graph."""
    if not all(plan.elem_types[v] in SHAPE_ELEM_TYPES for v in node.outputs if v >= 0):
        return False
    return node.op_type in ("Shape", "Size") or all(v < 0 or v in shape_values for v in node.inputs)


class GraphCapture:
    """Per-session capture state: the capturing EP and, per thread and gpu_graph_id, its graphs by shape.

    `run_bound(binding, run_options, graph_id)` is the session's eager run of a binding (warm-up and
    capture runs go through it); `lock` serialises replays where the session serialises runs;
    `per_id` bounds the graphs per id (shape_graphs.capacity: 0 is one graph per id, strictly)."""

    def __init__(self, eps: list, plan, fallbacks, run_bound, lock: threading.Lock | None,
                 per_id: int = shape_graphs.DEFAULT_GRAPHS_PER_ID):
        self.plan = plan
        self.fallbacks = fallbacks
        self._run_bound = run_bound
        self.keep_copies = contextlib.nullcontext  # the session's executor.keeping_copies
        self._lock = lock
        self.per_id = per_id
        self.ep = None
        self.enabled = False
        # Graphs belong to the thread that captured them (the EP replays on that thread's stream).
        self._graphs: dict[tuple[int, int], GraphsOfId] = {}
        # (binding serial, version) last found equal to a graph's binding, and that graph: replays skip
        # the re-check and the shape signature.
        self._verified: dict[tuple[int, int], tuple[tuple[int, int], Graph]] = {}
        self._tls = threading.local()
        # Every EP the session asked for, also one that got no node: capture was asked of it, and
        # its policy decides whether a session without it on the EP is allowed.
        for ep in eps:
            if ep.slots.negotiated < 3:
                fallbacks["no_graph_capture"] += 1
            elif ep.graph_capture_enabled():
                self.ep = ep
        if self.ep is not None:
            self._validate_policy()
            self.enabled = True

    def _validate_policy(self) -> None:
        policy = self.ep.graph_policy()
        plan = self.plan
        offending = []
        shape_values = set(plan.constants) | set(plan.host_computed)
        for n in plan.nodes:
            if n.ep is self.ep:
                continue
            if policy == abi.GRAPH_ALLOW_CPU_FOR_SHAPES and n.ep is None and _shape_only(plan, n, shape_values):
                shape_values.update(v for v in n.outputs if v >= 0)
                continue
            where = n.ep.name if n.ep is not None else "CPUExecutionProvider"
            offending.append(f"'{n.name}' ({n.op_type} on {where})")
        if offending:
            rule = ("all nodes on the EP" if policy == abi.GRAPH_ALL_NODES_ON_EP
                    else "only shape computations (int64 outputs of shapes and constants) on the CPU")
            raise GraphCaptureError(
                f"graph capture on {self.ep.name} requires {rule}; offending node(s): {', '.join(offending)}. "
                f"Disable graph capture or make the EP support these nodes")

    @property
    def signatures(self) -> dict[int, dict[str, tuple]]:
        """Captured graph ids of the calling thread and the binding of each id's most recently used graph."""
        tid = self._thread()
        out = {}
        for (t, gid), graphs in self._graphs.items():
            graph = graphs.newest_captured() if t == tid else None
            if graph is not None:
                out[gid] = graph.binding
        return out

    def graphs(self, gid: int = 0) -> dict[tuple, int]:
        """The calling thread's captured graphs under `gid`: shape signature -> the EP's graph id, least
        recently used first."""
        graphs = self._graphs.get(self._key(gid))
        if graphs is None:
            return {}
        return {shape: g.internal_id for shape, g in graphs.by_shape.items() if g.binding is not None}

    def _thread(self) -> int:
        """A key for the calling thread. Not threading.get_ident(), which a new thread can inherit
        from a dead one: a token in thread-local storage, whose entries go when the thread does."""
        token = getattr(self._tls, "token", None)
        if token is None:
            token = self._tls.token = _ThreadToken()
            weakref.finalize(token, _forget_thread, self._graphs, self._verified, id(token))
        return id(token)

    def _key(self, gid: int) -> tuple[int, int]:
        return (self._thread(), gid)

    # -- runs --------------------------------------------------------------------------------------
    def captured(self, gid: int) -> bool:
        return self.ep._flag(self.ep.slots.IsGraphCaptured(self.ep.ptr, gid), "Ep.IsGraphCaptured")  # 0 or 1 only

    def run(self, binding, ro) -> None:
        parsed = run_flags(ro)  # validated whether or not this session captures
        if not self.enabled:
            self._run_bound(binding, ro)
            return
        gid = parsed[0]
        if gid == -1:
            self._run_bound(binding, ro, "-1")
            return
        key = self._key(gid)
        # The binding replayed last under this id, unchanged since: no signature, no IsGraphCaptured crossing.
        seen = self._verified.get(key)
        if seen is not None and seen[0] == (binding.serial, binding.version) and seen[1].binding is not None:
            self._graphs[key].touch(seen[1])
            self._replay(binding, parsed[1], seen[1].internal_id)
            return
        self._require_bound_outputs(binding)
        graphs = self._graphs.get(key)
        if graphs is None:
            graphs = self._graphs[key] = GraphsOfId(gid, self.per_id)
        shape = shape_graphs.shape_signature(binding)
        graph = graphs.get(shape)
        if graph is None:
            self._refuse_unless_new_shape(binding, gid, graphs)
        if graph is not None and graph.binding is not None:
            self._check_binding(binding, gid, graph)
            self._verified[key] = ((binding.serial, binding.version), graph)
            self._replay(binding, parsed[1], graph.internal_id)
            return
        graph = graph or self._new_graph(key, graphs, shape)
        if graph is None:
            self._run_bound(binding, ro, "-1")  # no room and nothing the EP can release: eager
            return
        self._capture(binding, ro, gid, graph)

    def _refuse_unless_new_shape(self, binding, gid: int, graphs: GraphsOfId) -> None:
        """A binding that matches no graph of the id captures a new one only when it binds every model input
        (an unbound input is not a shape) and the session keeps graphs per shape; otherwise it gets the
        error against the id's last captured binding."""
        last = graphs.newest_captured()
        if last is None:
            return
        if self.per_id == 0 or binding.inputs.keys() != self.plan.input_ids.keys():
            self._check_binding(binding, gid, last)

    def _new_graph(self, key, graphs: GraphsOfId, shape: tuple) -> Graph | None:
        """A graph for a new shape under `graphs`' id, evicting (and releasing) the least recently used
        one when the id holds its bound; None when full and the EP cannot release a graph (ABI v3)."""
        if not graphs.full:
            return graphs.add(shape)
        release = self.ep.slots.ReleaseCapturedGraph
        if release is None:
            self.fallbacks["graphs_per_id_full_eager"] += 1
            if self.fallbacks["graphs_per_id_full_eager"] == 1:
                warn_caller(f"{self.ep.name} (ABI v{self.ep.slots.negotiated}) cannot release a captured graph, "
                            f"and gpu_graph_id {graphs.gid} holds {graphs.limit} ('{shape_graphs.CONFIG_KEY}'); "
                            "new input shapes under it run eagerly")
            return None
        old = graphs.oldest()
        hostapi.check(release(self.ep.ptr, old.internal_id), f"{self.ep.owner}: ReleaseCapturedGraph")
        self.fallbacks["graph_evicted"] += 1
        seen = self._verified.get(key)
        if seen is not None and seen[1] is old:
            del self._verified[key]
        return graphs.evict(shape)

    def _capture(self, binding, ro, gid: int, graph: Graph) -> None:
        """Warm-up and capture runs under the graph's internal id, until the EP reports it captured."""
        iid = graph.internal_id
        for _ in range(MAX_INTERNAL_RUNS):
            # Copies the host makes for the EP during these runs (CPU shape values read on the
            # device) are read again by every replay: they live as long as the graph.
            with self.keep_copies(graph.copies):
                self._run_bound(binding, ro, str(iid))
            if self.captured(iid):
                graph.binding = self._signature(binding)
                self.fallbacks["graph_captured"] += 1
                return
        self.fallbacks["capture_not_reached"] += 1
        warn_caller(f"{self.ep.name} did not capture graph {gid} within {MAX_INTERNAL_RUNS} runs; running eagerly")

    def _require_bound_outputs(self, binding) -> None:
        unbound = [n for n in binding.output_names() if binding.outputs.get(n) is None]
        if unbound:
            raise GraphCaptureError(
                f"graph capture needs every output bound to a fixed buffer; unbound: {unbound}. "
                "Bind them with IOBinding.bind_output(name, buffer), or run with gpu_graph_id=-1")

    def _signature(self, binding) -> dict[str, tuple]:
        sig = {f"input '{k}'": _signature_of(v) for k, v in binding.inputs.items()}
        sig.update({f"output '{k}'": _signature_of(v) for k, v in binding.outputs.items() if v is not None})
        return sig

    def _check_binding(self, binding, gid: int, graph: Graph) -> None:
        now = self._signature(binding)
        then = graph.binding
        for key in sorted(set(then) | set(now)):
            a, b = then.get(key), now.get(key)
            if a == b:
                continue
            what = ("is no longer bound" if b is None else "was not bound at capture" if a is None
                    else f"moved from address {a[0]:#x} to {b[0]:#x}" if a[0] != b[0]
                    else f"changed shape/dtype from {a[1]}/{a[2]} to {b[1]}/{b[2]}")
            raise GraphCaptureError(
                f"graph {gid} was captured with {key} at a fixed buffer; it {what}. Copy new data into "
                f"the bound buffer instead of rebinding, or use another gpu_graph_id")

    def _replay(self, binding, sync: bool, iid: int) -> None:
        ep = self.ep
        lock = self._lock
        if lock is not None:
            lock.acquire()
        try:
            if ep.slots.ReplayGraphWithSync is not None:
                status = ep.slots.ReplayGraphWithSync(ep.ptr, iid, int(sync))
                if status != hostapi.ffi.NULL:  # the message is built only on failure
                    hostapi.check(status, f"{ep.owner}: ReplayGraphWithSync")
                self.fallbacks["replay_stream_sync" if sync else "replay_async"] += 1
            else:
                hostapi.check(ep.slots.ReplayGraph(ep.ptr, iid), f"{ep.owner}: ReplayGraph")
                if sync and ep.slots.Sync is not None:
                    hostapi.check(ep.slots.Sync(ep.ptr), f"{ep.owner}: Sync")
                self.fallbacks["replay_device_sync" if sync else "replay_async"] += 1
        finally:
            if lock is not None:
                lock.release()
        if binding._results.keys() != binding.outputs.keys():
            binding._results = {n: binding.outputs.get(n) for n in binding.output_names()}

    # -- release -----------------------------------------------------------------------------------
    def release(self, gid: int) -> None:
        """Free the graphs of `gid` (every shape's) and their memory (v4 ReleaseCapturedGraph); the next
        run captures again."""
        if not self.enabled:
            raise GraphCaptureError("graph capture is not enabled for this session")
        fn = self.ep.slots.ReleaseCapturedGraph
        if fn is None:
            raise GraphCaptureError(f"{self.ep.name} (ABI v{self.ep.slots.negotiated}) cannot release a single "
                                    "graph (ReleaseCapturedGraph is v4); close the session instead")
        key = self._key(gid)
        graphs = self._graphs.get(key)
        for iid in (graphs.internal_ids() if graphs is not None and graphs.by_shape else [gid]):
            hostapi.check(fn(self.ep.ptr, iid), f"{self.ep.owner}: ReleaseCapturedGraph")
        self._graphs.pop(key, None)
        self._verified.pop(key, None)

    def forget(self, binding) -> None:
        """Release the calling thread's graphs captured on `binding`'s buffers, which are about to be freed
        (host/runtime/bucket_graphs.py evicting a staging entry)."""
        shape, sig, tid = shape_graphs.shape_signature(binding), self._signature(binding), self._thread()
        for key, graphs in list(self._graphs.items()):
            graph = graphs.by_shape.get(shape) if key[0] == tid else None
            if graph is None or graph.binding != sig:
                continue
            graphs.remove(shape)
            hostapi.check(self.ep.slots.ReleaseCapturedGraph(self.ep.ptr, graph.internal_id),
                          f"{self.ep.owner}: ReleaseCapturedGraph")
            self.fallbacks["graph_evicted"] += 1
            seen = self._verified.get(key)
            if seen is not None and seen[1] is graph:
                del self._verified[key]

    def close(self) -> None:
        if self.enabled and self.ep.slots.ReleaseCapturedGraph is not None:
            for gid in list(self.signatures):
                try:
                    self.release(gid)
                except Exception as exc:  # noqa: BLE001 - closing must go on
                    _log.warning("releasing graph %s failed: %s", gid, exc)
        # Graphs of other threads go with the EP, which the session releases next.
        self._graphs.clear()
        self._verified.clear()


class _ThreadToken:
    __slots__ = ("__weakref__",)


def _forget_thread(graphs: dict, verified: dict, tid: int) -> None:
    for d in (graphs, verified):
        for key in [k for k in d if k[0] == tid]:
            d.pop(key, None)
