"""Property 8: state reused across calls.

Where the other properties build fresh objects for every call, these keep them: one RunOptions
reused across eager and bound runs, graph ids and sync modes (its entries changed in between);
one IOBinding rebound after a replay (inputs and outputs, to new buffers or to the same ones);
eager runs on a capture-enabled session before its capture. A model says what each call must do
(run eagerly, warm up and capture, replay, or refuse a moved binding) and every output is compared
with the references, after copying fresh data into the bound inputs and NaNs into the outputs.
"""

from __future__ import annotations

import collections
import glob
import json
import re
import tempfile
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from abi import sdk
from host.errors import GraphCaptureError
from host.plugins.hostapi import ffi
from host.runtime.session import RunOptions
from tests.property import fallback_table as ft
from tests.property import harness as h
from tests.property import strategies as s

pytestmark = pytest.mark.filterwarnings("ignore:ExampleEP did not capture graph:RuntimeWarning")

# Steps: ("gid", "-1".."2") and ("sync", "0"/"1") change the one RunOptions; ("eager",) runs
# sess.run with it; ("bound",) runs the one IOBinding with it; ("rebind", what) rebinds.
REBINDS = ("input_new", "input_same", "input_back", "output_new", "output_same", "output_back")
step = st.one_of(
    st.tuples(st.just("gid"), st.sampled_from(["-1", "0", "1", "2"])),
    st.tuples(st.just("sync"), st.sampled_from(["0", "1"])),
    st.tuples(st.just("eager")),
    st.tuples(st.just("bound")),
    st.tuples(st.just("bound")),
    st.tuples(st.just("rebind"), st.sampled_from(REBINDS)),
    st.tuples(st.just("check"), st.sampled_from(["unbind_inputs", "reshape_output"])),
)


@dataclass
class Model:
    """What the host and ExampleEP must do with one session, one RunOptions and one IOBinding."""

    nodes: int
    min_runs: int
    gid: int = 0
    sync: bool = True
    captured: dict[int, dict[str, int]] = field(default_factory=dict)  # gid -> buffer ids at capture
    computes: int = 0
    replays: int = 0
    sync_replays: int = 0
    eager_calls: int = 0
    bound_calls: int = 0  # run_with_iobinding calls, refused ones included


@dataclass
class Buffers:
    """The arrays the binding holds now, the original ones, and every array ever bound (kept
    alive, so that no new array can take the address of an old one)."""

    bound: dict[str, np.ndarray]
    original: dict[str, np.ndarray]
    alive: list = field(default_factory=list)
    inputs: tuple = ()  # names of the bound inputs

    def ids(self) -> dict[str, tuple]:
        """What a capture records of each bound buffer: (address, shape, dtype), keyed as the host's
        messages name it."""
        return {f"{'input' if k in self.inputs else 'output'} '{k}'":
                (v.__array_interface__["data"][0], tuple(v.shape), v.dtype.str) for k, v in self.bound.items()}


def _rebind(b, bufs: Buffers, what: str, case) -> None:
    kind, how = what.split("_")
    names = list(case.feeds) if kind == "input" else list(case.outputs)
    name = names[0]
    if how == "new":
        arr = np.zeros_like(bufs.bound[name])
        bufs.alive.append(arr)
    elif how == "same":
        arr = bufs.bound[name]
    else:
        arr = bufs.original[name]
    bufs.bound[name] = arr
    (b.bind_input if kind == "input" else b.bind_output)(name, arr)


def play(case, version: int, min_runs: int, steps, refs: h.References, profile: bool = False) -> None:
    """The steps on one session; with `profile`, profiling on (its run path is a separate branch)."""
    with tempfile.TemporaryDirectory() as tmp:
        m = _play(case, version, min_runs, steps, refs, f"{tmp}/trace_" if profile else None)
        if profile:
            (path,) = glob.glob(f"{tmp}/trace_*.json")
            with open(path, encoding="utf-8") as f:
                runs = [e.get("args") for e in json.load(f) if e["name"] == "model_run"]
            assert sorted(runs, key=str) == sorted([None] * m.eager_calls + [{"iobinding": True}] * m.bound_calls,
                                                   key=str)


