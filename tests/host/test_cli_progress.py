"""Session stages told to an observer (host.runtime.stages) and the CLI's display of them."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from host.cli import zoo
from host.cli.progress import StageDisplay
from host.runtime import stages
from host.runtime.session import InferenceSession


@pytest.fixture(scope="module")
def mlp_bytes() -> bytes:
    return zoo.mlp(layers=1, hidden=4).SerializeToString()


def test_a_session_tells_its_stages_in_order(mlp_bytes):
    seen = []
    with stages.observe(lambda stage, detail: seen.append((stage, detail))):
        s = InferenceSession(mlp_bytes, providers=["CPUExecutionProvider"])
    s.close()
    assert seen == [(stages.LOADING, ""), (stages.OPTIMIZING, ""), (stages.PARTITIONING, ""),
                    (stages.CREATING_KERNELS, ""), (stages.DONE, "")]
    InferenceSession(mlp_bytes, providers=["CPUExecutionProvider"]).close()  # outside the block: not told
    assert len(seen) == 5


def test_a_failing_observer_does_not_fail_the_session(mlp_bytes, caplog):
    calls = []

    def broken(stage, detail):
        calls.append(stage)
        raise RuntimeError("display broke")

    with stages.observe(broken):
        s = InferenceSession(mlp_bytes, providers=["CPUExecutionProvider"])
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(s.run(None, {"input": x})[0], InferenceSession(mlp_bytes).run(None, {"input": x})[0])
    assert calls == [stages.LOADING]  # called once, then left alone
    assert "session stage observer failed" in caplog.text


def test_without_a_terminal_each_slow_stage_gets_one_line():
    out = io.StringIO()
    display = StageDisplay(out, tty=False, show_after_s=-1.0)  # every stage counts as slow
    display(stages.OPTIMIZING)
    display(stages.COMPILING, "CUDAExecutionProvider")
    display(stages.DONE)
    display.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" took ")[0] for line in lines] == ["session: optimizing",
                                                           "session: compiling CUDAExecutionProvider"]
    assert all(line.endswith(" s") for line in lines)
    quiet = io.StringIO()
    display = StageDisplay(quiet, tty=False, show_after_s=60.0)
    display(stages.OPTIMIZING)
    display(stages.DONE)
    assert quiet.getvalue() == ""


def test_on_a_terminal_a_spinner_names_the_stage_and_is_cleared():
    out = io.StringIO()
    display = StageDisplay(out, tty=True, show_after_s=0.01)
    display(stages.COMPILING, "CUDAExecutionProvider")
    deadline = time.monotonic() + 10
    while display._status is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert display._status is not None
    assert str(display._status.status) == "creating the session: compiling CUDAExecutionProvider..."
    display(stages.CREATING_KERNELS)
    assert str(display._status.status) == "creating the session: creating kernels..."
    display.close()
    display.close()  # idempotent
    assert display._status is None


def test_a_fast_session_shows_nothing_on_a_terminal():
    out = io.StringIO()
    display = StageDisplay(out, tty=True, show_after_s=30.0)
    display(stages.LOADING)
    display(stages.DONE)
    display.close()
    assert display._status is None and out.getvalue() == ""
