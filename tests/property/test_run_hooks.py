"""Property 11: what the host tells OnRunStart/OnRunEnd, and how a run ends when something fails.

Every run ends with OnRunEnd on every EP that has it, its sync_stream flag 1 unless the run options
say disable_synchronize_execution_providers=1. A run that fails (a kernel's error, or an unexpected
exception inside the executor) still ends with OnRunEnd, always synchronizing, and a failing OnRunEnd
then neither hides the run's own error nor leaks its status. A failing OnRunStart or OnRunEnd on a run
that otherwise works is the run's EpError naming the EP and the slot. The example EP records the flag
it was given (slot_calls "OnRunEnd sync_stream=N") and fails on request (lie=run_start_fails,
run_end_fails); the session goes on after each failure.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from host.errors import EpError, KernelError
from host.plugins import hostapi
from host.runtime.session import RunOptions
from tests.property import harness as h
from tests.property import strategies as s

TOP = max(s.VERSIONS)
disable_sync = st.sampled_from([None, "0", "1", "yes"])


def _run_options(disable: str | None) -> RunOptions:
    ro = RunOptions()
    if disable is not None:
        ro.add_run_config_entry("disable_synchronize_execution_providers", disable)
    return ro


def _run_ends(version: int) -> dict[str, int]:
    return {k: v for k, v in h.record(version).slot_calls.items() if k.startswith("OnRunEnd ")}


def _owner(env, version: int) -> str:
    reg = env.plugins[f"ex{version}"]
    return f"EP 'ExampleEP' of plugin '{reg.name}' ({reg.path})"


@given(version=s.versions, disable=disable_sync, capture=st.booleans())
@example(version=TOP, disable="1", capture=False)
@example(version=TOP, disable="1", capture=True)
@settings(deadline=None, max_examples=s.budget(10))
def test_on_run_end_synchronizes_unless_the_run_options_say_not(version, disable, capture):
    case = h.chain_case()
    refs = h.References(case)
    capture = capture and version >= 3  # capture slots from v3
    ro = _run_options(disable)
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"enable_graph": str(int(capture)), "min_runs": "1"})
        try:
            refs.check(sess.run(None, case.feeds, ro), case.feeds, "eager run")
            b, _, outs = h.bind(sess, case.feeds, case.outputs)
            sess.run_with_iobinding(b, ro)  # with capture: a warm-up run, then the capture run
            refs.check([outs[n] for n in refs.names], case.feeds, "bound run")
        finally:
            sess.close()
    runs = 3 if capture else 2
    assert _run_ends(version) == {f"OnRunEnd sync_stream={int(disable != '1')}": runs}


@pytest.mark.parametrize("failure", ["kernel", "executor"])
@given(version=s.versions, disable=disable_sync, end_fails=st.booleans())
@example(version=TOP, disable="1", end_fails=True)
@settings(deadline=None, max_examples=s.budget(8))
def test_a_failed_run_ends_synchronized_and_keeps_its_own_error(failure, version, disable, end_fails):
    case = h.chain_case()
    refs = h.References(case)
    opts = {"lie": "run_end_fails"} if end_fails else {}
    if failure == "kernel":
        opts["fail_node"] = "relu"
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, opts)
        try:
            statuses = len(hostapi.STATUSES)
            if failure == "kernel":
                want, pattern = KernelError, r"^node 'relu' \(Relu\) on ExampleEP failed \(FAIL\): "
            else:
                sess.executor.execute = _broken(sess.executor.execute)
                want, pattern = EpError, r"^run failed: unexpected error after the run$"
            with pytest.raises(want, match=pattern):
                sess.run(None, case.feeds, _run_options(disable))
            assert len(hostapi.STATUSES) == statuses, "the failing OnRunEnd's status was not released"
            assert _run_ends(version) == {"OnRunEnd sync_stream=1": 1}
            if failure == "executor" and not end_fails:
                del sess.executor.execute  # the executor's own method again: the session goes on
                refs.check(sess.run(None, case.feeds2), case.feeds2, "run after a failed one")
        finally:
            sess.close()


def _broken(execute):
    def run_then_fail(st_, feeds):
        execute(st_, feeds)
        raise RuntimeError("unexpected error after the run")
    return run_then_fail


@pytest.mark.parametrize("slot", ["OnRunStart", "OnRunEnd"])
@given(version=s.versions)
@example(version=TOP)
@settings(deadline=None, max_examples=s.budget(4))
def test_a_failing_run_hook_is_the_runs_ep_error_naming_the_slot(slot, version):
    case = h.chain_case()
    lie = "run_start_fails" if slot == "OnRunStart" else "run_end_fails"
    with h.example_env(version, [version]) as env:
        sess = h.session(case, env, {"lie": lie})
        try:
            statuses = len(hostapi.STATUSES)
            want = (f"{_owner(env, version)}: {slot} failed (FAIL): _ephost_example_v{version}: Ep.{slot} failed: "
                    f"injected failure in {slot}")
            for _ in range(2):  # the session goes on: the next run fails the same way
                with pytest.raises(EpError, match="^" + re.escape(want) + "$"):
                    sess.run(None, case.feeds)
            assert len(hostapi.STATUSES) == statuses
        finally:
            sess.close()

