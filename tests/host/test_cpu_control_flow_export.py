"""A torch.onnx export of a data-dependent loop (tests/models/export_loop.py: a scripted `while` on the
state's norm, TorchScript exporter, opset 17 -> an ONNX Loop) on the CPU EP, against onnxruntime and
torch's stored outputs, at the stored input and at inputs that change the trip count. The CUDA side:
tests/plugin_cuda/test_control_flow_gpu.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import host

LOOP = Path(__file__).resolve().parents[1] / "models" / "control_flow" / "loop"


def load_loop():
    with np.load(f"{LOOP}.npz") as data:
        arrays = {k: data[k] for k in data.files}
    return f"{LOOP}.onnx", {"x": arrays["x"]}, {k[4:]: v for k, v in arrays.items() if k.startswith("out:")}


def test_the_export_holds_a_loop_and_matches_torch():
    path, feeds, expected = load_loop()
    s = host.InferenceSession(path)
    assert [n.op_type for n in s.plan.nodes].count("Loop") == 1
    y, steps = s.run(None, feeds)
    np.testing.assert_allclose(y, expected["y"], rtol=1e-4, atol=1e-5)
    assert steps.tolist() == expected["steps"].tolist() and steps[0] > 1


@pytest.mark.parametrize("scale", [0.05, 1.0, 30.0])
def test_trip_count_follows_the_input_and_matches_onnxruntime(scale):
    path, feeds, _ = load_loop()
    x = (scale * np.random.default_rng(7).standard_normal((2, 6))).astype(np.float32)
    ours = host.InferenceSession(path).run(None, {"x": x})
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for got, want in zip(ours, ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert (ours[1][0] == 0) == (scale == 30.0)  # a large input is past the bound before the first step
