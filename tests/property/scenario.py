"""A generated scenario with ExampleEP, the driver that plays it, and a model of what it makes
the host and the plugin do (runs, kernel calls, captures, replays), for the gating and fallback
properties.

A scenario: one Environment (host API version), one registration of the example plugin (ABI
version), one session over a random graph with random valid options and NULL Ep slots, some
eager runs (from 1..3 threads), then bound runs with random run options (graph ids -1..3,
synchronised or not).
"""

from __future__ import annotations

import tempfile
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from hypothesis import strategies as st

import abi
from host.errors import GraphCaptureError
from host.runtime.session import InferenceSession
from tests.context_files import edit_contexts
from tests.property import harness as h
from tests.property import strategies as s

MAX_INTERNAL_RUNS = 16  # host/runtime/graph_capture.py: runs the host drives before giving up on a capture


@dataclass
class Scenario:
    case: s.Case
    host: int
    plugin: int
    null_slots: tuple[str, ...]
    opts: dict[str, str]
    eager_runs: int
    threads: int
    bound_runs: list[s.RunOpts]
    context: str = ""  # ABI v7: "" (a plain model) or how the session's model was saved first (CONTEXT_MODES)

    @property
    def negotiated(self) -> int:
        return min(self.host, self.plugin)

    def ep_has(self, slot: str) -> bool:
        """The host may call Ep.`slot`: it exists at the negotiated version and is not NULL."""
        return abi.since("Ep", slot) <= self.negotiated and slot not in self.null_slots

    @property
    def plugin_nodes(self) -> int:
        ops = h.claimed_ops(self.opts)
        return sum(op in ops for op in self.case.nodes.values())

    @property
    def capture(self) -> str:
        return h.capture_state(self.negotiated, self.null_slots, self.opts)

    @property
    def refused(self) -> bool:
        """Session creation must fail: capture on, and a node off ExampleEP (ALL_NODES_ON_EP)."""
        return self.capture != "off" and not self.case.claimable_by(h.claimed_ops(self.opts))

    @property
    def min_runs(self) -> int:
        return int(self.opts.get("min_runs", "2"))


@st.composite
def scenarios(draw, host=s.versions, plugin=s.versions, null_slots=s.null_slot_sets) -> Scenario:
    graph = draw(st.booleans())
    # Graphs ExampleEP takes whole are drawn more often when capture is asked for.
    case = draw(s.elementwise_graphs(max_nodes=4) if graph and draw(st.booleans()) else s.graphs(max_nodes=4))
    opts = draw(s.example_ep_options(graph=graph))
    nulls = draw(null_slots)
    # v6: ExampleEP fuses, and its groups fail to compile or its Compile slot is NULL, so that the
    # per-node fallback (what the fallback table is about) runs; compiled runs are property 1's.
    v6 = draw(st.sampled_from(["none", "none", "fail", "null"]))
    if v6 == "fail":
        opts.update(fuse="1", compile_fails="all")
    elif v6 == "null":
        opts["fuse"] = "1"
        nulls = tuple(sorted(set(nulls) | {"Compile"}))
    elif "Compile" not in nulls:
        opts.pop("fuse", None)
    return Scenario(case, draw(host), draw(plugin), nulls, opts, draw(st.integers(0, 2)), draw(st.integers(1, 3)),
                    draw(st.lists(s.run_options, max_size=4)))


@dataclass
class Events:
    """What the model says the scenario does."""

    computes: int = 0                       # plugin kernel Compute calls
    replays: list[bool] = field(default_factory=list)  # one entry per replay: its sync flag
    captured: int = 0
    gave_up: int = 0
    created: bool = True


def model(sc: Scenario) -> Events:
    ev = Events()
    if sc.refused:
        ev.created = False
        return ev
    n = 0 if compiled(sc) else sc.plugin_nodes  # a compiled partition runs without per-node kernels
    ev.computes += n * sc.eager_runs * sc.threads
    state = sc.capture  # refused above when it is on and ExampleEP lacks a node
    counts: dict[int, int] = {}
    graphs: set[int] = set()
    for ro in sc.bound_runs:
        if state == "off" or ro.gid == -1:
            ev.computes += n
            continue
        gid = ro.gid
        if gid in graphs:
            ev.replays.append(ro.sync)
            continue
        for _ in range(MAX_INTERNAL_RUNS):
            ev.computes += n
            if state == "on":
                counts[gid] = counts.get(gid, 0) + 1
                if counts[gid] > sc.min_runs:
                    graphs.add(gid)
                    ev.captured += 1
                    break
        else:
            ev.gave_up += 1
    return ev


