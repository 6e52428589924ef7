"""Lifetimes: sessions, EPs, factories and allocators are released deterministically and in order.

The hostile plugin runs here with no fault (an empty case): it lives on a mock device, so every
session allocates, copies, creates streams and notifications, and it counts what the host has
not released (Hostile_Live).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import cffi
import numpy as np
import pytest

import build
from host.errors import InvalidArgument, PluginLoadError
from host.plugins import hostapi
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
from tests.conftest import built_plugin
from tests.hostile.driver import MAIN_MODEL, SHAPE, options

ROOT = build.ROOT


@pytest.fixture(scope="module")
def hostile(hostile_libs):
    """(path, lib) of the hostile plugin, configured with no fault; `lib` stays referenced for the
    whole module (a dlopen that is garbage collected would unmap code the counters live in)."""
    ffi = cffi.FFI()
    ffi.cdef("void Hostile_Configure(const char* spec); int Hostile_Live(void); int Hostile_Orphans(void);")
    lib = ffi.dlopen(str(hostile_libs["hostile"]))
    lib.Hostile_Configure(b"")
    yield hostile_libs["hostile"], lib, ffi


def _feed():
    return {"X": np.arange(6, dtype=np.float32).reshape(SHAPE) - 2}


def _expected(x):
    return np.maximum(2 * x, 0) * 2


def test_environment_closes_its_sessions_first(hostile):
    path, lib, _ = hostile
    base = lib.Hostile_Live()
    with Environment() as env:
        env.register_plugin("hostile", path)
        sessions = [InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) for _ in range(3)]
        for s in sessions:
            np.testing.assert_allclose(s.run(None, _feed())[0], _expected(_feed()["X"]))
        assert env.sessions() == sessions
        assert lib.Hostile_Live() > base
    # Still referenced by `sessions`, yet closed and released, without gc.collect().
    assert lib.Hostile_Live() == base
    assert all(s._closed for s in sessions)
    with pytest.raises(InvalidArgument, match="^this InferenceSession is closed$"):
        sessions[0].run(None, _feed())
    with pytest.raises(InvalidArgument, match="^this Environment is closed; create a new one$"):
        InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env)
    env.close()  # twice is fine


def test_close_refuses_while_a_plugin_is_held_and_releases_nothing(hostile):
    path, lib, _ = hostile
    base = lib.Hostile_Live()
    env = Environment()
    reg = env.register_plugin("hostile", path)
    reg.acquire()  # a user the environment does not know about (no session)
    with pytest.raises(PluginLoadError, match=r"^Environment.close\(\): plugin\(s\) still used by sessions that "
                                              r"could not be closed: 'hostile' \(1 session\(s\)\); nothing was "
                                              r"released$"):
        env.close()
    # Not half torn down: still registered, factories alive, usable.
    assert list(env.plugins) == ["hostile"] and reg.factories and lib.Hostile_Live() == base + 1
    with InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) as s:
        np.testing.assert_allclose(s.run(None, _feed())[0], _expected(_feed()["X"]))
    reg.release()
    env.close()
    assert env.plugins == {} and lib.Hostile_Live() == base


def test_failing_factory_release_still_tears_down(hostile, caplog):
    path, lib, _ = hostile
    base = lib.Hostile_Live()
    lib.Hostile_Configure(b"fail=ReleaseEpFactory")
    try:
        env = Environment()
        env.register_plugin("hostile", path)
        env.close()
    finally:
        lib.Hostile_Configure(b"")
    assert env.plugins == {} and lib.Hostile_Live() == base
    assert any(re.search(r"ReleaseEpFactory failed \(FAIL\): HostileEP: injected failure", r.getMessage())
               for r in caplog.records)


def test_thousand_sessions_flat_rss_and_no_live_objects(hostile):
    """1,000 sessions created, run and closed: no plugin object left, RSS flat within a tolerance.
    The figure is printed (-s) for the report."""
    path, lib, _ = hostile
    base = lib.Hostile_Live()
    statuses = len(hostapi.STATUSES)

    def rss_kib() -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))

    with Environment() as env:
        env.register_plugin("hostile", path)
        x = _feed()
        for _ in range(50):  # warm-up: caches, interned strings, allocator arenas
            with InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) as s:
                s.run(None, x)
        gc.collect()
        before = rss_kib()
        for _ in range(1000):
            with InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env) as s:
                s.run(None, x)
            assert lib.Hostile_Live() == base + 1  # only the factory outlives a closed session
        gc.collect()
        after = rss_kib()
        assert env.sessions() == []
    print(f"\n1000 sessions: RSS {before} KiB -> {after} KiB ({after - before:+d} KiB), live plugin objects "
          f"{lib.Hostile_Live() - base}")
    assert lib.Hostile_Live() == base
    assert len(hostapi.STATUSES) == statuses
    assert after - before < 8 * 1024, f"RSS grew by {after - before} KiB over 1,000 sessions"


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def test_exit_with_unclosed_sessions_is_silent(hostile, example_plugin):
    """Sessions and device outputs still referenced at interpreter exit: released in order (sessions,
    EPs, factories), and not one line on stderr (no 'EpAllocator.Free called with an unknown ...')."""
    path, _, _ = hostile
    example = example_plugin()
    proc = _run(f"""
        import numpy as np
        from host.plugins.environment import Environment
        from host.runtime.session import InferenceSession
        from tests.hostile.driver import MAIN_MODEL, GRAPH_MODEL, options
        env = Environment()
        env.register_plugin("hostile", {str(path)!r})
        env.register_plugin("example", {str(example)!r})
        x = np.ones((2, 3), np.float32)
        keep = []
        for provider in (["HostileEP"], [("ExampleEP", {{"mock_device": "1"}})]):
            s = InferenceSession(GRAPH_MODEL, providers=provider, env=env)
            b = s.io_binding()
            b.bind_input("X", x)
            b.bind_output("Y")  # the EP allocates: a device output the caller keeps past exit
            s.run_with_iobinding(b)
            keep += [s, b.get_outputs()[0], InferenceSession(MAIN_MODEL, options(), providers=provider, env=env)]
        assert "device=cuda" in repr(keep[1]), keep[1]  # device memory the caller keeps
        print("ran")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ran\n"
    assert proc.stderr == ""