def _play(case, version: int, min_runs: int, steps, refs: h.References, profile_prefix: str | None) -> Model:
    feeds = [case.feeds, case.feeds2]
    m = Model(len(case.nodes), min_runs)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": str(min_runs)}, profile_prefix=profile_prefix)
        try:
            ro = RunOptions()
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            bufs = Buffers({**ins, **outs}, {**ins, **outs})
            bufs.inputs = tuple(ins)
            for i, st_ in enumerate(steps):
                data = feeds[i % 2]
                if st_[0] == "gid":
                    ro.add_run_config_entry("gpu_graph_id", st_[1])
                    m.gid = int(st_[1])
                elif st_[0] == "sync":
                    ro.add_run_config_entry("disable_synchronize_execution_providers", st_[1])
                    m.sync = st_[1] != "1"
                elif st_[0] == "eager":
                    refs.check(sess.run(None, data, ro), data, f"step {i}: eager run with the shared RunOptions")
                    m.computes += m.nodes
                    m.eager_calls += 1
                elif st_[0] == "rebind":
                    _rebind(b, bufs, st_[1], case)
                elif st_[0] == "check":
                    _refused_change(sess, b, ro, bufs, m, case, st_[1])
                else:
                    _bound(sess, b, ro, bufs, m, case, data, refs, i)
            rec = h.record(version)
            assert rec.slot_calls["EpKernel.Compute"] == m.computes
            assert rec.slot_calls["replayed_steps"] == m.replays * m.nodes
            assert sess.fallbacks["graph_captured"] == len(m.captured)
            replays = sum(sess.fallbacks[k] for k in ("replay_stream_sync", "replay_device_sync", "replay_async"))
            assert replays == m.replays
            assert sess.fallbacks["replay_async"] == m.replays - m.sync_replays
            if profile_prefix is not None:
                sess.end_profiling()
        finally:
            sess.close()
    return m


def refusal(gid: int, then: dict[str, tuple], now: dict[str, tuple]) -> str:
    """The host's message for a replay whose binding differs from the capture's: the first
    differing binding in sorted order, and how it differs."""
    key = next(k for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k))
    a, c = then.get(key), now.get(key)
    what = ("is no longer bound" if c is None else "was not bound at capture" if a is None
            else f"moved from address {a[0]:#x} to {c[0]:#x}" if a[0] != c[0]
            else f"changed shape/dtype from {a[1]}/{a[2]} to {c[1]}/{c[2]}")
    return f"graph {gid} was captured with {key} at a fixed buffer; it {what}. "


def _refused_change(sess, b, ro, bufs: Buffers, m: Model, case, what: str) -> None:
    """On a captured graph with its own binding: a change the replay must refuse, then undone."""
    if m.gid not in m.captured or m.captured[m.gid] != bufs.ids():
        return
    if what == "unbind_inputs":
        b.clear_binding_inputs()
        now = {k: v for k, v in bufs.ids().items() if not k.startswith("input")}
    else:
        name = next(iter(case.outputs))
        view = bufs.bound[name].reshape((1,) + bufs.bound[name].shape)  # same address, one more dimension
        b.bind_output(name, view)
        now = {**bufs.ids(), f"output '{name}'": (view.__array_interface__["data"][0], view.shape, view.dtype.str)}
    m.bound_calls += 1
    with pytest.raises(GraphCaptureError, match="^" + re.escape(refusal(m.gid, m.captured[m.gid], now))):
        sess.run_with_iobinding(b, ro)
    for k, v in bufs.bound.items():  # the same buffers again: the graph replays as before
        (b.bind_input if k in bufs.inputs else b.bind_output)(k, v)


def _bound(sess, b, ro, bufs: Buffers, m: Model, case, data, refs, i: int) -> None:
    for k, v in data.items():
        bufs.bound[k][...] = v
    for k in case.outputs:
        bufs.bound[k][...] = np.nan
    now = bufs.ids()
    m.bound_calls += 1
    if m.gid in m.captured and m.captured[m.gid] != now:
        with pytest.raises(GraphCaptureError, match="^" + re.escape(refusal(m.gid, m.captured[m.gid], now))):
            sess.run_with_iobinding(b, ro)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sess.run_with_iobinding(b, ro)
    if m.gid == -1:
        m.computes += m.nodes
    elif m.gid in m.captured:
        m.replays += 1
        m.sync_replays += m.sync
    else:
        m.computes += m.nodes * (m.min_runs + 1)  # ExampleEP captures the run after min_runs warm-ups
        m.captured[m.gid] = now
    got = [bufs.bound[n] for n in refs.names]
    # What the binding reports after the run (also after a replay) is what is in the bound buffers.
    for name, value in zip(b.output_names(), b.copy_outputs_to_cpu()):
        np.testing.assert_array_equal(value, bufs.bound[name], err_msg=f"step {i}: IOBinding output {name}")
    what = "replayed" if m.gid in m.captured and m.replays else "bound"
    refs.check(got, data, f"step {i}: {what} run (graph {m.gid}) after the steps before it")


