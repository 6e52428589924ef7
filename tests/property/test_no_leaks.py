"""Property 5: after any sequence of session creations (good and refused), runs (eager, bound,
captured, failing), graph releases, closes and drops (left to the garbage collector), nothing the
plugin made is still alive, no status and no kernel context is left in the host's registries, and
closing the Environment releases the factory too.
"""

from __future__ import annotations

import gc
import warnings
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host.errors import EphostError
from host.plugins import hostapi
from tests.property import harness as h
from tests.property import strategies as s

STEP_KINDS = ("create", "create", "run", "bound", "bound", "release", "close", "drop", "fail")


def live(version: int) -> Counter:
    rec = h.record(version)
    return +Counter(rec.live) if rec is not None else Counter()


def registries() -> dict[str, int]:
    """Sizes of the host's handle registries (loggers are per registration: compared around the env)."""
    return {"statuses": len(hostapi.STATUSES), "contexts": len(hostapi.CONTEXTS),
            "session options": len(hostapi.SESSION_OPTIONS)}


def _open_session(data, env, negotiated: int, null_slots):
    case = data.draw(s.graphs(max_nodes=4), label="graph")
    opts = data.draw(s.example_ep_options(), label="options")
    extra = data.draw(st.sampled_from(["none", "none", "fail_node", "unknown"]), label="fault")
    if extra == "fail_node":
        opts["fail_node"] = data.draw(st.sampled_from(sorted(case.nodes)), label="fail_node")
    elif extra == "unknown":
        opts["bogus"] = "1"
    try:
        sess = h.session(case, env, h.with_null_slots(opts, null_slots))
    except EphostError:
        return None  # refused (unknown option, or a capture policy violation): must leave nothing behind
    return sess, case


@given(data=st.data(), host=s.versions, plugin=s.versions, null_slots=s.null_slot_sets)
@settings(deadline=None)
def test_no_plugin_object_status_or_context_outlives_its_session(data, host, plugin, null_slots):
    gc.collect()
    before_env = live(plugin)
    regs = registries()
    loggers = len(hostapi.LOGGERS)
    with h.example_env(host, [plugin]) as env:
        registered = live(plugin)
        factory = env.plugin(f"ex{plugin}").factories[0]
        _play(data, env, min(host, plugin), null_slots)  # in a function: no local keeps a session
        gc.collect()
        assert live(plugin) == registered, "plugin objects alive after every session went"
        assert registries() == regs, "statuses or kernel contexts left in the host's registries"
        assert [f for f in factory.allocator_finalizers if f.alive] == []
    assert live(plugin) == before_env, "plugin objects alive after the Environment closed"
    assert registries() == regs
    assert len(hostapi.LOGGERS) == loggers, "the registration's logger outlived it"


def _play(data, env, negotiated: int, null_slots) -> None:
    sessions: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(data.draw(st.integers(1, 10), label="steps")):
            kind = data.draw(st.sampled_from(STEP_KINDS), label="step")
            if kind == "create" or not sessions:
                made = _open_session(data, env, negotiated, null_slots)
                if made is not None:
                    sessions.append([*made, None])
                continue
            i = data.draw(st.integers(0, len(sessions) - 1), label="session")
            sess, case, binding = sessions[i]
            try:
                if kind in ("run", "fail"):
                    sess.run(None, case.feeds)
                elif kind == "bound":
                    if binding is None:
                        binding = sessions[i][2] = h.bind(sess, case.feeds, case.outputs)[0]
                    sess.run_with_iobinding(binding, data.draw(s.run_options, label="run options").make())
                elif kind == "release":
                    sess.capture.release(data.draw(st.integers(0, 3), label="graph id"))
                elif kind == "close":
                    sess.close()
                    sessions.pop(i)
                else:  # drop: the finalizer closes it
                    sessions.pop(i)
                    del sess, binding
                    gc.collect()
            except EphostError:
                pass  # injected kernel failures, releases refused on v3, closed sessions: all typed


@pytest.mark.parametrize("version", [3, 4, 5])
def test_replay_allocates_nothing(version):
    """Captured replays run in the graph's own memory: the plugin's live allocations do not move."""
    case_model = _chain()
    with h.example_env(version, [version]) as env:
        sess = h.session(case_model, env, {"enable_graph": "1"})
        try:
            b, ins, outs = h.bind(sess, *_feeds_and_shapes())
            sess.run_with_iobinding(b)
            after_capture = live(version)
            for _ in range(20):
                sess.run_with_iobinding(b)
            assert live(version) == after_capture
        finally:
            sess.close()


def _chain():
    from tests.host.test_session import chain_model

    return chain_model()


def _feeds_and_shapes():
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((2, 3)).astype(np.float32) for k in ("X", "Y")}
    return feeds, {"Z": (2, 3)}
