"""Two gates of this turn's dynamic-shape work, drawn over versions and shapes, against onnxruntime.

- Host-computed values (EpValueInfo.flags, since 7): a Reshape whose target the host's shape program
  computes gets that target in host memory when host and plugin negotiated v7 (the flag and the table
  of host-read inputs, abi/host_inputs.py), on the (mock) device below v7; the data stays on the device.
- CPU shape nodes beside a captured graph (GRAPH_ALLOW_CPU_FOR_SHAPES): position ids made on the CPU
  from the input shapes are kept with each shape's graph, and every capture run and replay matches
  onnxruntime; a CPU node that reads data (ArgMax) is refused at session creation.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import abi
from host.errors import GraphCaptureError
from host.runtime.session import InferenceSession
from tests.host.test_capture_shape_values import PROVIDER, _model, _read_mock
from tests.host.test_host_computed import _reshape_by_program
from tests.plugins.example_ep import mock_device
from tests.property import harness as h
from tests.property import strategies as s

PAIRS = [(6, 6), (6, 7), (7, 6), (7, 7)]
RESHAPE = _reshape_by_program()
SHAPES = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=5)


@contextlib.contextmanager
def _mock_device(host_version: int, plugin_version: int):
    with mock_device():  # read when the plugin registers
        with h.example_env(host_version, (plugin_version,)) as env:
            yield env


@given(pair=st.sampled_from(PAIRS), shapes=SHAPES)
@settings(deadline=None, max_examples=s.budget(10))
def test_host_computed_shapes_reach_v7_kernels_in_host_memory(pair, shapes):
    host_version, plugin_version = pair
    n = min(pair)
    reference = ort.InferenceSession(RESHAPE.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(len(shapes))
    with _mock_device(host_version, plugin_version) as env:
        provider = (h.EXAMPLE_EP, {"ops": "Mul,Reshape", "fuse": "0"})
        with InferenceSession(RESHAPE.SerializeToString(), providers=[provider], env=env) as sess:
            assert set(sess.node_assignment().values()) == {h.EXAMPLE_EP}
            for b, seq in shapes:
                feeds = {"X": rng.standard_normal((b, seq, 8)).astype(np.float32), "R": np.zeros((b, 2), np.float32)}
                np.testing.assert_array_equal(sess.run(None, feeds)[0], reference.run(None, feeds)[0])
    devices = h.record(plugin_version).input_devices
    assert devices[abi.DEVICE_CPU] == (len(shapes) if n >= 7 else 0)
    assert devices[abi.DEVICE_GPU] == (3 if n >= 7 else 4) * len(shapes)


@given(shapes=SHAPES, from_data=st.booleans())
@settings(deadline=None, max_examples=s.budget(10))
def test_cpu_shape_nodes_beside_a_capture(shapes, from_data):
    model = _model(ids_from_data=from_data)
    with _mock_device(7, 7) as env:
        if from_data:
            with pytest.raises(GraphCaptureError, match="offending node\\(s\\): 'argmax'"):
                InferenceSession(model.SerializeToString(), providers=[PROVIDER], env=env)
            return
        reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(len(shapes))
        with InferenceSession(model.SerializeToString(), providers=[PROVIDER], env=env) as sess:
            binding, buffers = sess.io_binding(), {}
            for b, seq in shapes:
                x, y = buffers.setdefault((b, seq), (np.zeros((b, seq, 8), np.float32), np.zeros((b, seq, 8), np.float32)))
                x[...] = rng.standard_normal(x.shape)
                binding.bind_input("X", device_type="cuda", device_id=0, element_type=np.float32, shape=x.shape,
                                   buffer_ptr=x.ctypes.data)
                binding.bind_output("Y", device_type="cuda", device_id=0, element_type=np.float32, shape=y.shape,
                                    buffer_ptr=y.ctypes.data)
                sess.run_with_iobinding(binding)
                np.testing.assert_allclose(y, reference.run(None, {"X": x})[0], rtol=1e-6)
            assert sess.fallbacks["graph_captured"] == len(buffers)
            for graph in sess.capture._graphs[(sess.capture._thread(), 0)].by_shape.values():
                b, seq = graph.shape[0][1][:2]
                assert any(c.shape == (b, seq) and (_read_mock(c) == np.arange(seq)).all() for c in graph.copies)
