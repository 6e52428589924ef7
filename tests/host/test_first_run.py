"""Issue 29: a session's first run does no one-time host work (host/runtime/first_run.py): it parses
no C type string (cffi's pycparser pass, milliseconds each) and does not scan the BLAS libraries.
Observed through a count of cffi's pycparser passes (the host FFI's type cache emptied first) and a
counting stand-in for threadpoolctl's controller; results compared with onnxruntime's CPU EP."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import threadpoolctl
from cffi import cparser

import abi
from host.plugins.environment import Environment
from host.plugins.hostapi import ffi
from host.runtime.session import InferenceSession
from tests.abi.test_compiled import chain_model
from tests.spies import record_calls


@pytest.fixture
def parses(monkeypatch):
    """The C sources cffi's pycparser pass reads (cffi.cparser.Parser._parse: an in-line FFI's type strings,
    milliseconds each), with the host FFI's type cache emptied as in a new process where it has one (the
    in-line FFI; the out-of-line one, abi/outofline.py, parses type strings in C)."""
    calls = record_calls(monkeypatch, cparser.Parser, "_parse")
    cache = getattr(ffi, "_parsed_types", None)
    saved = dict(cache or {})
    if cache is not None:
        cache.clear()
    yield calls
    if cache is not None:
        cache.update(saved)


@pytest.mark.parametrize("ep_options", [{"fuse": "1"}, {}], ids=["compiled", "kernels"])
def test_run_1_parses_no_c_type(example_plugin, parses, ep_options):
    model = chain_model(("Add", "Relu", "Sigmoid", "Mul", "Add"))
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with Environment() as env:
        env.register_plugin("ex", example_plugin(abi.ABI_VERSION))
        with InferenceSession(model.SerializeToString(), providers=[("ExampleEP", ep_options)], env=env) as s:
            if hasattr(ffi, "_parsed_types"):  # the in-line FFI: first_run.RUN_TYPES parsed at creation
                assert "EpRunOptions*" in ffi._parsed_types
            at_creation = len(parses)
            got = s.run(None, {"x": x})
            assert parses[at_creation:] == [], "run 1 parsed C types (see first_run.RUN_TYPES)"
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_run_1_parses_no_c_type_with_the_inline_ffi():
    """The same check in a process whose host FFI is the in-line one (EPHOST_CFFI_MODULES=0), where the
    type strings of a run are cffi's pycparser pass unless first_run parses them at creation."""
    from tests.abi.conftest import ROOT, subprocess_env

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "test_run_1_parses_no_c_type and not inline"], cwd=ROOT, capture_output=True, text=True,
                          env=subprocess_env(EPHOST_CFFI_MODULES="0"), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


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
