"""CPU EP loss operators (host/cpu_ep/ops_loss.py) where onnx's backend suite has no case: a target out of
range, every target ignored, float16 SoftmaxCrossEntropyLoss; tests/host/test_backend.py is their main coverage."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from host.errors import KernelError
from host.runtime.session import InferenceSession


def _model(node, inputs, outputs, opset):
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def test_loss_target_out_of_range_is_a_kernel_error():
    node = helper.make_node("NegativeLogLikelihoodLoss", ["x", "t"], ["loss"], name="nll", ignore_index=-1)
    model = _model(node, [_vi("x", TensorProto.FLOAT, [2, 3]), _vi("t", TensorProto.INT64, [2])],
                   [_vi("loss", TensorProto.FLOAT, [])], 22)
    sess = InferenceSession(model.SerializeToString())
    x = np.log(np.full((2, 3), 1 / 3, np.float32))
    with pytest.raises(KernelError, match=r"^node 'nll' \(NegativeLogLikelihoodLoss\) on CPUExecutionProvider "
                                          r"failed: target value 3 is out of range: classes are 0\.\.2 "
                                          r"\(ignore_index -1\)$"):
        sess.run(None, {"x": x, "t": np.array([0, 3], np.int64)})
    # Every target ignored: the mean divides 0 by a weight sum of 0, NaN as onnxruntime gives (onnx's
    # reference special-cases ignore_index -1 and gives 0).
    feeds = {"x": x, "t": np.array([-1, -1], np.int64)}
    (loss,) = sess.run(None, feeds)
    ort = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = ort.run(None, feeds)
    assert np.isnan(loss) and np.isnan(want)


def test_sce_float16_matches_the_reference():
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["s", "t", "w"], ["loss", "logp"], reduction="mean")
    model = _model(node, [_vi("s", TensorProto.FLOAT16, [4, 5, 2]), _vi("t", TensorProto.INT64, [4, 2]),
                          _vi("w", TensorProto.FLOAT16, [5])],
                   [_vi("loss", TensorProto.FLOAT16, []), _vi("logp", TensorProto.FLOAT16, [4, 5, 2])], 22)
    rng = np.random.default_rng(3)
    feeds = {"s": rng.standard_normal((4, 5, 2)).astype(np.float16), "t": rng.integers(0, 5, (4, 2)),
             "w": rng.random(5).astype(np.float16)}
    got = InferenceSession(model.SerializeToString()).run(None, feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=2e-3, atol=2e-3)
