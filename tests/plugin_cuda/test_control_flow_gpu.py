"""Control flow in a CUDA EP session: the host runs If / Loop / Scan, their bodies are partitioned like a graph
(the CUDA EP claims body nodes, compiled plans take what they can), device values stay on the device across
iterations; results against onnxruntime. Includes a torch.onnx export of a data-dependent loop
(tests/models/export_loop.py)."""

from __future__ import annotations

import numpy as np
import pytest

import host
from host.runtime.plan import Kind
from host.runtime.tensor import DeviceTensor
from tests.host.test_control_flow import LOOP_FEEDS, if_model, loop_model, ort_run, scan_model
from tests.host.test_cpu_control_flow_export import load_loop

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
PATHS = {"plans": {}, "kernels": {"compiled_plan": "0"}}


def _session(m, genv, **options):
    return host.InferenceSession(m, providers=[(CUDA, {"use_tf32": "0", **options})], env=genv)


def _body_placement(s, op_type="Loop", attr="body") -> dict:
    """'name:op type' -> the provider, for every node of the body (members of compiled partitions included)."""
    body = next(n for n in s.plan.nodes if n.op_type == op_type).kernel.runners[attr]
    assignment = body.plan.node_assignment()
    return {f"{n.name}:{n.op_type}": assignment.get(n.name, "host shape program") for n in body.graph.nodes}


def _record_carried(s, op_type="Loop") -> list:
    """Wraps the body runner: the type of each iteration's first carried output (outputs[1])."""
    body = next(n for n in s.plan.nodes if n.op_type == op_type).kernel.runners["body"]
    seen, run = [], body.run

    def recording(formal, outer):
        outs = run(formal, outer)
        seen.append(type(outs[1]).__name__)
        return outs

    body.run = recording
    return seen


@pytest.mark.parametrize("path", list(PATHS))
def test_loop_body_on_the_device(genv, path):
    s = _session(loop_model(with_if=True), genv, **PATHS[path])
    placed = _body_placement(s)
    print(f"loop body ({path}): {placed}")
    assert sum(v == CUDA for v in placed.values()) >= 1  # the float work (Mul, Add, ReduceSum, Less)
    seen = _record_carried(s)
    for got, want in zip(s.run(None, LOOP_FEEDS), ort_run(loop_model(with_if=True), LOOP_FEEDS)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert seen and set(seen) == {DeviceTensor.__name__}, seen  # carried values stay on the device


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_branches_on_the_device(genv, sign):
    x = sign * np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    s = _session(if_model(), genv)
    branches = next(n for n in s.plan.nodes if n.op_type == "If").kernel.runners
    placed = {n.op_type: n.ep.name if n.ep is not None else "CPU" for r in branches.values() for n in r.plan.nodes}
    print(f"if branches: {placed}")
    assert CUDA in placed.values()
    np.testing.assert_allclose(s.run(None, {"x": x})[0], ort_run(if_model(), {"x": x})[0], rtol=1e-5)


def test_scan_body_on_the_device(genv):
    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal(2).astype(np.float32), "p0": rng.standard_normal(2).astype(np.float32),
             "xa": rng.standard_normal((2, 4)).astype(np.float32), "xb": rng.standard_normal((4, 2)).astype(np.float32)}
    s = _session(scan_model(), genv)
    print(f"scan body: {_body_placement(s, 'Scan')}")
    assert CUDA in _body_placement(s, "Scan").values()
    for got, want in zip(s.run(None, feeds), ort_run(scan_model(), feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("scale", [None, 0.05, 30.0])
def test_torch_loop_export_runs_its_body_on_the_device(genv, path, scale):
    model_path, feeds, expected = load_loop()
    if scale is not None:
        feeds = {"x": (scale * np.random.default_rng(7).standard_normal((2, 6))).astype(np.float32)}
    s = _session(model_path, genv, **PATHS[path])
    placed = _body_placement(s)
    print(f"torch loop body ({path}): {placed}; outer: {s.node_assignment()}")
    float_work = [k for k in placed if k.split(":")[1] in ("MatMul", "Tanh", "Sqrt", "ReduceSum")]
    assert len(float_work) == 4 and all(placed[k] == CUDA for k in float_work), placed
    body = next(n for n in s.plan.nodes if n.op_type == "Loop").kernel.runners["body"]
    compiled = [n for n in body.plan.nodes if n.kind is Kind.COMPILED]
    crossings = sum(n.ep is not None for n in body.plan.nodes)
    print(f"torch loop body ({path}): {crossings} EP calls per iteration; compiled: {[n.members for n in compiled]}")
    if path == "plans":  # the body's float work goes into compiled partitions (the bool Less stays per node)
        assert compiled, placed
    seen = _record_carried(s)
    got = s.run(None, feeds)
    want = ort_run(onnx_model(model_path), feeds)
    for name, g, w in zip(("y", "steps"), got, want):
        err = float(np.abs(g - w).max()) if w.size else 0.0
        print(f"torch loop ({path}, scale {scale}) {name}: max abs error {err:.2e}")
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    if scale is None:
        np.testing.assert_allclose(got[0], expected["y"], rtol=1e-4, atol=1e-5)
    if got[1][0] > 0:
        assert set(seen) == {DeviceTensor.__name__}, seen


def onnx_model(path):
    import onnx

    return onnx.load(path)
