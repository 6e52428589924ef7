"""Issue 23's per-node cost on the CPU EP at small shapes: the chains and fast paths added for it, each
against onnxruntime, with and without the compiled kernels."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from onnx import helper

from host.cpu_ep import native
from tests.host.test_cpu_speed_paths import _chains, _ephost, _model, _ort

F32 = np.float32
TOL = {"rtol": 1e-4, "atol": 1e-5}
LIB = native.LIB


class _Spy:
    """Stands for the library and counts calls per function."""

    def __init__(self, lib):
        self._lib = lib
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def call(*args):
            self.calls[name] += 1
            return fn(*args)

        return call


@pytest.fixture(params=["compiled", "numpy"])
def kernels(request):
    """The spy over the compiled kernels, or None with the NumPy paths everywhere."""
    if request.param == "numpy":
        native.use(None)
        yield None
    else:
        if LIB is None:
            pytest.fail(f"the CPU kernels are not loaded: {native.LOAD_ERROR}")
        spy = _Spy(LIB)
        native.use(spy)
        yield spy
    native.use(LIB)


def _gelu_mlp(approximate: str, outputs=("y",)):
    """x @ W1 -> Gelu -> @ W2: GPT-2's MLP as the dynamo exporter writes it (opset 20 Gelu)."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((1, 16, 24)).astype(F32)
    weights = {"w1": rng.standard_normal((24, 40)).astype(F32), "w2": rng.standard_normal((40, 24)).astype(F32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc"),
             helper.make_node("Gelu", ["h"], ["g"], approximate=approximate, name="gelu"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="proj")]
    return _model(nodes, {"x": x}, list(outputs), weights, opset=20), {"x": x}


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_matmul_then_gelu_runs_as_one_gemm(kernels, approximate):
    model, feeds = _gelu_mlp(approximate)
    sess = _ephost(model)
    got = sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, _ort(model, feeds)[0], **TOL)
    assert _chains(sess) == [("_EpilogueChain", ("fc", "gelu"))]
    if kernels is not None:  # the Gelu is the GEMM's epilogue step: no call of its own
        assert kernels.calls == {"ep_gemm": 2}, dict(kernels.calls)


def test_a_gelu_input_that_is_a_graph_output_is_not_joined(kernels):
    model, feeds = _gelu_mlp("tanh", outputs=("y", "h"))
    sess = _ephost(model)
    for got, want in zip(sess.run(None, feeds), _ort(model, feeds)):
        np.testing.assert_allclose(got, want, **TOL)
    assert _chains(sess) == []
