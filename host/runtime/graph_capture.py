"""Graph capture orchestration: warm-up, capture, replay, annotation ids, asynchronous replay.

An EP takes part only when its v3 slots are present and IsGraphCaptureEnabled says yes. The
EP counts warm-up runs itself and captures in OnRunStart/OnRunEnd; the host drives the runs
(the first run_with_iobinding for an id runs as many times as the EP needs, bounded), checks the
node-assignment policy once, and replays afterwards. Unlike ONNX Runtime, a replay whose bound
buffers differ from the captured ones is an error instead of stale results.
"""

from __future__ import annotations

import logging
import threading
import weakref

import numpy as np

import abi
from host.errors import GraphCaptureError, InvalidArgument
from host.plugins import hostapi
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
    return gid


def run_flags(ro) -> tuple[int, bool]:
    """(gpu_graph_id, synchronize at the end) of RunOptions `ro`, parsed once and cached on it
    (RunOptions drops the cache when an entry changes)."""
    parsed = ro.parsed
    if parsed is None:
        parsed = ro.parsed = (parse_graph_id(ro._get("gpu_graph_id")),
                              ro._get("disable_synchronize_execution_providers") != "1")
    return parsed


class GraphCapture:
    """Per-session capture state: the capturing EP, captured ids and their bindings.

    `run_bound(binding, run_options, graph_id)` is the session's eager run of a binding (warm-up and
    capture runs go through it); `lock` serialises replays where the session serialises runs."""

    def __init__(self, eps: list, plan, fallbacks, run_bound, lock: threading.Lock | None):
        self.plan = plan
        self.fallbacks = fallbacks
        self._run_bound = run_bound
        self._lock = lock
        self.ep = None
        self.enabled = False
        # Graphs belong to the thread that captured them (the EP replays on that thread's stream).
        self._signatures: dict[tuple[int, int], dict[str, tuple]] = {}
        # (binding serial, version) last found equal to a graph's signature: replays skip the re-check.
        self._verified: dict[tuple[int, int], tuple[int, int]] = {}
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
        for n in plan.nodes:
            if n.ep is self.ep:
                continue
            shape_only = all(plan.elem_types[v] in SHAPE_ELEM_TYPES for v in n.outputs if v >= 0)
            if policy == abi.GRAPH_ALLOW_CPU_FOR_SHAPES and n.ep is None and shape_only:
                continue
            where = n.ep.name if n.ep is not None else "CPUExecutionProvider"
            offending.append(f"'{n.name}' ({n.op_type} on {where})")
        if offending:
            rule = ("all nodes on the EP" if policy == abi.GRAPH_ALL_NODES_ON_EP
                    else "only shape computations (int64 outputs) on the CPU")
            raise GraphCaptureError(
                f"graph capture on {self.ep.name} requires {rule}; offending node(s): {', '.join(offending)}. "
                f"Disable graph capture or make the EP support these nodes")

    @property
    def signatures(self) -> dict[int, dict[str, tuple]]:
        """Captured graph ids of the calling thread and the bindings they were captured with."""
        tid = self._thread()
        return {gid: sig for (t, gid), sig in self._signatures.items() if t == tid}

    def _thread(self) -> int:
        """A key for the calling thread. Not threading.get_ident(), which a new thread can inherit
        from a dead one: a token in thread-local storage, whose entries go when the thread does."""
        token = getattr(self._tls, "token", None)
        if token is None:
            token = self._tls.token = _ThreadToken()
            weakref.finalize(token, _forget_thread, self._signatures, self._verified, id(token))
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
        # A signature is recorded only once the EP reports the graph captured and is dropped when
        # it is released: no IsGraphCaptured crossing per replay.
        if key in self._signatures:
            self._replay(binding, parsed[1], gid, key)
            return
        self._require_bound_outputs(binding)
        for _ in range(MAX_INTERNAL_RUNS):
            self._run_bound(binding, ro, str(gid))
            if self.captured(gid):
                self._signatures[self._key(gid)] = self._signature(binding)
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

    def _check_binding(self, binding, gid: int) -> None:
        self._require_bound_outputs(binding)
        now = self._signature(binding)
        then = self._signatures[self._key(gid)]
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

    def _replay(self, binding, sync: bool, gid: int, key) -> None:
        stamp = (binding.serial, binding.version)
        if self._verified.get(key) != stamp:
            self._check_binding(binding, gid)
            self._verified[key] = stamp
        ep = self.ep
        lock = self._lock
        if lock is not None:
            lock.acquire()
        try:
            if ep.slots.ReplayGraphWithSync is not None:
                status = ep.slots.ReplayGraphWithSync(ep.ptr, gid, int(sync))
                if status != hostapi.ffi.NULL:  # the message is built only on failure
                    hostapi.check(status, f"{ep.owner}: ReplayGraphWithSync")
                self.fallbacks["replay_stream_sync" if sync else "replay_async"] += 1
            else:
                hostapi.check(ep.slots.ReplayGraph(ep.ptr, gid), f"{ep.owner}: ReplayGraph")
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
        """Free graph `gid` and its memory (v4 ReleaseCapturedGraph); the next run captures again."""
        if not self.enabled:
            raise GraphCaptureError("graph capture is not enabled for this session")
        fn = self.ep.slots.ReleaseCapturedGraph
        if fn is None:
            raise GraphCaptureError(f"{self.ep.name} (ABI v{self.ep.slots.negotiated}) cannot release a single "
                                    "graph (ReleaseCapturedGraph is v4); close the session instead")
        hostapi.check(fn(self.ep.ptr, gid), f"{self.ep.owner}: ReleaseCapturedGraph")
        self._signatures.pop(self._key(gid), None)
        self._verified.pop(self._key(gid), None)

    def close(self) -> None:
        if self.enabled and self.ep.slots.ReleaseCapturedGraph is not None:
            for gid in list(self.signatures):
                try:
                    self.release(gid)
                except Exception as exc:  # noqa: BLE001 - closing must go on
                    _log.warning("releasing graph %s failed: %s", gid, exc)
        # Graphs of other threads go with the EP, which the session releases next.
        self._signatures.clear()
        self._verified.clear()


class _ThreadToken:
    __slots__ = ("__weakref__",)


def _forget_thread(signatures: dict, verified: dict, tid: int) -> None:
    for d in (signatures, verified):
        for key in [k for k in d if k[0] == tid]:
            d.pop(key, None)
