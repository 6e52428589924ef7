"""Shared fixtures: plugins built once per test session, hypothesis profiles."""

from __future__ import annotations

import faulthandler
import functools
import gc
import logging
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import build  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=10, deadline=None)
settings.load_profile(os.environ.get("EPHOST_HYPOTHESIS_PROFILE", "ci"))
# The CLI's session progress lines appear when a stage takes over a second, which a loaded machine
# decides: off here so that CLI tests compare stderr exactly (tests/host/test_cli_progress.py
# drives the display itself).
os.environ["EPHOST_PROGRESS"] = "0"


@functools.cache
def built_plugin(name: str, version: int | None = None) -> Path:
    """Build a plugin into build/lib once per process (build.py is the one build entry point)."""
    if name in build.C_PLUGINS:
        return build.build_c_plugin(name)
    spec = build.PYTHON_PLUGINS[name]
    return build.build_python_plugin(name, version or max(spec.versions))


@pytest.fixture(scope="session")
def example_plugin():
    """A function version -> path of the example plugin built for that ABI version."""
    return lambda version=5: built_plugin("example", version)


@pytest.fixture(scope="session")
def cuda_plugin_path():
    return built_plugin("cuda")


def example_record(version: int):
    from abi import sdk

    return sdk.runtime(build.module_name("example", version)).record


@pytest.fixture(autouse=True)
def _young_heap():
    """Each test starts with only its own objects in the collected generations.

    Collection imports every test module (onnx's backend cases, models, Ray), so the heap holds
    ~400,000 objects before the first test, more after each; a full gc.collect() walks all of them
    (0.3-0.5 s here), and the harnesses call it per example (tests/property) or per test (fixtures
    whose sessions close in their finalizers). Collect what earlier tests left, then freeze the
    survivors (gc.freeze: never collected, never walked again): a test's gc.collect() then walks
    what the test made, and finalizes exactly what it did before. Objects alive before the test
    that become cyclic garbage during it are not collected: no test relies on that."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _restore_ephost_log_level():
    """log_severity_level is process-wide (as in onnxruntime): a test that sets it must not silence later ones."""
    logger = logging.getLogger("ephost")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def _hang_limit():
    """EPHOST_TEST_TIMEOUT=S ends the process (exit 1, tracebacks of every thread) when one test runs longer
    than S seconds. The mutation run sets it: a mutant that leaves a lock held makes the next call wait
    forever, and mutmut's own timeout, scaled from the whole suite's duration, is hours away."""
    limit = os.environ.get("EPHOST_TEST_TIMEOUT")
    if limit:
        faulthandler.dump_traceback_later(float(limit), exit=True)
    yield
    if limit:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    """EPHOST_MUTATION_TESTS=a.py,b.py (set by tests/property/mutation.py --tests or its TESTS table)
    runs only those test files under a mutant: mutmut runs every test its stats run saw reach the
    mutated function, which for a function every session reaches is most of the property suite.
    The stats and clean runs (MUTANT_UNDER_TEST without a mutant name) keep every test."""
    wanted = [p for p in os.environ.get("EPHOST_MUTATION_TESTS", "").split(",") if p]
    if not wanted or "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    kept = [item for item in items if any(item.nodeid.startswith(p) for p in wanted)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
