"""Property 2: version gating. Whatever was run, no plugin slot newer than the negotiated version
(min(host API, plugin ABI)) and no slot the plugin left NULL is ever called; and the gate is not
shut too far either: the optional Ep slots the scenario needs are called when they may be.
"""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

import abi
from host.plugins.environment import Environment
from tests.conftest import built_plugin
from tests.property import harness as h
from tests.property import scenario
from tests.property import strategies as s


def assert_gated(slot_calls, negotiated: int, null_slots) -> None:
    called = [k for k in slot_calls if "." in k]  # "Table.Slot"; other keys are plugin statistics
    assert called, "the plugin recorded no slot call at all"
    too_new = [k for k in called if abi.since(*k.split(".")) > negotiated]
    assert too_new == [], f"slots newer than v{negotiated} were called: {too_new}"
    nulls = [k for k in called if k.startswith("Ep.") and k.split(".")[1] in null_slots]
    assert nulls == [], f"slots left NULL were called: {nulls}"


@given(sc=scenario.scenarios())
@settings(deadline=None)
def test_no_slot_beyond_negotiated_or_null_is_called(sc):
    with h.example_env(sc.host, [sc.plugin]) as env:
        out = scenario.play(sc, env)
    calls = h.record(sc.plugin).slot_calls  # includes what closing the session and env called
    assert_gated(calls, sc.negotiated, sc.null_slots)

    # The other direction: what may be called and is needed was called.
    ev = scenario.model(sc)
    on_plan = sc.plugin_nodes > 0
    called = {k.split(".", 1)[1] for k in calls if k.startswith("Ep.")}
    assert ("IsConcurrentRunSupported" in called) is sc.ep_has("IsConcurrentRunSupported")
    capture_slots = all(sc.ep_has(x) for x in ("IsGraphCaptureEnabled", "IsGraphCaptured", "ReplayGraph"))
    # Asked of every EP of the session, also one that got no node (its policy may refuse the session).
    assert ("IsGraphCaptureEnabled" in called) is capture_slots
    assert ("GetGraphCaptureNodeAssignmentPolicy" in called) is (
        sc.capture != "off" and sc.ep_has("GetGraphCaptureNodeAssignmentPolicy"))
    if not out.created:
        return
    ran = on_plan and (sc.eager_runs > 0 or bool(sc.bound_runs))
    assert ("OnRunStart" in called) is (ran and sc.ep_has("OnRunStart"))
    assert ("OnRunEnd" in called) is (ran and sc.ep_has("OnRunEnd"))
    with_sync = sc.ep_has("ReplayGraphWithSync")
    assert ("ReplayGraphWithSync" in called) is (with_sync and bool(ev.replays))
    assert ("ReplayGraph" in called) is (not with_sync and bool(ev.replays))
    assert ("Sync" in called) is (not with_sync and any(ev.replays) and sc.ep_has("Sync"))
    assert ("ReleaseCapturedGraph" in called) is (ev.captured > 0 and sc.ep_has("ReleaseCapturedGraph"))


two_hosts = st.lists(s.versions, min_size=2, max_size=2)


@given(hosts=two_hosts, plugin=s.versions, case=s.elementwise_graphs(max_nodes=3))
@settings(deadline=None, max_examples=s.budget(15))
def test_registrations_at_different_versions_keep_their_own_gate(hosts, plugin, case):
    """One plugin library registered in two Environments at once: each registration keeps the
    version it negotiated, whichever was made last."""
    gc.collect()
    envs = [Environment(api_version=v) for v in hosts]
    try:
        for i, env in enumerate(envs):
            env.register_plugin(f"ex{i}", built_plugin("example", plugin))
        refs = h.References(case)
        for env, host in zip(envs, hosts):
            negotiated = min(host, plugin)
            h.clear_record(plugin)
            sess = h.session(case, env, {"enable_graph": "1", "min_runs": "0"})
            try:
                b, ins, outs = h.bind(sess, case.feeds, case.outputs)
                sess.run_with_iobinding(b)
                sess.run_with_iobinding(b)
                refs.check([outs[n] for n in refs.names], case.feeds, f"host {host} plugin {plugin}")
                assert sess.capture.enabled is (negotiated >= 3)
                assert sess.plan.eps[0].slots.negotiated == negotiated
            finally:
                sess.close()
            assert_gated(h.record(plugin).slot_calls, negotiated, ())
    finally:
        gc.collect()
        for env in envs:
            env.close()
