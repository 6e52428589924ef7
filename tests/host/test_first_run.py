"""Issue 29: a session's first run does no one-time host work (host/runtime/first_run.py): it parses
no C type string (cffi's pycparser pass, milliseconds each) and does not scan the BLAS libraries.
Observed through cffi's per-process type cache and a counting stand-in for threadpoolctl's
controller; results compared with onnxruntime's CPU EP."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import threadpoolctl

import abi
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from host.runtime.session import InferenceSession
from tests.abi.test_compiled import chain_model


@pytest.fixture
def fresh_types():
    """cffi's type cache emptied (as in a new process), refilled afterwards."""
    saved = dict(ffi._parsed_types)  # private, but the only view of what cffi has parsed
    ffi._parsed_types.clear()
    yield ffi._parsed_types
    ffi._parsed_types.update(saved)


@pytest.mark.parametrize("ep_options", [{"fuse": "1"}, {}], ids=["compiled", "kernels"])
def test_run_1_parses_no_c_type(example_plugin, fresh_types, ep_options):
    model = chain_model(("Add", "Relu", "Sigmoid", "Mul", "Add"))
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with Environment() as env:
        env.register_plugin("ex", example_plugin(abi.ABI_VERSION))
        with InferenceSession(model.SerializeToString(), providers=[("ExampleEP", ep_options)], env=env) as s:
            parsed = set(fresh_types)
            assert "EpRunOptions*" in parsed  # parsed at creation
            got = s.run(None, {"x": x})
            assert set(fresh_types) - parsed == set(), "run 1 parsed C types (see first_run.RUN_TYPES)"
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_blas_libraries_are_scanned_at_creation(example_plugin, monkeypatch):
    scans = []

    class Counted(threadpoolctl.ThreadpoolController):  # a scan of the loaded libraries per instance
        def __init__(self, *a, **kw):
            scans.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", Counted)
    model = chain_model(("MatMul", "Relu"), shape=(3, 3))
    x = np.eye(3, dtype=np.float32)
    with Environment() as env:
        env.register_plugin("ex", example_plugin(abi.ABI_VERSION))
        with InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"ops": "Relu"})], env=env) as s:
            at_creation = len(scans)
            assert at_creation >= 1
            np.testing.assert_allclose(s.run(None, {"x": x})[0], np.maximum(x @ x, 0), rtol=1e-6)
            assert len(scans) == at_creation, "run 1 scanned the BLAS libraries"
