"""bench/cpu_models.py --busy: the other busy processes run during the block and are gone after it."""

from __future__ import annotations

import os
import time

import pytest

from bench.cpu_models import busy_processes, main


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from Linux's /proc")
def test_busy_processes_spin_during_the_block_and_are_killed_after():
    with busy_processes(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        time.sleep(0.5)
        assert all(_cpu_seconds(p.pid) > 0.02 for p in procs)  # spinning, not sleeping
    assert all(p.returncode is not None for p in procs)


def test_a_negative_busy_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--busy", "-1", "--models", "zoo_mlp"])
    assert "--busy must be >= 0; got -1" in capsys.readouterr().err


def test_threads_reach_both_runtimes_sessions(monkeypatch):
    """--threads N: intra_op_num_threads N for onnxruntime's session and for both of ephost's."""
    import onnxruntime as ort

    from bench import cpu_models

    seen = []
    real_ort, real_ephost = ort.InferenceSession, cpu_models._ephost_session

    def ort_session(path, options=None, **kw):
        seen.append(("onnxruntime", options.intra_op_num_threads))
        return real_ort(path, options, **kw)

    def ephost_session(path, level, threads=0):
        sess = real_ephost(path, level, threads)
        seen.append(("ephost", sess.get_session_options().intra_op_num_threads))
        return sess

    monkeypatch.setattr(cpu_models.ort, "InferenceSession", ort_session)
    monkeypatch.setattr(cpu_models, "_ephost_session", ephost_session)
    row = cpu_models.bench_model("zoo_mlp", warmup=1, iters=2, block=1, threads=1)
    assert seen == [("onnxruntime", 1), ("ephost", 1), ("ephost", 1)]
    assert row["ephost_p50_us"] > 0
