"""CPU EP indexing kernels (GatherElements, GatherND, ScatterND, ScatterElements, OneHot, NonZero, TopK,
CumSum) against onnx.reference.ReferenceEvaluator and onnxruntime: edge cases (negative indices, batch_dims,
duplicate indices under each reduction, ties), typed errors, and random shapes. The onnx backend node tests
(tests/host/test_backend.py) run these ops too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from host.errors import KernelError, ModelError
from tests.host.test_cpu_ops import (
    SUM_TOL,
    assert_same,
    case,
    check_onnxruntime,
    check_reference,
    f32,
    i64,
    idx,
    ours,
    reference,
    rng,
)


def _unique_rows(n, k, dims):
    """n distinct index tuples (k coordinates within dims): ScatterND with reduction 'none' needs them."""
    flat = rng.choice(math.prod(dims[:k]), size=n, replace=False)
    return np.stack(np.unravel_index(flat, dims[:k]), axis=-1).astype(np.int64)


INDEXING = [
    case("GatherElements", {"data": f32(3, 4), "indices": idx(3, 2, high=4)}, axis=1),
    case("GatherElements", {"data": f32(3, 4, 2), "indices": idx(2, 4, 2, high=3)}, axis=0, id="GatherElements-ax0"),
    case("GatherND", {"data": f32(3, 4, 5), "indices": idx(2, 2, high=3, low=0)}),
    case("GatherND", {"data": f32(3, 4, 5), "indices": np.array([[[1, -1]], [[0, 2]]], np.int64)}, id="GatherND-neg"),
    case("GatherND", {"data": f32(2, 4, 5), "indices": idx(2, 3, 1, high=4)}, batch_dims=1, id="GatherND-batch1"),
    case("GatherND", {"data": f32(2, 3, 4, 5), "indices": idx(2, 3, 2, high=4, low=0)}, batch_dims=2,
         id="GatherND-batch2"),
    case("ScatterND", {"data": f32(4, 5), "indices": _unique_rows(3, 2, (4, 5)), "updates": f32(3)}),
    case("ScatterND", {"data": f32(4, 5, 2), "indices": _unique_rows(2, 1, (4,)), "updates": f32(2, 5, 2)},
         id="ScatterND-slices"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[1], [1], [3]], np.int64), "updates": f32(3, 5)},
         reduction="add", id="ScatterND-add-dup"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[1], [1], [3]], np.int64), "updates": f32(3, 5)},
         reduction="mul", id="ScatterND-mul-dup"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[2], [2]], np.int64), "updates": f32(2, 5)},
         reduction="max", id="ScatterND-max"),
    case("ScatterND", {"data": f32(4, 5), "indices": np.array([[0], [0]], np.int64), "updates": f32(2, 5)},
         reduction="min", id="ScatterND-min"),
    case("ScatterElements", {"data": f32(3, 4), "indices": np.array([[1, 0, 3], [2, -1, 0]], np.int64),
                             "updates": f32(2, 3)}, axis=1),
    case("ScatterElements", {"data": f32(3, 4), "indices": np.array([[1, 1], [2, 1]], np.int64), "updates": f32(2, 2)},
         axis=0, reduction="add", id="ScatterElements-add"),
    case("ScatterElements", {"data": f32(3, 4), "indices": np.array([[1, 1], [2, 1]], np.int64), "updates": f32(2, 2)},
         axis=0, reduction="max", id="ScatterElements-max"),
    case("OneHot", {"indices": np.array([[0, 2], [-1, 5]], np.int64), "depth": np.array(4, np.int64),
                    "values": np.array([0.5, 2.0], np.float32)}),
    case("OneHot", {"indices": np.array([[1, 0, 3], [2, -4, 9]], np.int64), "depth": np.array(4, np.int64),
                    "values": np.array([-1, 7], np.float32)}, axis=0, id="OneHot-axis0"),
    case("NonZero", {"x": (f32(3, 4) > 0.5)}),
    case("NonZero", {"x": np.array([[0, 2, 0], [1, 0, 3]], np.int32)}, id="NonZero-int"),
    case("TopK", {"x": f32(3, 6), "k": i64(3)}, n_out=2),
    case("TopK", {"x": np.array([[3, 1, 3, 2, 1, 3]], np.float32), "k": i64(4)}, n_out=2, id="TopK-ties"),
    case("TopK", {"x": np.array([[3, 1, 3, 2, 1, 3]], np.int64), "k": i64(4)}, n_out=2, largest=0,
         id="TopK-smallest-ties"),
    case("TopK", {"x": f32(4, 3, 2), "k": i64(2)}, n_out=2, axis=0, id="TopK-axis0"),
    case("TopK", {"x": f32(3, 6)}, n_out=2, opset=9, k=2, id="TopK-opset9-attr"),
    case("CumSum", {"x": f32(3, 4), "axis": np.array(1, np.int64)}, tol=SUM_TOL),
    case("CumSum", {"x": f32(3, 4), "axis": np.array(0, np.int32)}, exclusive=1, tol=SUM_TOL, id="CumSum-excl"),
    case("CumSum", {"x": f32(3, 4), "axis": np.array(-1, np.int64)}, reverse=1, tol=SUM_TOL, id="CumSum-rev"),
    case("CumSum", {"x": np.arange(12, dtype=np.int64).reshape(3, 4), "axis": np.array(1, np.int64)}, exclusive=1,
         reverse=1, id="CumSum-excl-rev-int"),
]

CASES = INDEXING


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), CASES)
def test_matches_reference(node, feeds, opset, tol):
    check_reference(node, feeds, opset, tol)


# onnxruntime as a second reference (its NonZero is checked by the reference evaluator only).
ORT_CASES = [p for p in INDEXING if p.values[0].op_type != "NonZero"]


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), ORT_CASES)
def test_matches_onnxruntime(node, feeds, opset, tol):
    check_onnxruntime(node, feeds, opset, tol)


# -- errors: bad input names what was expected and what arrived ------------------------------------------------


def test_gather_elements_index_out_of_range():
    node = helper.make_node("GatherElements", ["d", "i"], ["y"], name="ge", axis=1)
    with pytest.raises(KernelError, match=r"^node 'ge' \(GatherElements\) on CPUExecutionProvider failed: index 4 at "
                                          r"position \(0, 1\) is out of range for a dimension of 4$"):
        ours(node, {"d": f32(2, 4), "i": np.array([[0, 4], [1, 1]], np.int64)}, 17)



def test_topk_k_too_large():
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk")
    with pytest.raises(KernelError, match=r"^node 'tk' \(TopK\) on CPUExecutionProvider failed: k = 7 is outside "
                                          r"\[0, 6\] \(the size of axis 1\)$"):
        ours(node, {"x": f32(2, 6), "k": i64(7)}, 17)


def test_scatternd_reduction_needs_opset_16():
    node = helper.make_node("ScatterND", ["d", "i", "u"], ["y"], name="sc", reduction="add")
    with pytest.raises(ModelError, match=r"^node 'sc' \(ScatterND\): attribute 'reduction' is 'add'; "
                                         r"allowed: one of 'none'$"):
        ours(node, {"d": f32(2), "i": np.array([[0]], np.int64), "u": f32(1)}, 13)



# -- random shapes against the reference ---------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_gather_scatter_nd_random(b, n, m, batch_dims, seed):
    r = np.random.default_rng(seed)
    data = r.standard_normal((b, n, m, 2)).astype(np.float32)
    k = int(r.integers(1, 4 - batch_dims))
    dims = data.shape[batch_dims:batch_dims + k]
    indices = np.stack([r.integers(-d, d, size=(*data.shape[:batch_dims], 3)) for d in dims], axis=-1)
    node = helper.make_node("GatherND", ["d", "i"], ["y"], name="g", batch_dims=batch_dims)
    feeds = {"d": data, "i": indices.astype(np.int64)}
    assert_same(ours(node, feeds, 13)[0], reference(node, feeds, 13)[0], {})
    upd_shape = (5, *data.shape[k:])
    idx = np.stack([r.integers(0, d, size=5) for d in data.shape[:k]], axis=-1).astype(np.int64)
    node = helper.make_node("ScatterND", ["d", "i", "u"], ["y"], name="s", reduction="add")
    feeds = {"d": data, "i": idx, "u": r.standard_normal(upd_shape).astype(np.float32)}
    assert_same(ours(node, feeds, 18)[0], reference(node, feeds, 18)[0], SUM_TOL)
