"""Property 6: a state machine over one Environment. Rules register and unregister example plugins
(ABI v1..v5), create sessions over a fixed pool of graphs (with or without graph capture, with
NULL Ep slots), run them, bind and run with IO binding (graph ids -1..3, malformed ids, sync or
not), release captured graphs and close or drop sessions. A model of the expected behaviour is
checked at every step, and invariants after each one: plugin objects alive match the open
sessions and registrations exactly, no status is left in the host, kernel contexts match the
sessions that ran.
"""

from __future__ import annotations

import gc
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from onnx import TensorProto, helper, numpy_helper

from host.errors import GraphCaptureError, InvalidArgument, PluginLoadError
from host.plugins import hostapi
from host.plugins.environment import Environment
from tests.conftest import built_plugin
from tests.property import harness as h
from tests.property import strategies as s


# ---- the pool of graphs -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolGraph:
    model: onnx.ModelProto
    inputs: dict[str, tuple[int, ...]]
    outputs: dict[str, tuple[int, ...]]
    nodes: dict[str, str]
    loose: bool = False


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v)) for k, v in outputs.items()],
        initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _pool() -> dict[str, PoolGraph]:
    rng = np.random.default_rng(1234)
    c23 = numpy_helper.from_array(rng.uniform(-1, 1, (2, 3)).astype(np.float32), "c23")
    w = numpy_helper.from_array(rng.uniform(-1, 1, (4, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.uniform(-1, 1, (3,)).astype(np.float32), "bias")
    shape = numpy_helper.from_array(np.array([3, 2], np.int64), "shape")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    c4 = numpy_helper.from_array(rng.uniform(-1, 1, (4,)).astype(np.float32), "c4")
    n = helper.make_node
    pool = {
        # Every node on ExampleEP: capture and replay possible.
        "chain": PoolGraph(_model([n("Add", ["X", "Y"], ["A"], name="add"), n("Relu", ["A"], ["B"], name="relu"),
                                   n("Mul", ["B", "X"], ["Z"], name="mul")],
                                  {"X": (2, 3), "Y": (2, 3)}, {"Z": (2, 3)}),
                           {"X": (2, 3), "Y": (2, 3)}, {"Z": (2, 3)}, {"add": "Add", "relu": "Relu", "mul": "Mul"}),
        "mlp": PoolGraph(_model([n("MatMul", ["X", "w"], ["M"], name="mm"), n("Add", ["M", "bias"], ["P"], name="badd"),
                                 n("Sigmoid", ["P"], ["Z"], name="sig")], {"X": (2, 4)}, {"Z": (2, 3), "P": (2, 3)},
                                [w, bias]),
                         {"X": (2, 4)}, {"Z": (2, 3), "P": (2, 3)}, {"mm": "MatMul", "badd": "Add", "sig": "Sigmoid"},
                         loose=True),
        # Some nodes on the CPU EP: capture must be refused (ALL_NODES_ON_EP).
        "mixed": PoolGraph(_model([n("Add", ["X", "c23"], ["A"], name="add"), n("Reshape", ["A", "shape"], ["R"], name="reshape"),
                                   n("Relu", ["R"], ["Z"], name="relu")], {"X": (2, 3)}, {"Z": (3, 2)}, [c23, shape]),
                           {"X": (2, 3)}, {"Z": (3, 2)}, {"add": "Add", "reshape": "Reshape", "relu": "Relu"}),
        "reduce": PoolGraph(_model([n("ReduceSum", ["X", "axes"], ["S"], name="rsum", keepdims=1),
                                    n("Mul", ["S", "c4"], ["Z"], name="mul")], {"X": (2, 3, 4)}, {"Z": (2, 1, 4)},
                                   [axes, c4]),
                            {"X": (2, 3, 4)}, {"Z": (2, 1, 4)}, {"rsum": "ReduceSum", "mul": "Mul"}, loose=True),
        # No node on ExampleEP at all.
        "transpose": PoolGraph(_model([n("Transpose", ["X"], ["Z"], name="tr", perm=[1, 0])], {"X": (2, 3)},
                                      {"Z": (3, 2)}),
                               {"X": (2, 3)}, {"Z": (3, 2)}, {"tr": "Transpose"}),
    }
    return pool


POOL = _pool()
CAPTURE_NULLABLE = ("Sync", "IsConcurrentRunSupported", "OnRunEnd", "ReplayGraphWithSync", "ReleaseCapturedGraph",
                    "IsGraphCaptured", "GetGraphCaptureNodeAssignmentPolicy")


@dataclass
class Tracked:
    """A session and what the model expects of it."""

    sess: object
    graph: str
    reg: str
    version: int
    negotiated: int
    null_slots: tuple[str, ...]
    state: str                       # harness.capture_state, "off" when ExampleEP has no node
    plugin_nodes: int
    binding: tuple | None = None     # (IOBinding, inputs, outputs)
    generation: int = 0              # bumped by every new binding
    captured: dict[int, int] = field(default_factory=dict)  # graph id -> binding generation
    captures: int = 0
    ran: bool = False


def _live(version: int) -> Counter:
    rec = h.record(version)
    return Counter(rec.live) if rec is not None else Counter()


class SessionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.env = None

    @initialize(host=s.versions, first=st.one_of(st.none(), s.versions), graph=st.sampled_from(["chain", "mlp"]),
                capture=st.sampled_from([True, True, False]))
    def start(self, host, first, graph, capture):
        gc.collect()
        self.host = host
        self.env = Environment(api_version=host)
        self.regs: dict[str, int] = {}          # registration name -> plugin version, in registration order
        self.sessions: list[Tracked] = []
        self.cpu: dict[str, object] = {}        # CPU EP sessions: the references
        self.base_live = {v: _live(v) for v in s.VERSIONS}
        self.base_statuses = len(hostapi.STATUSES)
        self.base_contexts = len(hostapi.CONTEXTS)
        if first is not None:  # most runs start with a plugin and a session, so that they get somewhere
            self.register(first)
            self.create(graph, capture, 1, ())  # chain and mlp run whole on ExampleEP: never refused
            t = self.sessions[-1]
            self.bind_session(t, 0)
            for i in range(2):  # a capture (where the versions allow it) and a replay
                self._bound_once(t, i, s.RunOpts(None, None), None)

    # -- helpers ---------------------------------------------------------------------------------
    def _feeds(self, graph: str, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {k: rng.uniform(-1, 1, v).astype(np.float32) for k, v in POOL[graph].inputs.items()}

    def _check(self, graph: str, got: list, feeds, what: str) -> None:
        cpu = self.cpu.get(graph)
        if cpu is None:
            cpu = self.cpu[graph] = h.session(POOL[graph].model, self.env, providers=[])
        want = cpu.run(None, feeds)
        tol = h.LOOSE if POOL[graph].loose else h.TIGHT
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, err_msg=what, **tol)

    def _pick(self, data) -> Tracked:
        pool = self.sessions
        # An index, not the object: hypothesis keeps drawn values for its report, and a session it
        # kept would outlive a `close(drop=True)`.
        return pool[data.draw(st.integers(0, len(pool) - 1), label="session index")]

    # -- plugins -----------------------------------------------------------------------------------
    @precondition(lambda self: self.env is not None and len(self.regs) < 3)
    @rule(version=s.versions)
    def register(self, version):
        name = f"ex{version}"
        if name in self.regs:
            with pytest.raises(InvalidArgument, match=rf"^a plugin is already registered as '{name}'"):
                self.env.register_plugin(name, built_plugin("example", version))
            return
        reg = self.env.register_plugin(name, built_plugin("example", version))
        assert reg.factories[0].negotiated == min(self.host, version)
        self.regs[name] = version

    @precondition(lambda self: self.env is not None and self.regs)
    @rule(data=st.data())
    def unregister(self, data):
        name = data.draw(st.sampled_from(sorted(self.regs)), label="registration")
        users = sum(t.reg == name for t in self.sessions)
        if users:
            with pytest.raises(PluginLoadError, match=rf"^plugin '{name}' \(.*\) is still used by {users} session\(s\); "
                                                      r"close them first$"):
                self.env.unregister_plugin(name)
            return
        self.env.unregister_plugin(name)
        del self.regs[name]

    # -- sessions ----------------------------------------------------------------------------------
    @precondition(lambda self: self.env is not None and len(self.sessions) < 4)
    @rule(graph=st.sampled_from(sorted(POOL)), capture=st.booleans(), min_runs=st.integers(0, 2),
          null_slots=st.lists(st.sampled_from(CAPTURE_NULLABLE), unique=True, max_size=2).map(tuple))
    def create(self, graph, capture, min_runs, null_slots):
        opts = h.with_null_slots({"min_runs": str(min_runs), **({"enable_graph": "1"} if capture else {})}, null_slots)
        pg = POOL[graph]
        if not self.regs:
            with pytest.raises(InvalidArgument, match=r"^execution provider 'ExampleEP' is not registered"):
                h.session(pg.model, self.env, opts)
            return
        name = next(iter(self.regs))  # the first registration that serves ExampleEP
        version = self.regs[name]
        negotiated = min(self.host, version)
        claimed = [n for n, op in pg.nodes.items() if op in s.EXAMPLE_EP_OPS]
        state = h.capture_state(negotiated, null_slots, opts)
        if state != "off" and len(claimed) < len(pg.nodes):  # also with no node on ExampleEP at all
            offending = [f"'{n}' ({op} on CPUExecutionProvider)" for n, op in pg.nodes.items() if n not in claimed]
            with pytest.raises(GraphCaptureError, match=r"^graph capture on ExampleEP requires all nodes on the EP; "
                                                        rf"offending node\(s\): {re.escape(', '.join(offending))}\. "):
                h.session(pg.model, self.env, opts)
            return
        sess = h.session(pg.model, self.env, opts)
        assert sess.capture.enabled is (state != "off")
        assert sess.node_assignment() == {n: ("ExampleEP" if n in claimed else "CPUExecutionProvider")
                                          for n in pg.nodes}
        self.sessions.append(Tracked(sess, graph, name, version, negotiated, null_slots, state, len(claimed)))

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), seed=st.integers(0, 2**16), ro=s.run_options,
          malformed=st.one_of(st.none(), s.malformed_graph_ids))
    def run(self, data, seed, ro, malformed):
        t = self._pick(data)
        feeds = self._feeds(t.graph, seed)
        if malformed is not None:
            with pytest.raises(InvalidArgument, match=r"^run option gpu_graph_id must be an integer >= -1"):
                t.sess.run(None, feeds, s.RunOpts(malformed, ro.disable_sync).make())
            return
        self._check(t.graph, t.sess.run(None, feeds, ro.make()), feeds, f"eager run of {t.graph} ({ro})")
        t.ran = True

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def bind(self, data, seed):
        self.bind_session(self._pick(data), seed)

    def bind_session(self, t: Tracked, seed: int) -> None:
        # The old binding goes (a new one may take its address: replays must still see the change).
        t.binding = h.bind(t.sess, self._feeds(t.graph, seed), POOL[t.graph].outputs)
        t.generation += 1

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), seed=st.integers(0, 2**16), ro=s.run_options,
          malformed=st.one_of(st.none(), st.none(), st.none(), s.malformed_graph_ids), repeat=st.integers(1, 3))
    def run_bound(self, data, seed, ro, malformed, repeat):
        """`repeat` bound runs with new data each (so that a capture is followed by replays)."""
        t = self._pick(data)
        if t.binding is None:
            self.bind_session(t, seed)
        for i in range(repeat):
            if not self._bound_once(t, seed + i, ro, malformed):
                break

    def _bound_once(self, t: Tracked, seed: int, ro: s.RunOpts, malformed: str | None) -> bool:
        b, ins, outs = t.binding
        feeds = self._feeds(t.graph, seed)
        h.refill(ins, feeds)
        for o in outs.values():
            o[...] = np.nan
        if malformed is not None:
            # Checked whether or not the session captures (the EP would get it in OnRunStart).
            with pytest.raises(InvalidArgument, match=r"^run option gpu_graph_id must be an integer >= -1"):
                t.sess.run_with_iobinding(b, s.RunOpts(malformed, ro.disable_sync).make())
            return False
        gid = None if t.state == "off" else ro.gid
        if gid is not None and gid in t.captured and t.captured[gid] != t.generation:
            with pytest.raises(GraphCaptureError, match=rf"^graph {gid} was captured with (input|output) '\w+' at a "
                                                        r"fixed buffer; it moved from address"):
                t.sess.run_with_iobinding(b, ro.make())
            return False
        captured_before = t.sess.fallbacks["graph_captured"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.sess.run_with_iobinding(b, ro.make())
        replayed = gid is not None and gid in t.captured
        if gid is not None and gid != -1 and not replayed:
            if t.state == "on":
                t.captured[gid] = t.generation
                t.captures += 1
            else:  # "never": no OnRunStart/OnRunEnd to capture in
                assert any(f"did not capture graph {gid}" in str(w.message) for w in caught)
        assert t.sess.fallbacks["graph_captured"] - captured_before == int(t.captured.get(gid) == t.generation
                                                                            and not replayed)
        t.ran = t.ran or not replayed
        event("bound run: " + ("replay" if replayed else "capture" if t.captured.get(gid) == t.generation
                               else "eager"))
        self._check(t.graph, [outs[n] for n in POOL[t.graph].outputs], feeds,
                    f"{'replayed' if replayed else 'bound'} run of {t.graph} ({ro})")
        return True

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), gid=st.integers(0, 3))
    def release(self, data, gid):
        t = self._pick(data)
        if t.state == "off":
            with pytest.raises(GraphCaptureError, match=r"^graph capture is not enabled for this session$"):
                t.sess.capture.release(gid)
        elif t.negotiated < 4 or "ReleaseCapturedGraph" in t.null_slots:
            with pytest.raises(GraphCaptureError, match=rf"^ExampleEP \(ABI v{t.negotiated}\) cannot release a single "
                                                        r"graph \(ReleaseCapturedGraph is v4\); close the session instead$"):
                t.sess.capture.release(gid)
        else:
            t.sess.capture.release(gid)
            event("release: " + ("a captured graph" if gid in t.captured else "nothing captured"))
            t.captured.pop(gid, None)
            assert not t.sess.capture.captured(gid)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), drop=st.booleans())
    def close(self, data, drop):
        t = self._pick(data)
        self.sessions.remove(t)
        if drop:  # left to the garbage collector: the finalizer closes it
            del t
            gc.collect()
        else:
            t.sess.close()
            t.sess.close()  # closing twice is fine

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def plugin_objects_match_the_model(self):
        if self.env is None:
            return
        for v in s.VERSIONS:
            mine = [t for t in self.sessions if t.version == v]
            got = {k: _live(v)[k] - self.base_live[v][k] for k in ("EpFactory", "Ep", "EpKernel", "EpDataTransfer",
                                                                     "EpSyncStream", "EpNotification")}
            want = {"EpFactory": int(f"ex{v}" in self.regs), "Ep": len(mine),
                    "EpKernel": sum(t.plugin_nodes for t in mine), "EpDataTransfer": len(mine),
                    "EpSyncStream": sum(t.ran and t.plugin_nodes > 0 for t in mine), "EpNotification": 0}
            assert got == want, f"plugin v{v}"

    @invariant()
    def no_status_left_and_contexts_match(self):
        if self.env is None:
            return
        assert len(hostapi.STATUSES) == self.base_statuses
        ran = sum(t.plugin_nodes for t in self.sessions if t.ran)
        assert len(hostapi.CONTEXTS) == self.base_contexts + ran

    def teardown(self):
        if self.env is None:
            return
        for t in self.sessions:
            t.sess.close()
        for c in self.cpu.values():
            c.close()
        self.sessions.clear()
        self.cpu.clear()
        gc.collect()
        self.env.close()
        for v in s.VERSIONS:
            assert +(_live(v) - self.base_live[v]) == Counter() and +(self.base_live[v] - _live(v)) == Counter(), \
                f"plugin v{v} objects alive after the Environment closed"
        assert len(hostapi.STATUSES) == self.base_statuses
        assert len(hostapi.CONTEXTS) == self.base_contexts


SessionMachine.TestCase.settings = settings(max_examples=s.budget(30), stateful_step_count=20, deadline=None)
test_session_machine = SessionMachine.TestCase
