"""`convert_precision` keeps finite float32 constants finite in both half types.

An exported attention mask is `(1 - mask) * finfo(float32).min`. float32's largest values round to
infinity in bfloat16 as in float16 (bfloat16 shares float32's exponent, not its largest mantissa), and
`0 * -inf` is NaN: every unmasked position of a bfloat16 BERT came out wrong (relative error 0.23
with the optimizer's fusions, NaN without them) until the converter clipped to bfloat16's largest
finite value as it does to float16's. Reference: onnxruntime CPU on the float32 model.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.precision import convert_precision
from host.runtime.session import InferenceSession

F32_MIN = float(np.finfo(np.float32).min)


def masked_add_model() -> onnx.ModelProto:
    """y = x + (1 - m) * finfo(float32).min, as exporters build an additive attention mask."""
    nodes = [helper.make_node("Sub", ["one", "m"], ["inv"]), helper.make_node("Mul", ["inv", "lowest"], ["bias"]),
             helper.make_node("Add", ["x", "bias"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(F32_MIN, np.float32), "lowest")]
    graph = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5]),
                                              helper.make_tensor_value_info("m", TensorProto.FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("precision,dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_float32_extremes_stay_finite(precision, dtype):
    model = masked_add_model()
    converted = convert_precision(model, precision)
    lowest = next(numpy_helper.to_array(t) for t in converted.graph.initializer if t.name == "lowest")
    assert lowest.dtype == np.dtype(dtype) and np.isfinite(lowest.astype(np.float32)).all()
    assert float(lowest) == -float(np.finfo(np.float16).max if precision == "fp16" else
                                   ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (2, 5)).astype(dtype)
    m = (rng.random((2, 5)) < 0.6).astype(dtype)
    (got,) = InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "m": m})
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime CPU is the float32 reference")
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.astype(np.float32), "m": m.astype(np.float32)})
    got = got.astype(np.float32)
    assert np.isfinite(got).all(), got
    kept = m.astype(np.float32) == 1
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-2)  # unmasked: x itself
    assert (got[~kept] < -6e4).all()  # masked: a huge negative number, not NaN or -inf