versions = st.sampled_from(ft.CAPTURE_VERSIONS)


@given(case=s.elementwise_graphs(max_nodes=3), version=versions, min_runs=st.integers(0, 2),
       steps=st.lists(step, min_size=1, max_size=12), profile=st.booleans())
@example(case=h.chain_case(), version=5, min_runs=1,
         steps=[("eager",), ("eager",), ("eager",), ("bound",), ("bound",), ("eager",), ("bound",)], profile=True)
@example(case=h.chain_case(), version=3, min_runs=0,
         steps=[("gid", "1"), ("eager",), ("bound",), ("gid", "-1"), ("eager",), ("bound",), ("gid", "1"),
                ("sync", "1"), ("bound",), ("eager",), ("gid", "2"), ("bound",), ("bound",)], profile=False)
@example(case=h.chain_case(), version=4, min_runs=2,
         steps=[("bound",), ("bound",), ("rebind", "input_new"), ("bound",), ("rebind", "input_back"), ("bound",),
                ("rebind", "input_same"), ("bound",), ("rebind", "output_new"), ("bound",),
                ("rebind", "output_back"), ("rebind", "output_same"), ("bound",), ("check", "unbind_inputs"),
                ("bound",), ("check", "reshape_output"), ("bound",)], profile=False)
@example(case=h.chain_case(), version=max(ft.CAPTURE_VERSIONS), min_runs=0,
         steps=[("bound",), ("rebind", "input_new"), ("gid", "-1"), ("bound",), ("eager",), ("gid", "3"),
                ("bound",), ("bound",)], profile=False)
@settings(deadline=None, max_examples=s.budget(10))
def test_reused_run_options_binding_and_session(case, version, min_runs, steps, profile):
    play(case, version, min_runs, steps, h.References(case), profile)


@given(case=s.elementwise_graphs(max_nodes=3), version=versions, eager=st.integers(1, 4),
       gid=st.sampled_from([None, "0", "2"]), sync=st.sampled_from([None, "0", "1"]))
@settings(deadline=None, max_examples=s.budget(5))
def test_eager_runs_before_capture_do_not_count_as_warm_up(case, version, eager, gid, sync):
    """Eager runs with the RunOptions later used for capture, then capture and replays: the
    replayed outputs are the references' (a graph captured during an eager run would replay into
    that run's buffers, never into the bound ones)."""
    steps = [] if gid is None else [("gid", gid)]
    steps += [] if sync is None else [("sync", sync)]
    steps += [("eager",)] * eager + [("bound",)] * 3
    play(case, version, 1, steps, h.References(case))


@given(version=versions, capture=st.booleans(), gid=st.sampled_from([None, "-1", "0", "2"]))
@example(version=5, capture=False, gid="2")
@example(version=5, capture=True, gid=None)
@settings(deadline=None, max_examples=s.budget(10))
def test_the_ep_sees_the_callers_graph_id_unless_the_session_captures(version, capture, gid):
    """The gpu_graph_id in OnRunStart's run options: a session that does not capture passes the
    caller's entry through untouched, eager and bound; one that captures says -1 on eager runs (never
    captured) and, on a bound run, the id it captures (0 when the caller set none)."""
    case = h.chain_case()
    ro = RunOptions()
    if gid is not None:
        ro.add_run_config_entry("gpu_graph_id", gid)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": str(int(capture)), "min_runs": "0"})
        try:
            sess.run(None, case.feeds, ro)
            b, _, _ = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(b, ro)
            seen = {k: v for k, v in h.record(version).slot_calls.items() if k.startswith("OnRunStart ")}
        finally:
            sess.close()
    eager = "-1" if capture else gid
    bound = (gid or "0") if capture else gid
    want = collections.Counter([f"OnRunStart gpu_graph_id={eager}", f"OnRunStart gpu_graph_id={bound}"])
    assert seen == want