def compiled(sc: Scenario) -> bool:
    """ExampleEP compiles every node it runs (fuse=1, n >= 6, Compile present and succeeding)."""
    return (sc.opts.get("fuse") == "1" and sc.negotiated >= abi.since("Ep", "Compile")
            and not sc.opts.get("compile_fails") and "Compile" not in sc.null_slots)


# ABI v7 context scenarios: the model is first saved by a session with ep.context_enable=1, then
# (damaged or not) loaded by the session the scenario plays.
# "external": saved with ep.context_embed_mode=0 (each blob a file beside the model), then reloaded.
CONTEXT_MODES = ("reload", "external", "corrupt", "truncated")


def save_context_model(sc: Scenario, env, folder: Path) -> tuple[Path, Counter]:
    """The scenario's model saved with its contexts (damaged as sc.context says), and the context
    counters of the saving session; the plugin Record is left as it was before (the saving session
    is not what the scenario models)."""
    rec = h.record(sc.plugin)
    before = (Counter(rec.fallbacks), Counter(rec.slot_calls))
    source, target = folder / "model.onnx", folder / "model_ctx.onnx"
    onnx.save(sc.case.model, str(source))
    so = h.session_options()
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(target))
    if sc.context == "external":
        so.add_session_config_entry("ep.context_embed_mode", "0")
    opts = h.with_null_slots(sc.opts, sc.null_slots)
    with InferenceSession(str(source), so, providers=[(h.EXAMPLE_EP, opts)], env=env) as saver:
        counters = Counter({k: v for k, v in saver.fallbacks.items() if k.startswith("context_")})
    for counter, old in zip((rec.fallbacks, rec.slot_calls), before):
        counter.clear()
        counter.update(old)
    if sc.context in ("corrupt", "truncated"):
        damage(target, sc.context)
    return target, counters


def damage(path: Path, how: str) -> None:
    """Overwrite every EPContext blob of the model at `path` (embedded, or the file beside it that
    the node names): garbage bytes, or its first half."""
    edit_contexts(path, lambda blob: blob[:len(blob) // 2] if how == "truncated" else bytes(range(256)) * 3)


@dataclass
class Outcome:
    session_fallbacks: Counter
    record_fallbacks: Counter
    slot_calls: Counter
    created: bool


def play(sc: Scenario, env, refs: h.References | None = None) -> Outcome:
    """Run the scenario in `env` (the plugin registered, its record cleared before registration).
    With `refs`, every output is compared with the references: eager runs alternate the two feed
    sets, and every bound run first copies the other feed set into the bound inputs and NaNs into
    the bound outputs, so that a replay of a stale graph or one that writes nothing is caught."""
    if not sc.context:
        return _play(sc, env, refs, sc.case, Counter())
    with tempfile.TemporaryDirectory() as tmp:
        model, saved = save_context_model(sc, env, Path(tmp))
        return _play(sc, env, refs, str(model), saved)


def _play(sc: Scenario, env, refs, model, saved: Counter) -> Outcome:
    rec = h.record(sc.plugin)
    try:
        sess = h.session(model, env, h.with_null_slots(sc.opts, sc.null_slots))
    except GraphCaptureError:
        if not sc.refused:
            raise
        return Outcome(Counter(), Counter(rec.fallbacks), Counter(rec.slot_calls), False)
    feeds = [sc.case.feeds, sc.case.feeds2]
    try:
        errors: list[BaseException] = []

        def eager() -> None:
            try:
                for i in range(sc.eager_runs):
                    got = sess.run(None, feeds[i % 2])
                    if refs is not None:
                        refs.check(got, feeds[i % 2], f"eager run {i}")
            except BaseException as exc:  # noqa: BLE001 - raised by the main thread
                errors.append(exc)

        ts = [threading.Thread(target=eager) for _ in range(sc.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        b, ins, outs = h.bind(sess, sc.case.feeds, sc.case.outputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "did not capture graph": counted instead
            for i, ro in enumerate(sc.bound_runs):
                if refs is not None:
                    h.refill(ins, feeds[(i + 1) % 2])
                    for o in outs.values():
                        o[...] = np.nan
                sess.run_with_iobinding(b, ro.make())
                if refs is not None:
                    refs.check([outs[n] for n in refs.names], feeds[(i + 1) % 2], f"bound run {i} ({ro})")
        # frame_* are the compiled call frame's statistics (test_fused_claims checks them), not fallbacks.
        plugin = Counter({k: v for k, v in rec.fallbacks.items() if not k.startswith("frame_")})
        return Outcome(Counter(sess.fallbacks) + saved, plugin, Counter(rec.slot_calls), True)
    finally:
        sess.close()
