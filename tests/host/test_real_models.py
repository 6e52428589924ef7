"""Real exports (tests/models: BERT, GPT-2, ViT, Llama, MobileNetV3 from both torch.onnx exporters) on the CPU EP.

Each fixture runs with the optimizer off (ORT_DISABLE_ALL) and at the default level (ORT_ENABLE_ALL) and must
match onnxruntime's CPU provider (rtol 1e-3, atol 1e-4, the issue's bar) and the outputs torch computed at
export time (same tolerance: the exports themselves differ from torch by < 2e-6). The atol is scaled down
for outputs smaller than 1: the MobileNetV3 fixture's logits are ~2e-7 (its random-init activations shrink
through the network), where a bare atol of 1e-4 would check nothing.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from host.optimizer import GraphOptimizationLevel
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.models import available_models, load

RTOL, ATOL = 1e-3, 1e-4
MODELS = available_models()
ARCHS = ("bert", "gpt2", "vit", "llama", "mobilenetv3")

LEVELS = ["ORT_DISABLE_ALL", "ORT_ENABLE_ALL"]


def _options(level: str) -> SessionOptions:
    so = SessionOptions()
    so.graph_optimization_level = getattr(GraphOptimizationLevel, level)
    return so


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """rtol 1e-3 with atol 1e-4 scaled by the output's magnitude when that is below 1."""
    scale = min(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * scale, err_msg=what)


@cache
def _onnxruntime_outputs(name: str) -> dict[str, np.ndarray]:
    path, feeds, _ = load(name)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_every_architecture_has_both_exports():
    """The fixture set is complete: 5 architectures x 2 exporters, each under ~1 MB."""
    assert sorted(MODELS) == sorted(f"{a}_{e}" for a in ARCHS for e in ("dynamo", "torchscript"))
    for name in MODELS:
        path, feeds, expected = load(name)
        assert path.stat().st_size < 1_000_000, name
        model = onnx.load(str(path))
        assert model.ir_version <= 10
        assert [i.name for i in model.graph.input] == list(feeds)
        assert [o.name for o in model.graph.output] == list(expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODELS)
def test_matches_onnxruntime_and_torch(name, level):
    path, feeds, expected = load(name)
    sess = InferenceSession(str(path), sess_options=_options(level), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, feeds)))
    assert set(sess.node_assignment().values()) == {"CPUExecutionProvider"}
    reference = _onnxruntime_outputs(name)
    for out in names:
        assert got[out].shape == reference[out].shape and got[out].dtype == reference[out].dtype
        assert_close(got[out], reference[out], f"{name}:{out} vs ORT")
        assert_close(got[out], expected[out], f"{name}:{out} vs torch")


@pytest.mark.parametrize("name", MODELS)
def test_unoptimized_runs_without_the_optimizer(name):
    """The export as it is (optimizer off where there is one) runs on the CPU EP, every op it uses having a
    CPU kernel, and matches torch."""
    path, feeds, expected = load(name)
    sess = InferenceSession(str(path), sess_options=_options("ORT_DISABLE_ALL"), providers=["CPUExecutionProvider"])
    assert set(sess.node_assignment().values()) == {"CPUExecutionProvider"}
    for out, value in zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)):
        assert_close(value, expected[out], f"{name}:{out} vs torch")


@pytest.mark.parametrize("name", MODELS)
def test_default_level_never_adds_nodes(name):
    path, _, _ = load(name)
    plain = InferenceSession(str(path), sess_options=_options("ORT_DISABLE_ALL"), providers=["CPUExecutionProvider"])
    optimized = InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert len(optimized.node_assignment()) <= len(plain.node_assignment())
