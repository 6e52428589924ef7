"""The collector pause around per-signature plan builds (plugin_cuda/plan/gc_pause.py): nesting,
threads, a collector the caller had disabled, an exception, and the off switch."""

from __future__ import annotations

import gc
import threading

import pytest

from plugin_cuda.plan import gc_pause


@pytest.fixture(autouse=True)
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_for_the_build_and_back_after_it_even_on_error():
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer build still runs
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_pause.paused():
            raise RuntimeError("lowering failed")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    with gc_pause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_builds_on_two_threads_enable_it_once_both_are_done():
    inside, release = threading.Event(), threading.Event()

    def build():
        with gc_pause.paused():
            inside.set()
            release.wait(5)

    t = threading.Thread(target=build)
    t.start()
    inside.wait(5)
    with gc_pause.paused():
        pass
    assert not gc.isenabled()  # the other thread's build is still running
    release.set()
    t.join(5)
    assert gc.isenabled()


def test_off_switch(monkeypatch):
    monkeypatch.setenv("EPHOST_PLAN_GC_PAUSE", "0")
    with gc_pause.paused():
        assert gc.isenabled()
