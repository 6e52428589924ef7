"""Threads that come and go (issue 31): one session run from rounds of new threads, and short-lived
threads ending (releasing their streams and kernel contexts) while others run, give one result per
input and no error. The example plugin takes part with per-thread sync streams, a mock device
(every value crossing to it is copied) and compiled partitions (fuse=runs), next to the CPU EP.

The reference for each input is the session's own first answer (main thread), itself checked
against onnxruntime.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest

from bench.load import prepare, run_cycles
from host.cli import zoo
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.conftest import built_plugin

OPTIONS = {"mock_device": "1", "fuse": "runs", "ops": "MatMul,Add,Relu"}


@pytest.fixture(scope="module")
def env():
    e = Environment()
    e.register_plugin("example", built_plugin("example"))
    yield e
    e.close()


def _session(env, options=OPTIONS):
    model = zoo.mlp(layers=3, hidden=32, batch=2)
    return model, InferenceSession(model, providers=[("ExampleEP", options), "CPUExecutionProvider"], env=env)


def test_the_reference_is_right(env):
    model, s = _session(env)
    target = prepare(s)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds, expected in zip(target.feeds, target.expected):
        np.testing.assert_allclose(expected[0], ref.run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    assert s.fallbacks.get("concurrent_runs", 0) or s.fallbacks.get("serialised_runs", 0)


@pytest.mark.parametrize("options", [OPTIONS, {**OPTIONS, "fuse": "0"}], ids=["compiled", "per-node"])
def test_rounds_of_new_threads_give_one_result(env, options):
    _, s = _session(env, options)
    rows = run_cycles([prepare(s)], cycles=2, rounds=[1, 2, 4, 8], runs=8, iobinding=False)
    assert [r["first_error"] for r in rows if r["errors"]] == []
    assert sum(r["differing"] for r in rows) == 0
    assert sum(r["runs"] for r in rows) == 2 * 8 * (1 + 2 + 4 + 8)


def test_threads_ending_while_others_run(env):
    """Short-lived threads (two runs, then exit: their state is released at once) race with
    long-lived ones that keep running."""
    _, s = _session(env)
    target = prepare(s)
    stop = threading.Event()
    problems: list[str] = []

    def check(k: int) -> None:
        got = s.run(None, target.feeds[k])
        if not np.array_equal(got[0], target.expected[k][0]):
            problems.append(f"differing result for input {k}")

    def long_lived(t: int) -> None:
        i = 0
        try:
            while not stop.is_set():
                check((t + i) % len(target.feeds))
                i += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            problems.append(repr(exc))

    def short_lived(t: int) -> None:
        try:
            check(t % len(target.feeds))
            check((t + 1) % len(target.feeds))
        except Exception as exc:  # noqa: BLE001 - reported below
            problems.append(repr(exc))

    runners = [threading.Thread(target=long_lived, args=(t,)) for t in range(2)]
    for th in runners:
        th.start()
    try:
        for wave in range(6):
            short = [threading.Thread(target=short_lived, args=(wave * 4 + t,)) for t in range(4)]
            for th in short:
                th.start()
            for th in short:
                th.join()
    finally:
        stop.set()
        for th in runners:
            th.join()
    assert problems == []
