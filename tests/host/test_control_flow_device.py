"""Control-flow bodies on a device EP, without a GPU: the example EP's mock device (EPHOST_TEST_MOCK_DEVICE=1,
device memory the host must copy through the plugin) is offered body nodes like a main graph's; values it
makes stay on its device from one iteration to the next; CPU nodes of the same body get them copied in;
results against onnxruntime. The CUDA side: tests/plugin_cuda/test_control_flow_gpu.py."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest

import host
from abi import sdk
from host.runtime.tensor import DeviceTensor
from tests.host.test_control_flow import LOOP_FEEDS, if_model, loop_model, ort_run
from tests.host.test_cpu_control_flow_export import load_loop
from tests.plugins.example_ep import mock_device

EP = "ExampleEP"


@pytest.fixture(scope="module")
def device_env(example_plugin):
    with mock_device():  # read when the plugin registers
        env = host.Environment()
        env.register_plugin("ex", example_plugin(6))
    yield env
    gc.collect()
    env.close()


def _body(s, op_type="Loop"):
    return next(n for n in s.plan.nodes if n.op_type == op_type).kernel.runners["body"]


def _record_carried(body) -> list:
    """Wraps the body runner: the value handed to the next iteration as the first carried value."""
    seen, run = [], body.run

    def recording(formal, outer):
        outs = run(formal, outer)
        seen.append(outs[1])
        return outs

    body.run = recording
    return seen


@pytest.mark.parametrize("fuse", ["0", "1"])
def test_loop_body_runs_on_the_device_and_carries_device_values(device_env, fuse):
    m = loop_model(with_if=True)
    s = host.InferenceSession(m, providers=[(EP, {"ops": "Add,Mul,Sub", "fuse": fuse})], env=device_env)
    assert s.plan.eps[0].location[0] == sdk.abi.DEVICE_GPU
    body = _body(s)
    on_device = {name for n in body.plan.nodes if n.ep is not None for name in (n.members or (n.name,))}
    assert {"mul", "add"} <= on_device
    seen = _record_carried(body)
    for got, want in zip(s.run(None, LOOP_FEEDS), ort_run(m, LOOP_FEEDS)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(seen) >= 2 and all(isinstance(v, DeviceTensor) for v in seen)  # acc_out stays on the device
    s.close()


def test_if_branches_on_the_device_read_an_outer_host_value(device_env):
    s = host.InferenceSession(if_model(), providers=[(EP, {"ops": "Mul,Sub"})], env=device_env)
    branches = next(n for n in s.plan.nodes if n.op_type == "If").kernel.runners
    assert {n.ep.name for r in branches.values() for n in r.plan.nodes} == {EP}
    for sign in (1.0, -1.0):
        x = sign * np.arange(1, 7, dtype=np.float32).reshape(2, 3)
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ort_run(if_model(), {"x": x})[0], rtol=1e-6)
    s.close()


@pytest.mark.parametrize("fuse", ["0", "1"])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_torch_loop_export_with_a_mixed_body(device_env, fuse, scale):
    """The body's MatMul / Add / Mul on the device, its Tanh / ReduceSum / Sqrt / Less on the CPU EP: values
    cross both ways inside every iteration; the carried state stays on the device."""
    path, feeds, expected = load_loop()
    if scale is not None:
        feeds = {"x": (scale * np.random.default_rng(7).standard_normal((2, 6))).astype(np.float32)}
    s = host.InferenceSession(path, providers=[(EP, {"ops": "MatMul,Add,Mul", "fuse": fuse})], env=device_env)
    body = _body(s)
    placed = {n.op_type: n.ep is not None for n in body.plan.nodes}
    assert any(placed.values()) and not all(placed.values()), placed
    seen = _record_carried(body)
    got = s.run(None, feeds)
    for g, w in zip(got, ort_run(onnx.load(path), feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    if scale is None:
        np.testing.assert_allclose(got[0], expected["y"], rtol=1e-4, atol=1e-5)
    assert got[1][0] >= 2 and all(isinstance(v, DeviceTensor) for v in seen)
    s.close()


def test_scan_body_on_the_device(device_env):
    from tests.host.test_control_flow import scan_model

    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal(2).astype(np.float32), "p0": rng.standard_normal(2).astype(np.float32),
             "xa": rng.standard_normal((2, 4)).astype(np.float32), "xb": rng.standard_normal((4, 2)).astype(np.float32)}
    s = host.InferenceSession(scan_model(), providers=[(EP, {"ops": "Add,Mul,Sub"})], env=device_env)
    assert {n.ep is not None for n in _body(s, "Scan").plan.nodes} == {True}
    for got, want in zip(s.run(None, feeds), ort_run(scan_model(), feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    s.close()


def test_device_values_reach_a_body_with_no_device_node(device_env):
    """The loop's initial state comes from the device (Relu on the mock device) and its body has no node
    the EP takes: the body's CPU nodes still get the value copied in, through the session's data transfers
    (a body's executor copies with every EP of the session, not only those holding its nodes)."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    from tests.host.test_control_flow import loop_body, model, vi

    nodes = [h.make_node("Relu", ["a"], ["a0"], name="relu"),
             h.make_node("Loop", ["M", "c0", "a0"], ["acc", "scans"], body=loop_body(), name="loop0")]
    m = model(nodes, [vi("M", TP.INT64, []), vi("c0", TP.BOOL, []), vi("a", TP.FLOAT, [3])],
              [vi("acc", TP.FLOAT, [3]), vi("scans", TP.FLOAT, ["n", 3])],
              [h.make_tensor("w", TP.FLOAT, [3], [0.5, -1.0, 2.0]), h.make_tensor("limit", TP.FLOAT, [], [40.0])])
    s = host.InferenceSession(m, providers=[(EP, {"ops": "Relu"})], env=device_env)
    assert s.node_assignment()["relu"] == EP and all(n.ep is None for n in _body(s).plan.nodes)
    feeds = {"M": np.array(5, np.int64), "c0": np.array(True), "a": np.array([1.0, -2.0, 3.0], np.float32)}
    for got, want in zip(s.run(None, feeds), ort_run(m, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    s.close()
