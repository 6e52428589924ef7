"""Fixtures of the hostile-plugin suite: the plugin built by build.py, cases run in subprocesses."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import build
from tests.abi.conftest import NO_CC_REASON, c_compiler

ROOT = Path(__file__).resolve().parents[2]
CASE_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def hostile_libs() -> dict[str, Path]:
    """{"hostile": path, "hostile_data_entry": path}, built once per test session by build.py."""
    if c_compiler() is None:
        pytest.skip(NO_CC_REASON)
    main, data_entry = build.build_hostile()
    return {"hostile": main, "hostile_data_entry": data_entry}


def run_driver(lib: Path, cases: list[dict]) -> list[dict]:
    """Run `cases` in one fresh interpreter; a crash keeps the lines printed before it and adds
    one {"outcome": "crash"} line naming the case that was running."""
    args = [sys.executable, "-m", "tests.hostile.driver", str(lib), *(json.dumps(c) for c in cases)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "HOSTILE_SURVIVOR_LIB": str(lib.with_name("libephost_hostile.so"))}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=CASE_TIMEOUT_S)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = {r["name"] for r in results}
    if proc.returncode != 0:
        pending = [c["name"] for c in cases if c["name"] not in done]
        name = pending[0] if pending else "<survivor>"
        results.append({"name": name, "outcome": "crash", "message": f"exit {proc.returncode}: {proc.stderr[-2000:]}"})
    return results


def run_batches(batches: list[tuple[Path, list[dict]]]) -> dict[str, dict]:
    """Every batch in its own subprocess, two at a time (CI has 2 cores); results by case name,
    plus each batch's survivor line under "<survivor>#i"."""
    out: dict[str, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run_driver, lib, cases) for lib, cases in batches]
        for i, fut in enumerate(futures):
            for r in fut.result():
                key = f"<survivor>#{i}" if r["name"] == "<survivor>" else r["name"]
                out[key] = r
    return out