@pytest.mark.parametrize("version", ft.CAPTURE_VERSIONS)
def test_a_replay_the_ep_refuses_is_a_typed_error(version):
    """The EP dropped its graph behind the host's back: the replay fails with the EP's status, as an
    EpError naming the EP and the slot, and the session goes on (another graph id captures)."""
    from host.errors import EpError

    case = h.chain_case()
    refs = h.References(case)
    slot = "ReplayGraphWithSync" if version >= ft.STREAM_SYNC_VERSION else "ReplayGraph"
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "0"})
        try:
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(b)  # capture of graph 0
            # Forget graph 0 on the plugin side only, as a plugin that lost it would.
            plugin_ep = sdk.runtime(h.example_module(version)).obj(ffi.cast("void*", sess.plan.eps[0].ptr))
            plugin_ep.graphs.clear()
            with pytest.raises(EpError, match=rf"^EP 'ExampleEP' of plugin 'ex{version}' \(.*\): {slot} failed "
                                              r"\(INVALID_ARGUMENT\): .*graph 0 was not captured$"):
                sess.run_with_iobinding(b)
            ro = RunOptions()
            ro.add_run_config_entry("gpu_graph_id", "1")
            h.refill(ins, case.feeds2)
            sess.run_with_iobinding(b, ro)
            refs.check([outs[n] for n in refs.names], case.feeds2, "capture of another graph after a failed replay")
        finally:
            sess.close()


@pytest.mark.parametrize("version", ft.CAPTURE_VERSIONS)
def test_an_output_bound_after_capture_is_refused(version):
    """Captured with one of two outputs bound: binding the other one afterwards changes what the
    graph would have to write, so the replay is refused naming it; unbound again, it replays."""
    from onnx import TensorProto, helper

    x, y, z, a = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "XYZA")
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"), helper.make_node("Relu", ["A"], ["Z"], name="relu")]
    m = helper.make_model(helper.make_graph(nodes, "two", [x, y], [z, a]), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    feeds = {k: np.full((2, 3), v, np.float32) for k, v in (("X", 1.5), ("Y", -2.0))}
    with h.example_env(version, [version]) as env:
        sess = h.session(m, env, {"enable_graph": "1", "min_runs": "0"})
        try:
            b = sess.io_binding()
            for k, v in feeds.items():
                b.bind_input(k, v)
            zbuf, abuf = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
            b.bind_output("Z", zbuf)
            sess.run_with_iobinding(b)  # capture with only Z bound
            b.bind_output("A", abuf)
            with pytest.raises(GraphCaptureError, match=r"^graph 0 was captured with output 'A' at a fixed buffer; "
                                                        r"it was not bound at capture\. "):
                sess.run_with_iobinding(b)
            b.clear_binding_outputs()
            b.bind_output("Z", zbuf)
            feeds["X"][...] = 3.0
            zbuf[...] = np.nan
            sess.run_with_iobinding(b)
            np.testing.assert_array_equal(zbuf, np.maximum(feeds["X"] + feeds["Y"], 0))
        finally:
            sess.close()


@pytest.mark.parametrize("version", ft.CAPTURE_VERSIONS)
def test_a_second_binding_over_the_captured_buffers_replays_and_has_outputs(version):
    """A new IOBinding over the very buffers of the capture replays the graph; its own get_outputs()
    then returns the replayed values (it has never run eagerly, so nothing else could fill them)."""
    case = h.chain_case()
    refs = h.References(case)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "0"})
        try:
            first, ins, outs = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(first)  # captured
            second = sess.io_binding()
            for name, buf in ins.items():
                second.bind_input(name, buf)
            for name, buf in outs.items():
                second.bind_output(name, buf)
            h.refill(ins, case.feeds2)
            sess.run_with_iobinding(second)
            assert sess.fallbacks["graph_captured"] == 1
            assert sum(sess.fallbacks[k] for k in ("replay_device_sync", "replay_stream_sync", "replay_async")) == 1
            got = [v.numpy() for v in second.get_outputs()]
            assert [o.__array_interface__["data"][0] for o in second.get_output_values()] == \
                [outs[n].__array_interface__["data"][0] for n in second.output_names()]
            refs.check([got[second.output_names().index(n)] for n in refs.names], case.feeds2, "second binding")
        finally:
            sess.close()


