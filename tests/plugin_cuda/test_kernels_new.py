"""The CUDA plugin's newer kernels (issue 10) against the ONNX reference evaluator or NumPy.

Same harness and tolerances as test_kernels.py (float32 1e-5 elementwise, float16 1e-2). Fused
kernels: float32 normalisations rtol 1e-4 (sums in another order); GEMM-based ones (FusedMatMul,
Attention) use the plain-FP32 cuBLAS handle and rtol/atol 1e-4, float16 rtol/atol 2e-2 (float16
products and an 11-bit mantissa on P before the second GEMM). Fused kernels are also captured in a
CUDA graph in thread-local capture mode (any cudaMalloc or synchronising call fails the capture),
then replayed on new input values written into the same buffers: the replay must compute the new
answer, not the captured one.

Tests without the gpu mark (registry, claiming, attribute and plan validation) run anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from plugin_cuda import kernels
from plugin_cuda.kernels import attention as attention_module
from tests.plugin_cuda.test_kernels import BOTH, F16, F32, FakeContext, check, rand, reference, run_kernel

gpu = pytest.mark.gpu
I64 = np.int64
FUSED_TOL = {np.dtype(F32): dict(rtol=1e-4, atol=1e-5), np.dtype(F16): dict(rtol=1e-2, atol=1e-2)}
GEMM_TOL = {np.dtype(F32): dict(rtol=1e-4, atol=1e-4), np.dtype(F16): dict(rtol=2e-2, atol=2e-2)}


def ints(*shape, seed=0, low=-5, high=6, dtype=I64):
    return np.random.default_rng(seed).integers(low, high, size=shape).astype(dtype)


def bools(*shape, seed=0, p=0.5):
    return np.random.default_rng(seed).random(shape) < p


def exact(cp, op_type, inputs, attrs, opset, num_outputs=1, host_inputs=None):
    """Run on the GPU and compare exactly (integer, bool, data movement) with the reference."""
    got = run_kernel(cp, op_type, inputs, attrs, opset, num_outputs=num_outputs)
    want = reference(op_type, inputs, attrs, opset, num_outputs)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.dtype == w.dtype, f"{op_type}: dtype {g.dtype} != reference {w.dtype}"
        np.testing.assert_array_equal(g, w, err_msg=op_type)
    return got


# ---------------------------------------------------------------------------------------------
# Elementwise


UNARY_NEW = [
    ("Cos", {}, 7, (-3, 3)),
    ("Sin", {}, 7, (-3, 3)),
    ("Floor", {}, 13, (-3, 3)),
    ("Ceil", {}, 13, (-3, 3)),
    ("Round", {}, 11, (-3, 3)),
    ("Softplus", {}, 1, (-30, 30)),
    ("Mish", {}, 18, (-30, 30)),
    ("HardSwish", {}, 14, (-5, 5)),
    ("HardSigmoid", {}, 6, (-5, 5)),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, 6, (-5, 5)),
    ("Sign", {}, 13, (-2, 2)),
]


@gpu
@BOTH
@pytest.mark.parametrize("op_type,attrs,opset,bounds", UNARY_NEW, ids=[f"{u[0]}-{u[1]}" for u in UNARY_NEW])
def test_unary_new(cp, op_type, attrs, opset, bounds, dtype):
    x = rand(3, 17, 5, low=bounds[0], high=bounds[1])
    x[0, 0, :3] = [0.5, -0.5, 0.0]  # Round's half-to-even and Sign's zero
    check(cp, op_type, [x], attrs, opset, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("attrs", [{}, {"detect_negative": 0}, {"detect_positive": 0}], ids=str)
def test_isnan_isinf(cp, attrs, dtype):
    x = rand(4, 6)
    x.reshape(-1)[[1, 5, 7, 11]] = [np.nan, np.inf, -np.inf, np.nan]
    exact(cp, "IsInf", [x.astype(dtype)], attrs, 10)
    exact(cp, "IsNaN", [x.astype(dtype)], {}, 13)


@gpu
@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32], ids=["i64", "i32"])
def test_integer_arithmetic(cp, op_type, dtype):
    a = ints(3, 4, seed=1, dtype=dtype)
    b = ints(4, seed=2, low=1, high=5, dtype=dtype) * np.array([1, -1, 1, -1], dtype)  # no zero: Div
    exact(cp, op_type, [a, b], {}, 14 if op_type in ("Add", "Sub", "Mul", "Div") else 13)


@gpu
def test_integer_unary_and_mod(cp):
    exact(cp, "Neg", [ints(5, 3)], {}, 13)
    exact(cp, "Abs", [ints(5, 3, dtype=np.int32)], {}, 13)
    exact(cp, "Relu", [ints(5, 3)], {}, 14)
    exact(cp, "Mod", [ints(4, 5, seed=1), ints(5, seed=2, low=1, high=4) * np.array([1, -1, 1, -1, 1])], {}, 13)
    check(cp, "Mod", [rand(4, 5, seed=1), rand(5, seed=2, low=0.5, high=2)], {"fmod": 1}, 13)


@gpu
@pytest.mark.parametrize("op_type", ["Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Equal"])
@pytest.mark.parametrize("dtype", [F32, F16, np.int64, np.int32], ids=["f32", "f16", "i64", "i32"])
def test_comparisons(cp, op_type, dtype):
    a = ints(3, 4, seed=4, low=-2, high=3).astype(dtype)
    b = ints(4, seed=5, low=-2, high=3).astype(dtype)
    exact(cp, op_type, [a, b], {}, 16)


@gpu
@pytest.mark.parametrize("op_type", ["And", "Or", "Xor", "Equal"])
def test_logic(cp, op_type):
    exact(cp, op_type, [bools(3, 4, seed=1), bools(4, seed=2)], {}, 13)
    exact(cp, "Not", [bools(2, 5, seed=3)], {}, 1)


@gpu
@pytest.mark.parametrize("dtype", [np.int64, np.bool_, F16], ids=["i64", "bool", "f16"])
def test_where_any_dtype(cp, dtype):
    a, b = ints(3, 4, seed=1).astype(dtype), ints(1, 4, seed=2).astype(dtype)
    exact(cp, "Where", [bools(3, 1, seed=3), a, b], {}, 16)


@gpu
@pytest.mark.parametrize("to,src", [
    (TensorProto.INT32, np.int64), (TensorProto.INT64, np.int32), (TensorProto.INT64, np.bool_),
    (TensorProto.BOOL, np.int64),
])
def test_integer_casts(cp, to, src):
    exact(cp, "Cast", [ints(4, 6, seed=8, low=-3, high=4).astype(src)], {"to": to}, 19)


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
@pytest.mark.parametrize("value", [None, np.array([3], I64), np.array([2.5], F16), np.array([True])],
                         ids=["default", "i64", "f16", "bool"])
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
@pytest.mark.parametrize("reduction", ["none", "add", "max", "min"])
def test_scatter_nd(cp, reduction):
    data = rand(4, 3, 2)
    indices = np.array([[1], [3], [0]], I64) if reduction == "none" else np.array([[1], [3], [1]], I64)
    updates = rand(3, 3, 2, seed=5)
    check(cp, "ScatterND", [data, indices, updates], {"reduction": reduction}, 18)
    check(cp, "ScatterND", [data, np.array([[0, 2], [-1, 1]], I64), rand(2, 2, seed=6)], {}, 13)


@gpu
@pytest.mark.parametrize("dtype", [F32, F16, np.int64], ids=["f32", "f16", "i64"])
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
@pytest.mark.parametrize("dtype", [F32, F16, np.int64], ids=["f32", "f16", "i64"])
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


# ---------------------------------------------------------------------------------------------
# Fused kernels


def layer_norm_ref(x, scale, bias, axis, eps, rms=False):
    axes = tuple(range(axis % x.ndim, x.ndim))
    x64 = x.astype(np.float64)
    mean = 0.0 if rms else x64.mean(axis=axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * scale
    return y + bias if bias is not None else y


@gpu
@BOTH
@pytest.mark.parametrize("shape,axis", [((2, 3, 64), -1), ((2, 5, 6), -2), ((4, 1000), 1), ((3, 7), 0)], ids=str)
def test_rms_normalization(cp, shape, axis, dtype):
    x = rand(*shape, low=-3, high=5)
    scale = rand(*shape[axis:], seed=1)
    check(cp, "RMSNormalization", [x, scale], {"axis": axis, "epsilon": 1e-3}, 23, dtype, tol=FUSED_TOL[np.dtype(dtype)])


@gpu
@BOTH
def test_layer_normalization_long_rows_and_broadcast_scale(cp, dtype):
    # 3000 elements a row: several elements per thread; Scale over the last axis only (broadcast).
    x = rand(3, 2, 1500, low=-3, high=5)
    scale, bias = rand(1500, seed=1), rand(1500, seed=2)
    got = run_kernel(cp, "LayerNormalization", [x.astype(dtype), scale.astype(dtype), bias.astype(dtype)],
                     {"axis": 1}, 17)[0]
    want = layer_norm_ref(x.astype(dtype).astype(F32), scale.astype(dtype), bias.astype(dtype), 1, 1e-5)
    np.testing.assert_allclose(got.astype(F32), want, **FUSED_TOL[np.dtype(dtype)])


def skip_ln_ref(x, skip, scale, bias, eps):
    total = x.astype(np.float64) + skip
    return layer_norm_ref(total, scale, bias, -1, eps), total


@gpu
@BOTH
@pytest.mark.parametrize("skip_shape", [(2, 5, 32), (5, 32)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("outputs", [1, 2])
def test_skip_layer_normalization(cp, skip_shape, with_bias, outputs, dtype):
    x, skip = rand(2, 5, 32, low=-3, high=3), rand(*skip_shape, seed=1)
    scale, bias = rand(32, seed=2), rand(32, seed=3)
    inputs = [x, skip, scale] + ([bias] if with_bias else [])
    inputs = [v.astype(dtype) for v in inputs]
    got = _run_domain(cp, "SkipLayerNormalization", inputs, {"epsilon": 1e-4}, outputs)
    want = skip_ln_ref(*(v.astype(F32) for v in inputs[:3]), inputs[3].astype(F32) if with_bias else None, 1e-4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(F32), w, **FUSED_TOL[np.dtype(dtype)])


def _run_domain(cp, op_type, inputs, attrs, num_outputs=1, handle=None, opset=1):
    """run_kernel for an ai.ephost op."""
    cls = kernels.lookup(op_type, opset, kernels.EPHOST_DOMAIN)
    kernel = cls(attrs, opset, f"test_{op_type}")
    ctx = FakeContext(cp, inputs, handle, num_outputs, cls.host_inputs)
    kernel.compute(ctx)
    cp.cuda.get_current_stream().synchronize()
    return [cp.asnumpy(ctx.outputs[i]) for i in range(num_outputs)]


def gelu_ref(x, approximate):
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


@gpu
@BOTH
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(cp, approximate, dtype):
    x, bias = rand(3, 4, 16, low=-4, high=4).astype(dtype), rand(16, seed=1).astype(dtype)
    got = _run_domain(cp, "BiasGelu", [x, bias], {"approximate": approximate})[0]
    want = gelu_ref(x.astype(F32) + bias.astype(F32), approximate)
    np.testing.assert_allclose(got.astype(F32), want, **FUSED_TOL[np.dtype(dtype)])


@gpu
@BOTH
@pytest.mark.parametrize("activation", ["", "Relu", "Gelu", "GeluTanh"])
@pytest.mark.parametrize("shapes", [((2, 3, 8), (8, 16), (16,)), ((5, 8), (8, 16), None),
                                    ((2, 3, 8), (2, 8, 16), (1, 16))], ids=str)
def test_fused_matmul(cp, cublas_handle_fp32, activation, shapes, dtype):
    a, b = rand(*shapes[0], seed=1).astype(dtype), rand(*shapes[1], seed=2).astype(dtype)
    inputs = [a, b] + ([rand(*shapes[2], seed=3).astype(dtype)] if shapes[2] is not None else [])
    got = _run_domain(cp, "FusedMatMul", inputs, {"activation": activation}, handle=cublas_handle_fp32)[0]
    y = np.matmul(a.astype(np.float64), b.astype(np.float64))
    if len(inputs) > 2:
        y = y + inputs[2].astype(np.float64)
    y = {"": y, "Relu": np.maximum(y, 0), "Gelu": gelu_ref(y, "none"), "GeluTanh": gelu_ref(y, "tanh")}[activation]
    np.testing.assert_allclose(got.astype(F32), y, **GEMM_TOL[np.dtype(dtype)])


ROTARY = [
    ("4d-pos", (2, 3, 5, 8), {}, True),
    ("4d-cache", (2, 3, 5, 8), {}, False),
    ("4d-interleaved", (1, 2, 6, 8), {"interleaved": 1}, True),
    ("4d-partial", (1, 2, 4, 12), {"rotary_embedding_dim": 8}, True),
    ("3d", (2, 5, 3 * 8), {"num_heads": 3}, True),
    ("3d-partial-interleaved", (1, 4, 2 * 12), {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}, False),
]


@gpu
@BOTH
@pytest.mark.parametrize("name,shape,attrs,with_pos", ROTARY, ids=[r[0] for r in ROTARY])
def test_rotary_embedding(cp, name, shape, attrs, with_pos, dtype):
    batch = shape[0]
    seq = shape[2] if len(shape) == 4 else shape[1]
    head = shape[3] if len(shape) == 4 else shape[2] // attrs["num_heads"]
    half = attrs.get("rotary_embedding_dim", head) // 2
    if with_pos:
        cos, sin = rand(20, half, seed=1), rand(20, half, seed=2)
        extra = [np.random.default_rng(3).integers(0, 20, size=(batch, seq)).astype(I64)]
    else:
        cos, sin = rand(batch, seq, half, seed=1), rand(batch, seq, half, seed=2)
        extra = []
    check(cp, "RotaryEmbedding", [rand(*shape), cos, sin] + extra, attrs, 23, dtype)


ATTENTION = [
    # name, q, k, v, mask (shape, dtype) or None, attrs
    ("4d", (2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6), None, {}),
    ("4d-causal-scale", (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8), None, {"is_causal": 1, "scale": 0.2}),
    ("4d-gqa-boolmask", (2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), ((2, 1, 5, 7), np.bool_), {}),
    ("4d-floatmask-padded", (1, 2, 3, 4), (1, 2, 6, 4), (1, 2, 6, 4), ((3, 4), F32), {}),
    ("4d-softcap-causal-mask", (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), ((1, 2, 4, 4), F32),
     {"softcap": 2.0, "is_causal": 1}),
    ("3d", (2, 5, 3 * 8), (2, 7, 3 * 8), (2, 7, 3 * 4), None, {"q_num_heads": 3, "kv_num_heads": 3}),
    ("3d-gqa-causal", (1, 6, 4 * 8), (1, 6, 2 * 8), (1, 6, 2 * 8), ((6, 6), np.bool_),
     {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1}),
]


def attention_inputs(q, k, v, mask, seed=0):
    inputs = [rand(*q, seed=seed), rand(*k, seed=seed + 1), rand(*v, seed=seed + 2)]
    if mask is not None:
        shape, dtype = mask
        if dtype == np.bool_:
            m = bools(*shape, seed=seed + 3, p=0.7)
            m.reshape(-1)[0] = False
        else:
            m = rand(*shape, seed=seed + 3, low=-2, high=1)
            m.reshape(-1)[0] = -np.inf
        inputs.append(m)
    return inputs


@gpu
@BOTH
@pytest.mark.parametrize("name,q,k,v,mask,attrs", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_attention(cp, cublas_handle_fp32, name, q, k, v, mask, attrs, dtype):
    inputs = attention_inputs(q, k, v, mask)
    check(cp, "Attention", inputs, attrs, 23, dtype, handle=cublas_handle_fp32, tol=GEMM_TOL[np.dtype(dtype)],
          num_outputs=3)


@gpu
def test_attention_fully_masked_row_is_zero(cp, cublas_handle_fp32):
    q, k, v = rand(1, 1, 2, 4), rand(1, 1, 3, 4, seed=1), rand(1, 1, 3, 4, seed=2)
    mask = np.array([[False, False, False], [True, False, True]])
    got = check(cp, "Attention", [q, k, v, mask], {}, 23, handle=cublas_handle_fp32, tol=GEMM_TOL[np.dtype(F32)])
    assert np.all(got[0][0, 0, 0] == 0)


# ---------------------------------------------------------------------------------------------
# Capture: the fused kernels record into a CUDA graph and replay on new inputs


class MemoContext(FakeContext):
    """Outputs allocated once, so that a warm-up run and the capture write the same buffers."""

    def output(self, index, shape, dtype):
        out = self.outputs.get(index)
        if out is None:
            out = super().output(index, shape, dtype)
        return out


CAPTURED = [
    ("LayerNormalization", "", 17, lambda: [rand(2, 3, 32), rand(32, seed=1), rand(32, seed=2)], {}, 3),
    ("RMSNormalization", "", 23, lambda: [rand(2, 3, 32), rand(32, seed=1)], {}, 1),
    ("SkipLayerNormalization", "ai.ephost", 1, lambda: [rand(2, 3, 32), rand(2, 3, 32, seed=1), rand(32, seed=2),
                                                        rand(32, seed=3)], {}, 2),
    ("BiasGelu", "ai.ephost", 1, lambda: [rand(2, 3, 32), rand(32, seed=1)], {"approximate": "tanh"}, 1),
    ("FusedMatMul", "ai.ephost", 1, lambda: [rand(2, 3, 8), rand(8, 16, seed=1), rand(16, seed=2)],
     {"activation": "Gelu"}, 1),
    ("RotaryEmbedding", "", 23, lambda: [rand(1, 2, 4, 8), rand(8, 4, seed=1), rand(8, 4, seed=2),
                                         np.array([[3, 1, 0, 7]], I64)], {}, 1),
    ("Attention", "", 23, lambda: attention_inputs((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), ((5, 7), np.bool_)),
     {"is_causal": 1}, 1),
    ("Attention", "", 23, lambda: attention_inputs((1, 5, 2 * 8), (1, 5, 2 * 8), (1, 5, 2 * 8), ((5, 5), F32)),
     {"q_num_heads": 2, "kv_num_heads": 2}, 1),
    ("Softmax", "", 13, lambda: [rand(3, 4, 50)], {}, 1),
    ("Einsum", "", 12, lambda: [rand(2, 3, 4, 5), rand(2, 3, 6, 5, seed=1)], {"equation": "bhqd,bhkd->bhqk"}, 1),
]


def reference_any(op_type, domain, inputs, attrs, opset, num_outputs):
    if domain == "ai.ephost":
        if op_type == "SkipLayerNormalization":
            return skip_ln_ref(inputs[0], inputs[1], inputs[2], inputs[3], 1e-5)
        if op_type == "BiasGelu":
            return [gelu_ref(inputs[0] + inputs[1], attrs["approximate"])]
        y = np.matmul(inputs[0].astype(np.float64), inputs[1]) + inputs[2]
        return [gelu_ref(y, "none")]
    return reference(op_type, inputs, attrs, opset, num_outputs)


@gpu
@pytest.mark.parametrize("op_type,domain,opset,make,attrs,count", CAPTURED, ids=[c[0] + str(i)
                                                                                for i, c in enumerate(CAPTURED)])
def test_fused_kernels_capture_and_replay(cp, op_type, domain, opset, make, attrs, count):
    from plugin_cuda.device.cublas import CublasHandle

    stream = cp.cuda.Stream(non_blocking=True)
    cls = kernels.lookup(op_type, opset, domain)
    kernel = cls(attrs, opset, f"captured_{op_type}")
    first = make()
    with stream:
        handle = CublasHandle(stream.ptr, use_tf32=False)
        try:
            ctx = MemoContext(cp, first, handle, count, cls.host_inputs)
            kernel.compute(ctx)  # warm-up: compiles, fills the pool, creates the outputs
            stream.synchronize()
            stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeThreadLocal)
            try:
                kernel.compute(ctx)
            finally:
                graph = stream.end_capture()
            # New values into the same device buffers, then replay.
            second = [x if not isinstance(x, np.ndarray) or x.dtype.kind != "f" else x * 0.5 - 0.25 for x in first]
            for dev, new in zip(ctx.inputs, second):
                if dev is not None and not isinstance(dev, np.ndarray):
                    dev.set(np.ascontiguousarray(new))
            for out in ctx.outputs.values():
                out.fill(np.nan if out.dtype.kind == "f" else 0)
            stream.synchronize()
            graph.launch(stream)
            stream.synchronize()
        finally:
            handle.close()
    want = reference_any(op_type, domain, second, attrs, opset, count)
    for i in range(count):
        np.testing.assert_allclose(cp.asnumpy(ctx.outputs[i]).astype(F32), np.asarray(want[i], F32),
                                   rtol=1e-4, atol=1e-4, err_msg=f"{op_type} output {i} after replay")


# ---------------------------------------------------------------------------------------------
# CPU-only: registry, claiming, validation


NEW_OPS = {
    "IsNaN", "IsInf", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Split", "Tile", "Pad", "Range",
    "ConstantOfShape", "Trilu", "GatherElements", "GatherND", "ScatterND", "CumSum", "ArgMax", "ArgMin", "Einsum",
    "Mish", "HardSwish", "HardSigmoid", "Softplus", "Sign", "Mod", "Sum", "Cos", "Sin", "Floor", "Ceil", "Round",
    "RMSNormalization", "RotaryEmbedding", "Attention",
    "ai.ephost.SkipLayerNormalization", "ai.ephost.BiasGelu", "ai.ephost.FusedMatMul",
}


def test_new_ops_are_registered():
    assert NEW_OPS <= set(kernels.supported_ops())


@pytest.mark.parametrize("op_type,attrs,dtypes,opset,domain,outputs,expected", [
    ("Attention", {}, ["float32"] * 3 + ["bool"], 23, "", 1, True),
    ("Attention", {}, ["float16"] * 3, 23, "", 3, True),
    ("Attention", {}, ["float32"] * 3, 23, "", 4, False),  # qk_matmul_output is not produced
    ("Attention", {}, ["float32"] * 3 + [None, "float32", "float32"], 23, "", 1, False),  # past_key/value
    ("Attention", {}, ["float32"] * 3 + [None, None, None], 23, "", 1, True),
    ("Attention", {}, ["float32"] * 3, 22, "", 1, False),
    ("Attention", {}, ["float32"] * 3, 24, "", 1, False),  # newer than the plugin knows
    ("SkipLayerNormalization", {}, ["float32"] * 4, 1, "ai.ephost", 2, True),
    ("SkipLayerNormalization", {}, ["float32"] * 4, 1, "", 1, False),  # not an ONNX op
    ("SkipLayerNormalization", {}, ["float32"] * 4, 1, "com.other", 1, False),
    ("FusedMatMul", {"activation": "Gelu"}, ["float16"] * 3, 1, "ai.ephost", 1, True),
    ("FusedMatMul", {"activation": "Swish"}, ["float32"] * 2, 1, "ai.ephost", 1, False),
    ("BiasGelu", {"approximate": "tanh"}, ["float32"] * 2, 1, "ai.ephost", 1, True),
    ("LayerNormalization", {}, ["float32"] * 3, 23, "", 3, True),
    ("RMSNormalization", {}, ["float16"] * 2, 23, "", 1, True),
    ("RotaryEmbedding", {}, ["float32"] * 3 + ["int64"], 23, "", 1, True),
    ("RotaryEmbedding", {}, ["float32"] * 3 + ["int32"], 23, "", 1, False),
    ("Cast", {"to": TensorProto.INT32}, [TensorProto.INT64], 19, "", 1, True),
    ("Add", {}, ["int64", "int64"], 14, "", 1, True),
    ("Add", {}, ["int64", "int32"], 14, "", 1, False),
    ("Where", {}, ["bool", "int64", "int64"], 16, "", 1, True),
    ("Mod", {"fmod": 0}, ["float32", "float32"], 13, "", 1, False),
    ("Mod", {"fmod": 1}, ["float32", "float32"], 13, "", 1, True),
    ("Mod", {}, ["int64", "int64"], 13, "", 1, True),
    ("Einsum", {"equation": "bij,bjk->bik"}, ["float32"] * 2, 12, "", 1, True),
    ("Einsum", {"equation": "bij,bjk->bik"}, ["float32"] * 3, 12, "", 1, False),
    ("Einsum", {"equation": "...ij,...jk"}, ["float32"] * 2, 12, "", 1, False),
    ("Einsum", {"equation": "ii->i"}, ["float32"], 12, "", 1, False),
    ("Einsum", {"equation": "ij,jk->k"}, ["float32"] * 2, 12, "", 1, False),  # i summed within one operand
    ("Split", {"axis": 1, "num_outputs": 3}, ["float16"], 18, "", 3, True),
    ("Pad", {"mode": "wrap"}, ["float32", "int64"], 18, "", 1, False),
    ("Pad", {"mode": "wrap"}, ["float32", "int64"], 19, "", 1, True),
    ("ScatterND", {"reduction": "mul"}, ["float32", "int64", "float32"], 18, "", 1, False),
    ("IsNaN", {}, ["int64"], 13, "", 1, False),
])
def test_claimable_new(op_type, attrs, dtypes, opset, domain, outputs, expected):
    assert kernels.claimable(op_type, attrs, dtypes, opset, domain=domain, num_outputs=outputs) is expected


@pytest.mark.parametrize("op_type,attrs,opset,message", [
    ("Pad", {"mode": "mirror"}, 18, r"^Pad node 'n': attribute 'mode' is 'mirror'; allowed: 'constant', "),
    ("Einsum", {"equation": "ab,bc,cd->ad"}, 12,
     r"^Einsum node 'n': attribute 'equation' is 'ab,bc,cd->ad'; allowed: one or two operands"),
    ("IsInf", {"detect_negative": 2}, 10, r"^IsInf node 'n': attribute 'detect_negative' is 2; allowed: 0 or 1$"),
    ("ConstantOfShape", {"value": np.array([1.0, 2.0], F32)}, 20,
     r"^ConstantOfShape node 'n': attribute 'value' is array\(\[1\., 2\.\]"),
    ("Attention", {"is_causal": 3}, 23, r"^Attention node 'n': attribute 'is_causal' is 3; allowed: 0 or 1$"),
])
def test_bad_attributes_new(op_type, attrs, opset, message):
    with pytest.raises(ValueError, match=message):
        kernels.lookup(op_type, opset)(attrs, opset, "n")


@pytest.mark.parametrize("shapes,message", [
    (((2, 4, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), r"^A: Q, K, V shapes \[2, 4, 5, 8\], \[2, 3, 7, 8\], .* do not fit"),
    (((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 6, 8)), r"^A: Q, K, V shapes .* do not fit"),
    (((2, 5, 8), (2, 5, 8, 1), (2, 5, 8)), r"^A: Q, K, V shapes .*; allowed: all 3-D or all 4-D$"),
])
def test_attention_plan_rejects_shapes(shapes, message):
    with pytest.raises(ValueError, match=message):
        attention_module.attention_plan(*shapes, None, None, None, None, False, None, 0.0, F32, "A")


def test_attention_plan_mask_validation():
    with pytest.raises(ValueError, match=r"^A: attn_mask has 9 keys; the keys number 7$"):
        attention_module.attention_plan((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), (5, 9), np.bool_, None, None,
                                        False, None, 0.0, F32, "A")
    with pytest.raises(ValueError, match=r"^A: attn_mask shape \[3, 5, 7\] does not broadcast to \[2, 4, 5, 7\]$"):
        attention_module.attention_plan((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), (3, 5, 7), np.bool_, None, None,
                                        False, None, 0.0, F32, "A")
    with pytest.raises(ValueError, match=r"^A: 3-D inputs need q_num_heads and kv_num_heads attributes$"):
        attention_module.attention_plan((2, 5, 8), (2, 5, 8), (2, 5, 8), None, None, None, None, False, None, 0.0,
                                        F32, "A")


def test_attention_plan_workspace():
    # float32 reuses the scores buffer for the probabilities; float16 adds a float16 copy after it.
    p32 = attention_module.attention_plan((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), None, None, None, None, False,
                                          None, 0.0, F32, "A")
    p16 = attention_module.attention_plan((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), None, None, None, None, False,
                                          None, 0.0, F16, "A")
    scores = 2 * 4 * 5 * 7
    assert p32.workspace_bytes == scores * 4 and p32.probs_offset == 0
    assert p16.probs_offset >= scores * 4 and p16.workspace_bytes == p16.probs_offset + scores * 2
    assert p32.scale == pytest.approx(1 / np.sqrt(8))
    assert p32.scores.batch == 2 * 2 and p32.scores.n == 2 * 5  # GQA: two q heads per kv-head GEMM


def test_cuda_sources_are_plain_text_for_each_dtype():
    from plugin_cuda.kernels import fused

    for dtype in (F32, F16):
        for body in (fused.SOURCE, attention_module.SOURCE):
            text = fused.source_for(body, dtype)
            assert ("typedef float T;" in text) == (dtype == F32)
    with pytest.raises(ValueError, match=r"^fused CUDA kernels got dtype float64; allowed: float32, float16$"):
        fused.source_for(fused.SOURCE, np.float64)


def test_docs_op_table_matches_the_registry():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cuda_ops.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and line.count("|") == 6
             and not line.startswith("| op |")]
    assert table == kernels.base.coverage_rows()


def test_claim_leaves_shape_arithmetic_on_the_host_and_takes_the_data_path():
    """CudaEp.claim on a small graph: shape arithmetic (from Shape, through int64 ops and constants)
    stays off the EP, integer data ops and ai.ephost ops are claimed, a Reshape whose shape is computed
    at run time and nodes of unknown domains or with unsupported outputs are not."""
    from abi.sdk import GraphSpec, NodeSpec, ValueSpec
    from plugin_cuda.plugin import CudaEp

    f32, i64, bool_ = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

    def value(name, elem, const=None):
        return ValueSpec(name, elem, None, 0, None if const is None else np.asarray(const))

    values = [value("x", f32), value("x_shape", i64), value("zero", i64, [0]), value("dim", i64),
              value("minus_one", i64, [-1]), value("new_shape", i64), value("x2", f32), value("ids", i64),
              value("one", i64, 1), value("ids1", i64), value("const_shape", i64, [2, -1]), value("x3", f32),
              value("skip", f32), value("gamma", f32), value("y", f32), value("total", f32), value("z", f32),
              value("q", f32), value("a0", f32), value("a1", f32), value("a2", f32), value("a3", f32),
              value("mask", bool_), value("mask_f", f32)]
    ix = {v.name: i for i, v in enumerate(values)}

    def node(i, op, ins, outs, domain="", opset=23, **attrs):
        return NodeSpec(i, f"n{i}", op, domain, opset, tuple(ix[n] for n in ins), tuple(ix[n] for n in outs), attrs)

    nodes = [
        node(0, "Shape", ["x"], ["x_shape"]),
        node(1, "Gather", ["x_shape", "zero"], ["dim"], axis=0),
        node(2, "Concat", ["dim", "minus_one"], ["new_shape"], axis=0),
        node(3, "Reshape", ["x", "new_shape"], ["x2"]),
        node(4, "Add", ["ids", "one"], ["ids1"]),
        node(5, "Reshape", ["x", "const_shape"], ["x3"]),
        node(6, "SkipLayerNormalization", ["x", "skip", "gamma"], ["y", "total"], domain="ai.ephost", opset=1),
        node(7, "Relu", ["x"], ["z"], domain="com.other", opset=1),
        node(8, "Attention", ["q", "q", "q"], ["a0", "a1", "a2", "a3"]),
        node(9, "Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT),
    ]
    assert CudaEp.claim(None, GraphSpec(nodes, values)) == [4, 5, 6, 9]
