"""Initializers that per-node kernels of a plugin EP read on its device are copied there at session
creation (Executor.upload_constants), then the EP is synchronised once: run 1 copies only the feeds and
the outputs (issue 29: an embedding table was 17-23 ms of BERT's and GPT-2's run 1 on an H200)."""

from __future__ import annotations

import gc

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import host
from tests.conftest import example_record
from tests.host.test_host_computed import _mock_device_env

COPY = "EpDataTransfer.CopyTensors"


def _model():
    w = numpy_helper.from_array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "w")
    b = numpy_helper.from_array(np.arange(4, dtype=np.float32), "b")
    nodes = [helper.make_node("Mul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["u"]),
             helper.make_node("Add", ["u", "w"], ["y"])]  # w read twice: copied once
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("null_sync", [False, True], ids=["sync", "no-sync"])
def test_run_1_copies_no_constant_when_the_ep_can_sync(example_plugin, null_sync):
    env = _mock_device_env(example_plugin(7))
    record = example_record(7)
    options = {"ops": "Mul,Add", "fuse": "0", **({"null_slots": "Sync"} if null_sync else {})}
    model = _model()
    record.slot_calls.clear()
    s = host.InferenceSession(model.SerializeToString(), providers=[("ExampleEP", options)], env=env)
    at_creation = record.slot_calls[COPY]
    syncs = record.slot_calls["Ep.Sync"]
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for run in range(2):
        before = record.slot_calls[COPY]
        np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-6)
        copies = record.slot_calls[COPY] - before
        if null_sync:  # no Sync slot: the constants are copied in run 1, as before
            assert (at_creation, copies) == (0, 2 + 2 if run == 0 else 2)
        else:  # the feed in, the output out; w and b were copied at creation, with one Sync
            assert (at_creation, syncs, copies) == (2, 1, 2)
    s.close()
    gc.collect()
    env.close()
