"""Helpers for the optimizer tests: model building, the two references, equivalence checks."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from host.optimizer import GraphOptimizationLevel, expand_unclaimed, optimize

FLOAT = TensorProto.FLOAT


def make_model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    """A checked model from onnx.helper pieces; inputs/outputs are (name, shape) pairs (float)."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()])
    ops = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=ops, ir_version=helper.find_min_ir_version_for(ops))
    onnx.checker.check_model(model)
    return model


def ops(model: onnx.ModelProto) -> Counter:
    """Op types of the model's nodes ("ai.ephost::X" for the ephost domain)."""
    return Counter(f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                   for n in model.graph.node)


def standard_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its ai.ephost nodes expanded, so onnxruntime and the reference evaluator run it."""
    names = [n.name for n in model.graph.node if n.domain == "ai.ephost"]
    return expand_unclaimed(model, names) if names else model


class References:
    """onnxruntime CPU and onnx's ReferenceEvaluator on one model (built once, run per example)."""

    def __init__(self, model: onnx.ModelProto):
        model = standard_only(model)
        self.ort = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.ref = ReferenceEvaluator(model)

    def run(self, feeds: dict) -> tuple[list, list]:
        return self.ort.run(None, feeds), [np.asarray(v) for v in self.ref.run(None, feeds)]


def assert_same(original: References, optimized: References, feeds: dict, rtol=1e-4, atol=1e-5) -> None:
    """Outputs of the optimized model match the original's under both references."""
    (o_ort, o_ref), (n_ort, n_ref) = original.run(feeds), optimized.run(feeds)
    for a, b in zip(o_ort, n_ort):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg="onnxruntime: optimized != original")
    for a, b in zip(o_ref, n_ref):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg="reference: optimized != original")


def float_arrays(shape, low: float = -4.0, high: float = 4.0):
    """A hypothesis strategy for float32 arrays of `shape` with values in [low, high]."""
    return arrays(np.float32, shape, elements=st.floats(low, high, width=32, allow_nan=False))


@functools.cache
def optimized_fixture(name: str):
    """A real-model fixture (tests/models), optimized at ORT_ENABLE_ALL, with onnxruntime's outputs on
    the original: (path, feeds, expected torch outputs, optimized model, onnxruntime outputs)."""
    from tests.models import available_models, load

    if name not in available_models():
        pytest.skip(f"fixture tests/models/{name}.onnx (with its .npz) is not present; tests/models/export.py "
                    "makes it where torch and transformers are installed")
    path, feeds, expected = load(name)
    model = onnx.load(str(path))
    optimized = optimize(model, GraphOptimizationLevel.ORT_ENABLE_ALL).model
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return path, feeds, expected, optimized, want
