"""The CUDA plugin's data-movement and indexing kernels of issue 10 (Split, Tile, Pad, Range,
ConstantOfShape, Trilu, GatherElements, GatherND, ScatterND, CumSum, ArgMax/ArgMin, Einsum) against the ONNX
reference evaluator: exact on integers and bools, test_kernels.py's tolerances on floats, Einsum through the
plain-FP32 cuBLAS handle (rtol/atol 1e-4, float16 2e-2)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.plugin_cuda.test_kernels import (
    BF16,
    BOTH,
    F16,
    F32,
    GEMM_TOL,
    I64,
    check,
    exact,
    ints,
    rand,
    reference,
    run_kernel,
)

gpu = pytest.mark.gpu

# ---------------------------------------------------------------------------------------------
# Data movement and indexing


@gpu
@pytest.mark.parametrize("dtype", [np.int64, np.bool_], ids=["i64", "bool"])
def test_data_movement_on_integers_and_bools(cp, dtype):
    x = ints(2, 3, 4, low=0, high=2).astype(dtype)
    exact(cp, "Reshape", [x, np.array([4, -1], I64)], {}, 14)
    exact(cp, "Expand", [x[:, :1], np.array([2, 3, 4], I64)], {}, 13)
    exact(cp, "Concat", [x, x[:, :2]], {"axis": 1}, 13)
    exact(cp, "Transpose", [x], {"perm": [2, 0, 1]}, 13)
    exact(cp, "Gather", [x, np.array([2, 0], I64)], {"axis": 2}, 13)
    exact(cp, "Slice", [x, np.array([1], I64), np.array([3], I64), np.array([2], I64)], {}, 13)
    exact(cp, "Unsqueeze", [x, np.array([0], I64)], {}, 13)


SPLITS = [
    (11, {"axis": 1, "split": [1, 3, 2]}, None, 3),
    (11, {"axis": -1}, None, 2),
    (13, {"axis": 1}, np.array([2, 0, 4], I64), 3),
    (13, {"axis": 0}, None, 2),
    (18, {"axis": 1, "num_outputs": 4}, None, 4),  # uneven: parts of ceil(6 / 4) = 2, the last one smaller
    (18, {"axis": 2, "num_outputs": 3}, None, 3),
]


@gpu
@BOTH
@pytest.mark.parametrize("opset,attrs,split,count", SPLITS, ids=[f"{s[0]}-{s[1]}" for s in SPLITS])
def test_split(cp, opset, attrs, split, count, dtype):
    inputs = [rand(2, 6, 4)] + ([split] if split is not None else [])
    check(cp, "Split", inputs, attrs, opset, dtype, num_outputs=count)


@gpu
@BOTH
@pytest.mark.parametrize("repeats", [(1, 1, 1), (2, 1, 3), (1, 0, 2)], ids=str)
def test_tile(cp, repeats, dtype):
    check(cp, "Tile", [rand(2, 3, 4), np.array(repeats, I64)], {}, 13, dtype)


PADS = [
    ("constant", [1, 0, 2, 0, 1, 1], 1.5, None),
    ("constant", [0, -1, 1, 2, 1, -2], 0.0, None),
    ("reflect", [1, 2, 0, 1, 1, 2], None, None),
    ("edge", [2, 0, 1, 0, 3, 2], None, None),
    ("constant", [1, 2], -1.0, [-1]),
]


@gpu
@BOTH
@pytest.mark.parametrize("mode,pads,value,axes", PADS, ids=[f"{p[0]}-{p[1]}" for p in PADS])
def test_pad(cp, mode, pads, value, axes, dtype):
    inputs = [rand(3, 4, 5), np.array(pads, I64)]
    if value is not None or axes is not None:
        inputs.append(np.array(value or 0.0, F32))
    if axes is not None:
        inputs.append(np.array(axes, I64))
    # The reference evaluator refuses negative pads (crops): NumPy crops, then pads, for those.
    ref = crop_then_pad if min(pads) < 0 else None
    check(cp, "Pad", inputs, {"mode": mode}, 18, dtype, ref=ref)


def crop_then_pad(x, pads, value):
    rank = x.ndim
    begin, end = pads[:rank], pads[rank:]
    crop = tuple(slice(max(-b, 0), d - max(-e, 0)) for d, b, e in zip(x.shape, begin, end))
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    return [np.pad(x[crop], widths, constant_values=float(value))]


@gpu
def test_pad_integers_and_old_opset(cp):
    exact(cp, "Pad", [ints(3, 4), np.array([1, 0, 0, 2], I64), np.array(7, I64)], {}, 13)
    check(cp, "Pad", [rand(3, 4)], {"pads": [0, 1, 2, 0], "value": 2.0}, 2)


@gpu
@pytest.mark.parametrize("start,limit,delta", [(0, 10, 3), (5, -3, -2), (2, 2, 1), (0.5, 3.0, 0.7)], ids=str)
def test_range(cp, start, limit, delta):
    dtype = F32 if isinstance(start, float) else I64
    got = run_kernel(cp, "Range", [np.array(v, dtype) for v in (start, limit, delta)], {}, 11)[0]
    want = reference("Range", [np.array(v, dtype) for v in (start, limit, delta)], {}, 11)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)


@gpu
@pytest.mark.parametrize("value", [None, np.array([3], I64), np.array([2.5], F16), np.array([2.5], BF16),
                                   np.array([True])], ids=["default", "i64", "f16", "bf16", "bool"])
def test_constant_of_shape(cp, value):
    from onnx import numpy_helper

    # The plugin gets a tensor attribute as a NumPy array (abi.sdk); the reference as a TensorProto.
    attrs = {} if value is None else {"value": value}
    ref_attrs = {} if value is None else {"value": numpy_helper.from_array(value)}
    for shape in ([2, 0, 3], [3, 2]):
        got = run_kernel(cp, "ConstantOfShape", [np.array(shape, I64)], attrs, 20)[0]
        want = reference("ConstantOfShape", [np.array(shape, I64)], ref_attrs, 20)[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@gpu
@BOTH
@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -2])
def test_trilu(cp, upper, k, dtype):
    inputs = [rand(2, 4, 5)] + ([] if k is None else [np.array(k, I64)])
    check(cp, "Trilu", inputs, {"upper": upper}, 14, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(cp, axis, dtype):
    data = rand(3, 4, 5)
    dim = data.shape[axis]
    shape = list(data.shape)
    shape[axis] = 2
    indices = ints(*shape, seed=3, low=-dim, high=dim)

    def ref(x, idx):  # NumPy: the reference evaluator mishandles axis=-1 with a smaller index dim
        return [np.take_along_axis(x, np.where(idx < 0, idx + dim, idx), axis)]

    check(cp, "GatherElements", [data, indices], {"axis": axis}, 13, dtype, ref=ref)


GATHER_ND = [
    ((3, 4, 5), np.array([[0, 1], [2, -1]], I64), 0),
    ((3, 4, 5), np.array([[[1]], [[2]]], I64), 0),
    ((3, 4, 5), np.array([[0, 1, 2], [2, 3, -5]], I64), 0),
    ((2, 4, 5), np.array([[1], [3]], I64), 1),
    ((2, 3, 4, 5), np.array([[[0, 1]], [[2, 3]]], I64), 1),
]


@gpu
@BOTH
@pytest.mark.parametrize("shape,indices,batch_dims", GATHER_ND, ids=[str(g[0]) + str(g[2]) + str(i)
                                                                    for i, g in enumerate(GATHER_ND)])
def test_gather_nd(cp, shape, indices, batch_dims, dtype):
    check(cp, "GatherND", [rand(*shape), indices], {"batch_dims": batch_dims}, 13, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("reduction", ["none", "add", "max", "min"])
def test_scatter_nd(cp, reduction, dtype):
    data = rand(4, 3, 2)
    indices = np.array([[1], [3], [0]], I64) if reduction == "none" else np.array([[1], [3], [1]], I64)
    updates = rand(3, 3, 2, seed=5)
    check(cp, "ScatterND", [data, indices, updates], {"reduction": reduction}, 18, dtype)
    check(cp, "ScatterND", [data, np.array([[0, 2], [-1, 1]], I64), rand(2, 2, seed=6)], {}, 13, dtype)


@gpu
@pytest.mark.parametrize("dtype", [F32, F16, BF16, np.int64], ids=["f32", "f16", "bf16", "i64"])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, -1])
def test_cumsum(cp, dtype, exclusive, reverse, axis):
    x = ints(3, 5, seed=2).astype(dtype) if dtype == np.int64 else rand(3, 5)
    attrs = {"exclusive": exclusive, "reverse": reverse}
    if dtype == np.int64:
        exact(cp, "CumSum", [x, np.array(axis, I64)], attrs, 14)
    else:
        check(cp, "CumSum", [x, np.array(axis, I64)], attrs, 14, dtype)


@gpu
@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims,last", [(0, 1, 0), (1, 0, 0), (-1, 1, 1), (1, 0, 1)], ids=str)
@pytest.mark.parametrize("dtype", [F32, F16, BF16, np.int64], ids=["f32", "f16", "bf16", "i64"])
def test_arg_reduce(cp, op_type, axis, keepdims, last, dtype):
    x = ints(3, 4, 5, seed=9, low=-2, high=3).astype(dtype)  # ties, so select_last_index matters
    exact(cp, op_type, [x], {"axis": axis, "keepdims": keepdims, "select_last_index": last}, 13)


EINSUMS = [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("i,j->ij", [(3,), (4,)]),
    ("bij,jk", [(2, 3, 4), (4, 5)]),
    ("ik,jk->ij", [(3, 4), (5, 4)]),
    ("abc,cd->dba", [(2, 3, 4), (4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ij->i", [(3, 4)]),
]


@gpu
@BOTH
@pytest.mark.parametrize("equation,shapes", EINSUMS, ids=[e[0] for e in EINSUMS])
def test_einsum(cp, cublas_handle_fp32, equation, shapes, dtype):
    inputs = [rand(*s, seed=i) for i, s in enumerate(shapes)]
    check(cp, "Einsum", inputs, {"equation": equation}, 12, dtype, handle=cublas_handle_fp32,
          tol=GEMM_TOL[np.dtype(dtype)])