def test_plugin_from_a_moved_checkout(example_plugin, tmp_path):
    """A Python plugin imports its code from the checkout it was built in: moved or deleted, the host
    says so (and how to rebuild) instead of loading it and printing a cffi traceback."""
    data = example_plugin().read_bytes()
    root = str(ROOT).encode()
    gone = b"/" + b"m" * (len(root) - 1)  # same length: the library's layout is unchanged
    assert data.count(b"if '" + root + b"' not in sys.path") == 1
    moved = tmp_path / "libephost_example_moved.so"
    moved.write_bytes(data.replace(b"'" + root + b"'", b"'" + gone + b"'"))
    with pytest.raises(PluginLoadError, match=f"^plugin '{re.escape(str(moved))}' was built for the checkout "
                                              f"{gone.decode()}, which no longer exists \\(moved or deleted\\); "
                                              r"rebuild the plugin from the current checkout \(python build.py\)$"):
        Environment().register_plugin("moved", moved)


@pytest.mark.parametrize(("bad", "message"), [
    ({"bogus": "1"}, r"unknown option 'bogus' for CUDAExecutionProvider; allowed: "),
    ({"do_copy_in_default_stream": "maybe"}, r"do_copy_in_default_stream"),
    ({"gpu_external_alloc": "1234"}, r"option gpu_external_alloc needs both gpu_external_alloc and "
                                     r"gpu_external_free; only one was given"),
])
def test_cuda_options_checked_without_a_device(bad, message):
    """On this GPU-less machine the CUDA plugin has no device, yet a wrong option is an error."""
    path = built_plugin("cuda")
    with Environment() as env:
        env.register_plugin("cuda", path)
        if env.plugin("cuda").factories[0].devices:
            pytest.skip("a CUDA device is present: the no-device path is not reached")
        with pytest.raises(InvalidArgument, match=r"^EP 'CUDAExecutionProvider' of plugin 'cuda' \([^)]*\): "
                                                  r"CreateEp failed \(INVALID_ARGUMENT\): .*" + message):
            InferenceSession(MAIN_MODEL, options(), providers=[("CUDAExecutionProvider", bad)], env=env)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with InferenceSession(MAIN_MODEL, options(), providers=[("CUDAExecutionProvider", {"device_id": "0"})], env=env) as s:
                np.testing.assert_allclose(s.run(None, _feed())[0], _expected(_feed()["X"]))
        assert any("CUDAExecutionProvider has no device" in str(w.message) for w in caught)


def test_a_failing_release_does_not_stop_the_others(hostile, monkeypatch):
    """One EP's close raising (after releasing) must not keep the rest of the session alive."""
    path, lib, _ = hostile
    base = lib.Hostile_Live()
    with Environment() as env:
        env.register_plugin("hostile", path)
        s = InferenceSession(MAIN_MODEL, options(), providers=["HostileEP"], env=env)
        s.run(None, _feed())
        [ep] = s._eps
        real_close = ep.close

        def close_then_fail():
            real_close()
            raise RuntimeError("planted failure after release")

        monkeypatch.setattr(ep, "close", close_then_fail)
        with pytest.raises(RuntimeError, match="^planted failure after release$"):
            s.close()
        assert env.plugin("hostile")._users == 0 and env.sessions() == []
        assert lib.Hostile_Live() == base + 1  # the factory only
    assert lib.Hostile_Live() == base


def test_a_session_closed_by_gc_while_the_environment_lock_is_held_does_not_deadlock():
    """Regression: garbage collection ran Session.__del__ inside Environment.register_plugin (which
    holds the environment's lock), and forget_session waited for that same lock forever."""
    from host.cli import zoo

    env = Environment()
    session = InferenceSession(zoo.mlp(layers=1, hidden=4), env=env)
    closed = threading.Event()

    def close_under_the_lock():
        with env._lock:  # where gc may run a finalizer: inside any locked Environment method
            session.close()
            closed.set()

    worker = threading.Thread(target=close_under_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert closed.is_set(), "Session.close() deadlocked on the Environment's lock"
    env.close()
