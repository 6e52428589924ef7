"""IOBinding outputs across memory kinds: every combination of where an output is produced (a plugin
EP on a device, the CPU EP next to that plugin EP, the CPU EP with the plugin EP claiming nothing)
and where it is bound (host memory, device memory, not bound), against onnxruntime CPU.

The device is the example plugin's mock GPU (EPHOST_TEST_MOCK_DEVICE=1): host memory the host may
only reach through the plugin's data transfer, so every crossing the host forgets shows as an error
or a wrong value, without a GPU.
"""

from __future__ import annotations

import gc

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import abi
import host
from host.runtime.tensor import DeviceTensor
from tests.conftest import example_record
from tests.plugins.example_ep import mock_device

SHAPE = (2, 3)
# Which EP produces the output Z of Z = relu(X + Y) * X (the node 'mul').
PRODUCERS = {
    "plugin": {},                      # every node on the mock device
    "cpu_next_to_plugin": {"ops": "Add,Relu"},  # 'mul' on the CPU EP, the plugin EP in the plan
    "cpu_only": {"ops": "Sub"},        # nothing claimed: the plugin EP serves the copy alone
}
BINDINGS = ("host", "device", "unbound")


def chain_model() -> onnx.ModelProto:
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(SHAPE)) for n in "XYZ"]
    nodes = [helper.make_node("Add", ["X", "Y"], ["A"], name="add"),
             helper.make_node("Relu", ["A"], ["B"], name="relu"),
             helper.make_node("Mul", ["B", "X"], ["Z"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "chain", vi[:2], vi[2:]),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def mock_env(example_plugin):
    with mock_device():  # read when the plugin registers
        env = host.Environment()
        env.register_plugin("ex", example_plugin(5))
    yield env
    gc.collect()
    env.close()


@pytest.fixture(scope="module")
def feeds_and_reference():
    rng = np.random.default_rng(0)
    feeds = {"X": rng.standard_normal(SHAPE).astype(np.float32), "Y": rng.standard_normal(SHAPE).astype(np.float32)}
    ref = ort.InferenceSession(chain_model().SerializeToString(), providers=["CPUExecutionProvider"])
    return feeds, ref.run(None, feeds)[0]


def test_the_mock_device_is_a_device(mock_env):
    s = host.InferenceSession(chain_model(), providers=["ExampleEP"], env=mock_env)
    assert s.plan.eps[0].location == (abi.DEVICE_GPU, 0)


def _copies(direction: str) -> int:
    return example_record(5).host_calls[f"copy {direction}"]


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize("producer", sorted(PRODUCERS))
def test_bound_output_gets_the_value_wherever_it_was_made(mock_env, feeds_and_reference, producer, binding):
    feeds, expected = feeds_and_reference
    s = host.InferenceSession(chain_model(), providers=[("ExampleEP", PRODUCERS[producer])], env=mock_env)
    on_cpu = s.node_assignment()["mul"] == "CPUExecutionProvider"
    assert on_cpu == (producer != "plugin")
    b = s.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    backing = np.full(SHAPE, np.nan, np.float32)  # the mock device's memory is host memory: read it here
    if binding == "host":
        b.bind_output("Z", backing)
    elif binding == "device":
        b.bind_output("Z", device_type="cuda", device_id=0, element_type=np.float32, shape=SHAPE,
                      buffer_ptr=backing.ctypes.data)
    else:
        b.bind_output("Z")
    into_device = _copies("0->1")
    for _ in range(2):  # a second run refills the same buffers
        backing[...] = np.nan
        s.run_with_iobinding(b)
        got = b.get_output_values()[0]
        np.testing.assert_allclose(b.copy_outputs_to_cpu()[0], expected, rtol=1e-6, atol=1e-6)
        if binding != "unbound":
            np.testing.assert_allclose(backing, expected, rtol=1e-6, atol=1e-6)
    if binding == "device":
        assert isinstance(got, DeviceTensor) and got.ptr == backing.ctypes.data
        if on_cpu:  # the CPU EP's result went into the device buffer through the plugin's transfer
            assert _copies("0->1") - into_device >= 2
    elif binding == "host":
        assert isinstance(got, np.ndarray) and got.ctypes.data == backing.ctypes.data
    else:
        assert isinstance(got, DeviceTensor) != on_cpu  # left where it was made
    s.close()


def test_a_bound_device_buffer_of_the_wrong_shape_is_refused(mock_env, feeds_and_reference):
    feeds, _ = feeds_and_reference
    s = host.InferenceSession(chain_model(), providers=[("ExampleEP", PRODUCERS["cpu_only"])], env=mock_env)
    b = s.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    backing = np.zeros((3, 2), np.float32)
    b.bind_output("Z", device_type="cuda", device_id=0, element_type=np.float32, shape=(3, 2),
                  buffer_ptr=backing.ctypes.data)
    with pytest.raises(host.InvalidArgument, match=r"^output 'Z' is bound to a buffer of shape \[3, 2\] and "
                                                   r"dtype float32; the model produced shape \[2, 3\], dtype float32$"):
        s.run_with_iobinding(b)
    s.close()


def test_a_device_no_ep_serves_is_refused(mock_env, feeds_and_reference):
    feeds, _ = feeds_and_reference
    s = host.InferenceSession(chain_model(), providers=[("ExampleEP", PRODUCERS["cpu_next_to_plugin"])], env=mock_env)
    b = s.io_binding()
    for name, value in feeds.items():
        b.bind_cpu_input(name, value)
    backing = np.zeros(SHAPE, np.float32)
    b.bind_output("Z", device_type="cuda", device_id=3, element_type=np.float32, shape=SHAPE,
                  buffer_ptr=backing.ctypes.data)
    with pytest.raises(host.EpError, match=r"^output 'Z' is bound to device memory at \(1, 3\); no execution "
                                           r"provider of this session copies into it \(session EPs at: \[\(1, 0\)\]\)$"):
        s.run_with_iobinding(b)
    s.close()


def test_a_host_to_device_transfer_without_an_ep_uses_the_target_devices(mock_env):
    """Executor.transfer(ep=None) to a device: the copy goes through the EP of the target device
    (choosing by the source, the host, found none: 'no data transfer can copy from (0, 0) to (1, 0)')."""
    s = host.InferenceSession(chain_model(), providers=[("ExampleEP", PRODUCERS["cpu_only"])], env=mock_env)
    value = np.arange(6, dtype=np.float32).reshape(SHAPE)
    moved = s.executor.transfer(value, (abi.DEVICE_GPU, 0), None, None)
    assert isinstance(moved, DeviceTensor) and (moved.device_type, moved.device_id) == (abi.DEVICE_GPU, 0)
    np.testing.assert_array_equal(s.executor.to_host(moved), value)
    s.close()
