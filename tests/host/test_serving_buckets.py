"""A serving replica that pads to buckets opens its ephost session with the same batch buckets (so each
bucket's graph is replayed where the EP captures), unless the session's check refuses the model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.serving.backend import ModelSpec, open_session


def _save(tmp_path, nodes, inits=()):
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])
    model = helper.make_model(helper.make_graph(nodes, "m", [x], [y], list(inits)),
                              opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return str(path)


def test_a_padding_replica_gets_a_bucketed_session(tmp_path):
    path = _save(tmp_path, [helper.make_node("Softmax", ["X"], ["Y"], axis=1)])
    session = open_session(ModelSpec(path), pad_batch=True)
    assert session.buckets is not None and set(session.buckets.rules) == {"batch"}
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    ref = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"X": x})[0], ref.run(None, {"X": x})[0], rtol=1e-6)
    assert open_session(ModelSpec(path)).buckets is None  # no padding asked: none


def test_a_model_the_check_refuses_opens_without_buckets(tmp_path):
    nodes = [helper.make_node("ReduceMean", ["X", "ax"], ["m"], name="mean"),
             helper.make_node("Sub", ["X", "m"], ["Y"], name="sub")]
    path = _save(tmp_path, nodes, [numpy_helper.from_array(np.array([0]), "ax")])
    with pytest.warns(RuntimeWarning, match=r"the session runs without batch buckets \(no graph per bucket\): "
                                            r"'session.ephost.shape_buckets' batch: padding the batch axis 'batch' "
                                            r"would change the results: node 'mean' \(ReduceMean\)"):
        session = open_session(ModelSpec(path), pad_batch=True)
    assert session.buckets is None
