"""CPU shape computations beside a captured graph (GRAPH_ALLOW_CPU_FOR_SHAPES): only nodes whose int64
outputs come from input shapes, constants and the host's shape program may stay on the CPU (a
replay does not run them, so their values must hold for every replay of that shape's graph), and
the copies the host makes of them for the device during the capture runs live as long as the
graph (a replay reads them again). Found with BERT-base's position ids on the CUDA EP."""

from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from host.errors import GraphCaptureError
from host.runtime.session import InferenceSession
from tests.plugins.example_ep import mock_device

TABLE = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
PROVIDER = ("ExampleEP", {"ops": "Add,Gather", "enable_graph": "1", "min_runs": "1", "graph_policy": "shapes"})


def _model(ids_from_data: bool):
    """Y = X + table[ids]: ids are the position ids Expand(Range(seq)) over [batch, seq], a CPU node
    of shape values only, or (ids_from_data) ArgMax of X, a CPU node that reads data."""
    inits = [numpy_helper.from_array(TABLE, "table")] + [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("zero", 0), ("one", 1), ("axes0", [0]), ("two", [2]), ("start", [0]))]
    if ids_from_data:
        nodes = [helper.make_node("ArgMax", ["X"], ["ids"], axis=2, keepdims=0, name="argmax")]
    else:
        nodes = [helper.make_node("Shape", ["X"], ["xs"]),
                 helper.make_node("Gather", ["xs", "one"], ["seq"], axis=0),
                 helper.make_node("Range", ["zero", "seq", "one"], ["r"]),
                 helper.make_node("Unsqueeze", ["r", "axes0"], ["r2"]),
                 helper.make_node("Slice", ["xs", "start", "two"], ["bs"]),
                 helper.make_node("Expand", ["r2", "bs"], ["ids"], name="positions")]
    nodes += [helper.make_node("Gather", ["table", "ids"], ["pe"], axis=0, name="embed"),
              helper.make_node("Add", ["X", "pe"], ["Y"], name="add")]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", "s", 8])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", "s", 8])
    # IR 10: onnxruntime on the GPU machine (a newer onnx) refuses the IR its onnx writes by default.
    return helper.make_model(helper.make_graph(nodes, "positions", [x], [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _read_mock(t) -> np.ndarray:
    """A copy of a DeviceTensor on the mock device, whose memory is host memory."""
    buf = (ctypes.c_char * t.nbytes).from_address(t.ptr)
    return np.frombuffer(bytes(buf), t.dtype).reshape(t.shape)


@pytest.fixture
def env(example_plugin):
    with mock_device():  # read when the plugin registers
        env = host.Environment()
        env.register_plugin("ex", example_plugin(7))
    yield env
    gc.collect()
    env.close()


def test_shape_values_copied_at_capture_live_with_the_graph(env):
    model = _model(ids_from_data=False)
    sess = InferenceSession(model.SerializeToString(), providers=[PROVIDER], env=env)
    assert sess.node_assignment()["positions"] == "CPUExecutionProvider"
    ref = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    rng = np.random.default_rng(1)
    buffers = {}
    for b, s in [(2, 5), (3, 7), (2, 5), (3, 7)]:
        if (b, s) not in buffers:
            buffers[(b, s)] = (np.zeros((b, s, 8), np.float32), np.zeros((b, s, 8), np.float32))
        x, y = buffers[(b, s)]
        x[...] = rng.standard_normal(x.shape)
        # Fixed buffers in the (mock) device's memory, which is host memory this test can fill.
        binding.bind_input("X", device_type="cuda", device_id=0, element_type=np.float32, shape=x.shape,
                           buffer_ptr=x.ctypes.data)
        binding.bind_output("Y", device_type="cuda", device_id=0, element_type=np.float32, shape=y.shape,
                            buffer_ptr=y.ctypes.data)
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(y, ref.run(None, {"X": x})[0], rtol=1e-6)
    assert sess.fallbacks["graph_captured"] == 2
    graphs = sess.capture._graphs[(sess.capture._thread(), 0)].by_shape.values()
    for graph in graphs:  # each graph keeps the device copy of its own shape's position ids
        b, s = graph.shape[0][1][:2]
        kept = [_read_mock(c) for c in graph.copies]
        assert any(k.shape == (b, s) and (k == np.arange(s)).all() for k in kept), [k.shape for k in kept]
    sess.close()


def test_a_cpu_node_reading_data_is_refused_beside_a_capture(env):
    model = _model(ids_from_data=True)
    with pytest.raises(GraphCaptureError, match="offending node\\(s\\): 'argmax' \\(ArgMax on CPUExecutionProvider\\)"):
        InferenceSession(model.SerializeToString(), providers=[PROVIDER], env=env)


def test_copies_are_kept_only_by_capture_runs(env):
    """Eager runs (capture off) keep nothing past the run."""
    model = _model(ids_from_data=False)
    sess = InferenceSession(model.SerializeToString(), providers=[("ExampleEP", {"ops": "Add,Gather"})], env=env)
    x = np.random.default_rng(2).standard_normal((2, 5, 8)).astype(np.float32)
    sess.run(None, {"X": x})
    assert getattr(sess.executor._tls, "copies", None) is None
    done = threading.Event()
    threading.Thread(target=lambda: (sess.run(None, {"X": x}), done.set())).start()
    assert done.wait(30)
    sess.close()
