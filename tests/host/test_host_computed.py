"""Values the host's shape program computes reach v7+ plugin kernels in host memory
(EpValueInfo.flags VALUE_HOST_COMPUTED, since 7): flagged in the graph view, handed over without a
copy to the EP's device, so a device EP can read a Reshape's shape without synchronising; older
EPs get them on their device as before."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import abi
import host
from abi.graph_spec import read_graph
from abi.host_inputs import host_read_inputs
from host.plugins.hostapi import ffi
from tests.conftest import example_record
from tests.host.test_shape_program import SHAPES, _reference
from tests.models import dynamic
from tests.plugins.example_ep import mock_device


def _mock_device_env(path: str):
    """An environment whose ExampleEP computes in (mock) device memory the host must copy to."""
    with mock_device():  # read when the plugin registers
        env = host.Environment()
        env.register_plugin("ex", path)
    return env


def test_the_view_flags_exactly_the_shape_programs_values():
    s = host.InferenceSession(dynamic.positions().SerializeToString(), providers=["CPUExecutionProvider"])
    spec = read_graph(ffi, s._partitioner.view.ptr)
    flagged = {v.name for v in spec.values if v.host_computed}
    exported = {s.plan.value_names[v] for v in s.shape_program.exported}
    assert exported and flagged == exported
    assert all(v.flags in (0, abi.VALUE_HOST_COMPUTED) for v in spec.values)
    s.close()


def _reshape_by_program() -> onnx.ModelProto:
    """Y = Reshape(X * X, [rows of R, -1]): the shape comes from Shape(R) through Slice and Concat,
    which the host's shape program computes; Mul and Reshape run on the plugin."""
    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("zero", [0]), ("one", [1]), ("rest", [-1]))]
    nodes = [helper.make_node("Mul", ["X", "X"], ["sq"]),
             helper.make_node("Shape", ["R"], ["xs"]),
             helper.make_node("Slice", ["xs", "zero", "one"], ["batch"]),
             helper.make_node("Concat", ["batch", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["sq", "target"], ["Y"])]
    graph = helper.make_graph(nodes, "reshape_by_program",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", "s", 8]),
                               helper.make_tensor_value_info("R", TensorProto.FLOAT, ["r", 2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", None])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("version", [6, 7])
def test_program_shapes_reach_v7_kernels_in_host_memory(example_plugin, version):
    """The Reshape's shape is a shape-program value at an input Reshape reads on the host: a v7 EP
    gets it in host memory (device_type CPU), a v6 EP on its (mock) device; the data stays there."""
    env = _mock_device_env(example_plugin(version))
    model = _reshape_by_program()
    record = example_record(version)
    s = host.InferenceSession(model.SerializeToString(),
                              providers=[("ExampleEP", {"ops": "Mul,Reshape", "fuse": "0"})], env=env)
    assert set(s.node_assignment().values()) == {"ExampleEP"}
    assert any(n.op_type == "Reshape" for n in s.plan.nodes)
    ref = _reference(model)
    rng = np.random.default_rng(5)
    record.input_devices.clear()
    for batch, seq in SHAPES:
        feeds = {"X": rng.standard_normal((batch, seq, 8)).astype(np.float32), "R": np.zeros((2 * batch, 2), np.float32)}
        np.testing.assert_array_equal(s.run(None, feeds)[0], ref.run(None, feeds)[0])
    assert record.input_devices[abi.DEVICE_CPU] == (len(SHAPES) if version >= 7 else 0)
    assert record.input_devices[abi.DEVICE_GPU] == (3 if version >= 7 else 4) * len(SHAPES)
    s.close()
    gc.collect()
    env.close()


def test_values_at_other_inputs_stay_on_the_device(example_plugin):
    """positions(): Add and Mul read shape-program values at data inputs: a v7 EP gets them on its
    device, as before (only host-read inputs of abi/host_inputs.py come in host memory)."""
    env = _mock_device_env(example_plugin(7))
    model = dynamic.positions()
    record = example_record(7)
    s = host.InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"ops": "Add,Mul", "fuse": "0"})],
                              env=env)
    ref = _reference(model)
    record.input_devices.clear()
    x = np.random.default_rng(6).standard_normal((3, 50, 8)).astype(np.float32)
    np.testing.assert_allclose(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0], rtol=1e-5, atol=1e-6)
    assert record.input_devices[abi.DEVICE_CPU] == 0 and record.input_devices[abi.DEVICE_GPU] > 0
    s.close()
    gc.collect()
    env.close()


def test_the_host_read_table_matches_the_cuda_kernels():
    """Both sides read abi/host_inputs.py: every CUDA kernel that reads inputs on the host reads
    exactly the table's positions for its op."""
    from plugin_cuda.kernels.base import KERNELS

    for op, versions in KERNELS.items():
        for since, cls in versions.items():
            assert set(cls.host_inputs) == set(host_read_inputs(op)), (op, since, cls.host_inputs)


def _counting_transfers(session) -> list:
    """Every host<->device copy the session's executor makes from now on, as (value name or '?', location)."""
    calls, original = [], session.executor.transfer

    def transfer(value, location, ep, stream):
        calls.append(location)
        return original(value, location, ep, stream)
    session.executor.transfer = transfer
    return calls


@pytest.mark.parametrize("fuse", ["0", "1"])
def test_program_values_read_as_data_are_copied_once_per_signature(example_plugin, fuse):
    """positions(): the position-table slice and the 1/sqrt(seq) scale are program values that Add and
    Mul read as data on the (mock) device. The first run of a signature copies them there; later runs
    of that signature copy only X in and Y out; results match the reference at every run."""
    env = _mock_device_env(example_plugin(7))
    model = dynamic.positions()
    s = host.InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"ops": "Add,Mul", "fuse": fuse})],
                              env=env)
    assert set(s.node_assignment().values()) == {"ExampleEP"}
    ref = _reference(model)
    calls = _counting_transfers(s)
    rng, seen = np.random.default_rng(7), set()
    for _ in range(3):
        for batch, seq in SHAPES:
            calls.clear()
            x = rng.standard_normal((batch, seq, 8)).astype(np.float32)
            np.testing.assert_allclose(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0], rtol=1e-6, atol=1e-6)
            first = (batch, seq) not in seen
            seen.add((batch, seq))
            assert len(calls) == (2 + 2 if first else 2), (batch, seq, calls)  # X in, Y out (+ pe, scale)
    signatures = len(set(SHAPES))
    assert s.executor.program_copies.made == 2 * signatures
    s.close()
    gc.collect()
    env.close()


def test_program_copies_are_bounded_by_the_shape_cache(example_plugin):
    """With session.ephost.shape_cache_signatures = 2 the device copies of program values are kept for
    at most two signatures per value; an evicted signature is copied again when it comes back."""
    env = _mock_device_env(example_plugin(7))
    options = host.SessionOptions()
    options.add_session_config_entry("session.ephost.shape_cache_signatures", "2")
    model = dynamic.positions()
    s = host.InferenceSession(model.SerializeToString(), options,
                              providers=[("ExampleEP", {"ops": "Add,Mul", "fuse": "0"})], env=env)
    ref = _reference(model)
    for seq in (3, 5, 7, 3):
        x = np.ones((2, seq, 8), np.float32)
        np.testing.assert_allclose(s.run(None, {"X": x})[0], ref.run(None, {"X": x})[0], rtol=1e-6, atol=1e-6)
        assert len(s.executor.program_copies) <= 2 * 2  # two values, two signatures each
    assert s.executor.program_copies.made == 2 * 4  # seq 3 came back after its eviction
    s.close()
    gc.collect()
    env.close()
