"""Property 8: the host's reading of a plugin's yes/no and enum answers, on their own.

The example EP is told to lie (provider option `lie=`): a capture flag of 2, a node-assignment
policy of 7, a concurrency flag of 3, a failing IsConcurrentRunSupported, and one that returns OK
without writing its answer. Every lie but the last is an EpError whose whole text names the EP, the
slot, what came back and what is allowed, at any negotiated version that has the slot; a silent
answer means "no concurrent runs" (the host's own initial value), so runs are serialised. The
session created next in the same environment runs and matches the references. A Sync that fails
after a replay (the device-wide sync of an EP without ReplayGraphWithSync) is the run's EpError.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from host.errors import EpError
from tests.property import harness as h
from tests.property import strategies as s

TOP = max(s.VERSIONS)
# (lie, enable_graph) -> the first version whose table has the slot (abi.since_table()), the complaint.
LIES = {
    ("capture_flag", "0"): (3, "Ep.IsGraphCaptureEnabled returned 2; expected 0 or 1"),
    ("policy", "1"): (3, "Ep.GetGraphCaptureNodeAssignmentPolicy returned 7; expected 0 (ALL_NODES_ON_EP) or 1 "
                         "(ALLOW_CPU_FOR_SHAPES)"),
    ("concurrent_flag", "0"): (2, "Ep.IsConcurrentRunSupported returned 3; expected 0 or 1"),
    ("capability_fails", "0"): (1, "GetCapability failed (FAIL): _ephost_example_v{v}: Ep.GetCapability failed: "
                                   "injected failure in GetCapability"),
    ("concurrent_fails", "0"): (2, "Ep.IsConcurrentRunSupported failed (FAIL): _ephost_example_v{v}: "
                                   "Ep.IsConcurrentRunSupported failed: injected failure in IsConcurrentRunSupported"),
}


def _owner(env, plugin: int) -> str:
    reg = env.plugins[f"ex{plugin}"]
    return f"EP 'ExampleEP' of plugin '{reg.name}' ({reg.path}): "


def _check_next_session_works(env):
    case = h.chain_case()
    sess = h.session(case, env)
    try:
        h.References(case).check(sess.run(None, case.feeds), case.feeds, "session after a lying one")
    finally:
        sess.close()


@pytest.mark.parametrize("lie, graph", sorted(LIES))
@given(host=s.versions, plugin=s.versions)
@example(host=TOP, plugin=TOP)
@settings(deadline=None, max_examples=s.budget(6))
def test_a_broken_answer_is_an_ep_error_with_its_whole_text(lie, graph, host, plugin):
    since, text = LIES[(lie, graph)]
    negotiated = min(host, plugin)
    with h.example_env(host, [plugin]) as env:
        if negotiated < since:  # the slot is not in the negotiated table: the lie is never asked
            sess = h.session(h.chain_case(), env, {"lie": lie, "enable_graph": graph})
            sess.close()
        else:
            want = _owner(env, plugin) + text.format(v=plugin)
            with pytest.raises(EpError, match="^" + re.escape(want) + "$"):
                h.session(h.chain_case(), env, {"lie": lie, "enable_graph": graph})
        _check_next_session_works(env)


@given(host=s.versions, plugin=s.versions, graph=st.booleans())
@example(host=TOP, plugin=TOP, graph=False)
@settings(deadline=None, max_examples=s.budget(6))
def test_an_unwritten_concurrency_answer_means_serialised_runs(host, plugin, graph):
    case = h.chain_case()
    with h.example_env(host, [plugin]) as env:
        sess = h.session(case, env, {"lie": "concurrent_silent", "enable_graph": "1" if graph else "0"})
        try:
            h.References(case).check(sess.run(None, case.feeds), case.feeds, "silent concurrency answer")
            assert sess.fallbacks["serialised_runs"] == 1
            assert sess.fallbacks["concurrent_runs"] == 0
        finally:
            sess.close()


@pytest.mark.parametrize("version", [3, 4, 5, 6])
def test_a_failing_sync_after_a_replay_is_an_ep_error_naming_it(version):
    """Without ReplayGraphWithSync (v3/v4, or NULLed) a synchronous replay is ReplayGraph then Sync:
    a failing Sync is the run's error, with the EP and the slot named."""
    case = h.chain_case()
    opts = {"enable_graph": "1", "min_runs": "0", "lie": "sync_fails_after_capture"}
    if version >= 5:
        opts["null_slots"] = "ReplayGraphWithSync"
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, opts)
        try:
            b, ins, outs = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(b)  # captured; Sync has not failed yet
            want = _owner(env, version) + (f"Sync failed (FAIL): _ephost_example_v{version}: Ep.Sync failed: "
                                           "injected failure in Sync")
            with pytest.raises(EpError, match="^" + re.escape(want) + "$"):
                sess.run_with_iobinding(b)
        finally:
            sess.close()
