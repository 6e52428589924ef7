"""torch.nn.LSTM / GRU (2 layers, bidirectional) and a ConvTranspose2d decoder, exported by torch.onnx
(TorchScript exporter, opset 17; tests/models/export_recurrent.py), run on the CPU EP and compared with
onnxruntime and with torch's own outputs (stored beside each model), at the stored shapes and at other
batch and sequence sizes (onnxruntime the reference there)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import host

MODELS_DIR = Path(__file__).resolve().parents[1] / "models" / "recurrent"
NAMES = ("lstm", "gru", "convtranspose")


def load(name: str):
    with np.load(MODELS_DIR / f"{name}.npz") as data:
        arrays = {k: data[k] for k in data.files}
    feeds = {k: v for k, v in arrays.items() if not k.startswith("out:")}
    return MODELS_DIR / f"{name}.onnx", feeds, {k[4:]: v for k, v in arrays.items() if k.startswith("out:")}


def test_fixtures_are_tiny_and_complete():
    for name in NAMES:
        path, feeds, expected = load(name)
        assert path.stat().st_size < 100_000 and feeds and expected


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("level", ["ORT_DISABLE_ALL", "ORT_ENABLE_ALL"])
def test_matches_torch_and_onnxruntime(name, level):
    path, feeds, expected = load(name)
    so = host.SessionOptions()
    so.graph_optimization_level = getattr(host.GraphOptimizationLevel, level)
    sess = host.InferenceSession(str(path), sess_options=so)
    assert set(sess.node_assignment().values()) == {"CPUExecutionProvider"}
    names = [o.name for o in sess.get_outputs()]
    ours = dict(zip(names, sess.run(None, feeds)))
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(names, feeds)
    for out, r in zip(names, ref):
        assert ours[out].shape == expected[out].shape == r.shape
        np.testing.assert_allclose(ours[out], expected[out], rtol=1e-4, atol=1e-5, err_msg=f"{name}:{out} vs torch")
        np.testing.assert_allclose(ours[out], r, rtol=1e-4, atol=1e-5, err_msg=f"{name}:{out} vs onnxruntime")


@pytest.mark.parametrize("name,feeds", [
    ("lstm", {"x": (3, 9, 8), "h0": (4, 3, 12), "c0": (4, 3, 12)}),
    ("lstm", {"x": (1, 1, 8), "h0": (4, 1, 12), "c0": (4, 1, 12)}),
    ("gru", {"x": (11, 2, 8)}),
    ("gru", {"x": (1, 5, 8)}),
])
def test_other_batch_and_sequence_sizes(name, feeds):
    """The exports have dynamic batch and sequence axes."""
    path = MODELS_DIR / f"{name}.onnx"
    rng = np.random.default_rng(len(feeds) + sum(s[0] for s in feeds.values()))
    feeds = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in feeds.items()}
    ours = host.InferenceSession(str(path)).run(None, feeds)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)