@pytest.mark.parametrize("version", ft.CAPTURE_VERSIONS)
def test_replays_of_an_ep_without_concurrent_runs_never_overlap(version):
    """An EP that declared no concurrent runs gets one replay at a time, from any number of threads
    (the example EP counts replays that overlap; each replay sleeps 2 ms to widen the window)."""
    import threading

    case = h.chain_case()
    refs = h.References(case)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "0", "slow_replay": "1"})
        try:
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(b)  # captured
            errors = []

            def replay():
                try:
                    for _ in range(5):
                        sess.run_with_iobinding(b)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=replay) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            # Captured graphs are per thread: each thread's first run captures (for the EP, graph 0 is
            # already there), its other four replay.
            assert sess.fallbacks["graph_captured"] == 1 + 4
            assert sum(sess.fallbacks[k] for k in ("replay_device_sync", "replay_stream_sync", "replay_async")) == 16
            assert h.record(version).slot_calls["overlapping_replays"] == 0
            refs.check([outs[n] for n in refs.names], case.feeds, "after threaded replays")
        finally:
            sess.close()


@pytest.mark.parametrize("gid", [None, "0", "7", "-1"])
def test_compiled_frames_say_capturing_exactly_on_the_runs_of_a_graph_id(gid):
    """v6 call frames carry the capture flag on warm-up and capture runs of a graph id (the default
    id 0 included), never on eager runs nor on gpu_graph_id=-1 runs; replays make no frames."""
    case = h.chain_case()
    refs = h.References(case)
    top = max(ft.CAPTURE_VERSIONS)
    with h.example_env(top, [top]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "1", "fuse": "1"})
        try:
            rec = h.record(top)
            refs.check(sess.run(None, case.feeds), case.feeds, "eager run")
            assert rec.fallbacks["frame_capturing"] == 0
            ro = RunOptions()
            if gid is not None:
                ro.add_run_config_entry("gpu_graph_id", gid)
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            for _ in range(3):
                sess.run_with_iobinding(b, ro)  # warm-up + capture, then a replay (or three eager runs)
            refs.check([outs[n] for n in refs.names], case.feeds, "bound runs")
            assert rec.fallbacks["frame_capturing"] == (0 if gid == "-1" else 2)
        finally:
            sess.close()


@pytest.mark.parametrize("version", ft.CAPTURE_VERSIONS)
def test_a_graph_never_captured_warns_once_per_run_at_the_callers_line(version):
    """An EP that wants more warm-up runs than the host gives (16 per call) is run eagerly: the run is
    right, a RuntimeWarning says so and points at the caller's line (not into ephost)."""
    case = h.chain_case()
    refs = h.References(case)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "40"})
        try:
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sess.run_with_iobinding(b)
            assert [(w.category, str(w.message)) for w in caught] == [
                (RuntimeWarning, "ExampleEP did not capture graph 0 within 16 runs; running eagerly")]
            assert h.warned_at(caught[0].filename, __file__), caught[0].filename
            assert sess.fallbacks["capture_not_reached"] == 1
            refs.check([outs[n] for n in refs.names], case.feeds, "never captured")
        finally:
            sess.close()


@pytest.mark.parametrize("version", ft.CAPTURE_VERSIONS)
def test_a_binding_verified_for_one_graph_id_is_checked_again_for_another(version):
    """Graph ids 1 and 2 captured on different buffers: after binding A replays id 1, replaying id 2
    with A is refused (its buffers are not id 2's), and id 2 still replays with its own binding."""
    case = h.chain_case()
    refs = h.References(case)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": "1", "min_runs": "0"})
        try:
            ro = {}
            for gid in (1, 2):
                ro[gid] = RunOptions()
                ro[gid].add_run_config_entry("gpu_graph_id", str(gid))
            a, _, outs_a = h.bind(sess, case.feeds, case.outputs)
            b, ins_b, outs_b = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(a, ro[1])  # captures id 1 on A's buffers
            sess.run_with_iobinding(b, ro[2])  # captures id 2 on B's buffers
            sess.run_with_iobinding(a, ro[1])  # replay: A verified for id 1
            with pytest.raises(GraphCaptureError, match=r"^graph 2 was captured with input '.*' at a fixed buffer; "
                                                        r"it moved from address "):
                sess.run_with_iobinding(a, ro[2])
            h.refill(ins_b, case.feeds2)
            sess.run_with_iobinding(b, ro[2])
            refs.check([outs_b[n] for n in refs.names], case.feeds2, "graph 2 with its own binding")
        finally:
            sess.close()
