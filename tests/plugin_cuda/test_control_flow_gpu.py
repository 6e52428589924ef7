"""Control flow in a CUDA EP session: the host runs If / Loop / Scan; for now their bodies run on the CPU EP
(a device EP is not offered body nodes: values crossing a body's boundary from the device are not copied
yet), the rest of the model on the CUDA EP; results against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

import host
from tests.host.test_control_flow import LOOP_FEEDS, if_model, loop_model, ort_run, scan_model

pytestmark = pytest.mark.gpu


def _session(m, genv):
    return host.InferenceSession(m, providers=["CUDAExecutionProvider"], env=genv)


def test_loop_body_on_the_device(genv):
    s = _session(loop_model(with_if=True), genv)
    body = next(n for n in s.plan.nodes if n.op_type == "Loop").kernel.runners["body"]
    assert all(n.ep is None for n in body.plan.nodes)  # the CPU EP
    assert s.fallbacks["subgraph_without_device_eps"] >= 1
    for got, want in zip(s.run(None, LOOP_FEEDS), ort_run(loop_model(with_if=True), LOOP_FEEDS)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_branches_on_the_device(genv, sign):
    x = sign * np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(_session(if_model(), genv).run(None, {"x": x})[0], ort_run(if_model(), {"x": x})[0],
                               rtol=1e-5)


def test_scan_body_on_the_device(genv):
    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal(2).astype(np.float32), "p0": rng.standard_normal(2).astype(np.float32),
             "xa": rng.standard_normal((2, 4)).astype(np.float32), "xb": rng.standard_normal((4, 2)).astype(np.float32)}
    for got, want in zip(_session(scan_model(), genv).run(None, feeds), ort_run(scan_model(), feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
