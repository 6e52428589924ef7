"""CUDA plugin kernels against the ONNX reference evaluator (NumPy) on seeded random inputs.

Tolerances: float32 elementwise/reductions rtol 1e-5 (CUDA's expf/erff/tanhf are within a few ulp);
float32 GEMM-based ops (MatMul, Gemm, Conv) rtol 1e-2 / atol 2e-2 because cuBLAS runs them in TF32
(inputs rounded to a 10-bit mantissa, FP32 accumulate: ~5e-4 relative error per product, growing like
sqrt(K); K <= 24 here), except where a test uses the plain-FP32 handle (1e-4); float16 outputs rtol/atol
1e-2 (float16 has an 11-bit mantissa, and the reference sees the same float16-rounded inputs computed
in float32); bfloat16 outputs 2e-2 (an 8-bit mantissa: one rounding of the output is 2^-8 relative,
and the reference's float32 result rounded to bfloat16 may land one unit away); LayerNormalization
in float32 1e-4 (mean and variance are summed in another order).

Tests without the gpu mark (claimable, attribute validation, registry) run on any machine.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from plugin_cuda import kernels
from plugin_cuda.kernels import base

gpu = pytest.mark.gpu
F32 = np.float32
F16 = np.float16
BF16 = ml_dtypes.bfloat16
HALF = (np.dtype(F16), np.dtype(BF16))
TOL = {np.dtype(F32): dict(rtol=1e-5, atol=1e-6), np.dtype(F16): dict(rtol=1e-2, atol=1e-2),
       np.dtype(BF16): dict(rtol=2e-2, atol=2e-2)}
TF32_TOL = dict(rtol=1e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# Harness: a fake kernel context (the plugin runtime provides the real one) and the reference.


class FakeContext:
    """What the plugin runtime hands compute(): inputs, preallocated outputs, cuBLAS, scratch."""

    def __init__(self, cp, inputs, cublas=None, num_outputs=1, host_inputs=()):
        self._cp = cp
        # Host inputs (shapes, axes) arrive as NumPy arrays, as the runtime is asked to pass them.
        self.inputs = [
            None if x is None else (np.asarray(x) if i in host_inputs else cp.asarray(x))
            for i, x in enumerate(inputs)
        ]
        self.cublas = cublas
        self.num_outputs = num_outputs
        self.outputs = {}

    def output(self, index, shape, dtype):
        out = self._cp.empty(tuple(shape), dtype=dtype)
        dtype = np.dtype(dtype)
        # Poison: an element the kernel forgets to write shows up in the comparison.
        out.fill(np.nan if is_float(dtype) else (False if dtype.kind == "b" else 77))
        self.outputs[index] = out
        return out

    def scratch(self, nbytes):
        return self._cp.cuda.alloc(nbytes)


def run_kernel(cp, op_type, inputs, attrs, opset, handle=None, num_outputs=1):
    cls = kernels.lookup(op_type, opset)
    kernel = cls(attrs, opset, f"test_{op_type}")
    ctx = FakeContext(cp, inputs, handle, num_outputs, cls.host_inputs)
    kernel.compute(ctx)
    cp.cuda.get_current_stream().synchronize()
    return [cp.asnumpy(ctx.outputs[i]) for i in range(num_outputs)]


def reference(op_type, inputs, attrs, opset, num_outputs=1):
    names = ["" if x is None else f"x{i}" for i, x in enumerate(inputs)]
    outputs = [f"y{i}" for i in range(num_outputs)]
    node = helper.make_node(op_type, names, outputs, **attrs)
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
         for n, x in zip(names, inputs) if n],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs) if n}
    return ReferenceEvaluator(model).run(None, feeds)


def check(cp, op_type, inputs, attrs=None, opset=17, dtype=F32, num_outputs=1, handle=None, tol=None, ref=None):
    """Run op_type on the GPU with float inputs cast to `dtype`; compare with the reference computed
    in float32 on the same (rounded) values (by the ONNX reference evaluator unless `ref` is given)."""
    attrs = attrs or {}
    dtype = np.dtype(dtype)
    device_inputs = [
        x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype == F32 else x for x in inputs
    ]
    ref_inputs = [
        x.astype(F32) if isinstance(x, np.ndarray) and x.dtype == dtype and dtype in HALF else x
        for x in device_inputs
    ]
    got = run_kernel(cp, op_type, device_inputs, attrs, opset, handle, num_outputs)
    want = ref(*ref_inputs) if ref else reference(op_type, ref_inputs, attrs, opset, num_outputs)
    for i, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert g.shape == w.shape, f"{op_type} output {i}: shape {g.shape} != reference {w.shape}"
        if w.dtype.kind == "f" and dtype in HALF and g.dtype == dtype:
            w = w.astype(dtype)  # the reference's float32 result rounded as the kernel's output is
        if is_float(g.dtype):
            np.testing.assert_allclose(g.astype(F32), w.astype(F32), **(tol or TOL[dtype]),
                                       err_msg=f"{op_type} output {i}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{op_type} output {i}")
    return got


def rand(*shape, seed=0, low=-2.0, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(F32)


def is_float(dtype) -> bool:
    """float32/float16 (NumPy kind 'f') or ml_dtypes' bfloat16 (kind 'V')."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == np.dtype(BF16)


# float32 and both half types (the name predates bfloat16).
BOTH = pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])


I64 = np.int64
# GEMM-based kernels on the plain-FP32 cuBLAS handle; float16 products carry an 11-bit mantissa.
GEMM_TOL = {np.dtype(F32): dict(rtol=1e-4, atol=1e-4), np.dtype(F16): dict(rtol=2e-2, atol=2e-2),
            np.dtype(BF16): dict(rtol=4e-2, atol=4e-2)}


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


UNARY = [
    ("Neg", {}, 13, (-2, 2)),
    ("Abs", {}, 13, (-2, 2)),
    ("Sqrt", {}, 13, (0.1, 4)),
    ("Exp", {}, 13, (-3, 3)),
    ("Log", {}, 13, (0.1, 4)),
    ("Reciprocal", {}, 13, (0.5, 3)),
    ("Tanh", {}, 13, (-3, 3)),
    ("Sigmoid", {}, 13, (-6, 6)),
    ("Relu", {}, 14, (-2, 2)),
    ("LeakyRelu", {"alpha": 0.1}, 16, (-2, 2)),
    ("Erf", {}, 13, (-2, 2)),
    ("Gelu", {}, 20, (-3, 3)),
    ("Gelu", {"approximate": "tanh"}, 20, (-3, 3)),
    ("Gelu", {"approximate": "none"}, 20, (-3, 3)),
]


@gpu
@BOTH
@pytest.mark.parametrize("op_type,attrs,opset,bounds", UNARY, ids=[f"{u[0]}-{u[1]}" for u in UNARY])
def test_unary(cp, op_type, attrs, opset, bounds, dtype):
    check(cp, op_type, [rand(3, 17, 5, low=bounds[0], high=bounds[1])], attrs, opset, dtype)


BINARY_SHAPES = [((4, 5), (4, 5)), ((2, 3, 4), (4,)), ((3, 1), (1, 5)), ((), (2, 3)), ((2, 1, 4), (3, 1))]


@gpu
@BOTH
@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
def test_binary_broadcast(cp, op_type, shapes, dtype):
    a = rand(*shapes[0], seed=1)
    b = rand(*shapes[1], seed=2, low=0.5, high=2.0)  # away from zero for Div
    check(cp, op_type, [a, b], {}, 14, dtype)


@gpu
@BOTH
def test_pow(cp, dtype):
    check(cp, "Pow", [rand(3, 4, low=0.5, high=2.0), rand(4, seed=3, low=-2, high=2)], {}, 15, dtype)


@gpu
def test_pow_integer_exponent(cp):
    check(cp, "Pow", [rand(3, 4, low=0.5, high=2.0), np.array([2, 3, 0, 1], np.int64)], {}, 15)


@gpu
@BOTH
@pytest.mark.parametrize("op_type", ["Equal", "Less", "Greater"])
def test_compare(cp, op_type, dtype):
    # Small integers as floats, so that equal values actually occur.
    a = np.random.default_rng(4).integers(-2, 3, size=(3, 4)).astype(F32)
    b = np.random.default_rng(5).integers(-2, 3, size=(4,)).astype(F32)
    check(cp, op_type, [a, b], {}, 13, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("op_type", ["Max", "Min"])
def test_variadic_max_min(cp, op_type, dtype):
    check(cp, op_type, [rand(3, 1, seed=1), rand(4, seed=2), rand(2, 3, 4, seed=3)], {}, 13, dtype)
    check(cp, op_type, [rand(3, 4, seed=1)], {}, 13, dtype)


@gpu
@BOTH
def test_where(cp, dtype):
    cond = np.random.default_rng(6).random((3, 4)) > 0.5
    check(cp, "Where", [cond, rand(3, 4, seed=1), rand(4, seed=2)], {}, 16, dtype)


@gpu
def test_not(cp):
    check(cp, "Not", [np.random.default_rng(7).random((5, 6)) > 0.5], {}, 1)


@gpu
@pytest.mark.parametrize("to,src", [
    (TensorProto.FLOAT16, np.float32), (TensorProto.FLOAT, np.float16), (TensorProto.INT64, np.float32),
    (TensorProto.FLOAT, np.int64), (TensorProto.BOOL, np.float32), (TensorProto.FLOAT, np.bool_),
    (TensorProto.INT32, np.float16),
])
def test_cast(cp, to, src):
    x = (np.random.default_rng(8).uniform(-5, 5, size=(4, 6)) * (np.arange(6) % 3 != 0)).astype(src)
    got = run_kernel(cp, "Cast", [x], {"to": to}, 19)[0]
    want = reference("Cast", [x], {"to": to}, 19)[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@gpu
@BOTH
def test_clip_attributes_before_opset_11(cp, dtype):
    check(cp, "Clip", [rand(4, 5)], {"min": -0.5, "max": 1.0}, 6, dtype)
    check(cp, "Clip", [rand(4, 5)], {"min": -0.5}, 6, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("bounds", [(-0.5, 1.0), (-0.5, None), (None, 1.0), (None, None)], ids=str)
def test_clip_inputs(cp, bounds, dtype):
    lo, hi = (None if v is None else np.array(v, F32) for v in bounds)
    inputs = [rand(4, 5), lo, hi]
    while inputs[-1] is None:
        inputs.pop()
    check(cp, "Clip", inputs, {}, 13, dtype)


# ---------------------------------------------------------------------------------------------
# Normalisation


def softmax_2d_reference(op_type, axis):
    """Softmax before opset 13: over the input coerced to 2-D at `axis`. (The ONNX reference
    evaluator applies the opset-13 per-axis rule to old opsets too, unlike ONNX Runtime.)"""

    def ref(x):
        x2 = x.reshape(int(np.prod(x.shape[:axis])), -1).astype(np.float64)
        shifted = x2 - x2.max(axis=1, keepdims=True)
        log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        y = shifted - log_sum if op_type == "LogSoftmax" else np.exp(shifted - log_sum)
        return [y.reshape(x.shape).astype(F32)]

    return ref


@gpu
@BOTH
@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset,axis", [(13, -1), (13, 1), (13, 0), (11, 1), (11, 2), (11, 0)])
def test_softmax(cp, op_type, opset, axis, dtype):
    ref = softmax_2d_reference(op_type, axis) if opset < 13 else None
    check(cp, op_type, [rand(3, 4, 5, low=-4, high=4)], {"axis": axis}, opset, dtype, ref=ref)


@gpu
@BOTH
@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization(cp, axis, with_bias, dtype):
    x = rand(2, 3, 8, low=-3, high=5)
    shape = x.shape[axis:]
    inputs = [x, rand(*shape, seed=1), rand(*shape, seed=2) if with_bias else None]
    if not with_bias:
        inputs.pop()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == F32 else None
    got = check(cp, "LayerNormalization", inputs, {"axis": axis, "epsilon": 1e-3}, 17, dtype, num_outputs=3,
                tol=tol)
    assert got[1].dtype == F32 and got[2].dtype == F32  # Mean / InvStdDev follow stash_type (float)


@gpu
@BOTH
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 3), (2, 3, 7)])
def test_batch_normalization(cp, shape, dtype):
    c = shape[1]
    inputs = [rand(*shape), rand(c, seed=1), rand(c, seed=2), rand(c, seed=3), rand(c, seed=4, low=0.5, high=2)]
    check(cp, "BatchNormalization", inputs, {"epsilon": 1e-3}, 15, dtype)


# ---------------------------------------------------------------------------------------------
# Reductions


REDUCE_CASES = [
    ({"keepdims": 1}, (1,)),
    ({"keepdims": 0}, (0, 2)),
    ({"keepdims": 1}, (-1,)),
    ({"keepdims": 0}, None),
    ({"keepdims": 1, "noop_with_empty_axes": 1}, None),
]


@gpu
@BOTH
@pytest.mark.parametrize("op_type,input_since", [("ReduceSum", 13), ("ReduceMean", 18), ("ReduceMax", 18)])
@pytest.mark.parametrize("attrs,axes", REDUCE_CASES, ids=str)
@pytest.mark.parametrize("as_input", [True, False], ids=["axes-input", "axes-attr"])
def test_reduce(cp, op_type, input_since, attrs, axes, as_input, dtype):
    x = rand(3, 4, 5)
    if as_input:
        opset = input_since
        inputs = [x] if axes is None else [x, np.array(axes, np.int64)]
        attrs = dict(attrs)
    else:
        opset = input_since - 1
        if attrs.get("noop_with_empty_axes"):
            pytest.skip("noop_with_empty_axes exists only with axes as an input")
        inputs = [x]
        attrs = dict(attrs, **({} if axes is None else {"axes": list(axes)}))
    check(cp, op_type, inputs, attrs, opset, dtype, tol=dict(rtol=1e-5, atol=1e-5) if dtype == F32 else None)


# ---------------------------------------------------------------------------------------------
# Data movement


@gpu
@BOTH
@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1]], ids=str)
def test_transpose(cp, perm, dtype):
    check(cp, "Transpose", [rand(2, 3, 4)], {} if perm is None else {"perm": perm}, 13, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(cp, axis, dtype):
    shapes = {0: [(1, 3, 2), (2, 3, 2), (0, 3, 2)], 1: [(2, 1, 2), (2, 4, 2)], -1: [(2, 3, 1), (2, 3, 3), (2, 3, 2)]}
    inputs = [rand(*s, seed=i) for i, s in enumerate(shapes[axis])]
    check(cp, "Concat", inputs, {"axis": axis}, 13, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("axis,indices", [
    (0, np.array([0, 2, -1], np.int64)),
    (1, np.array([[1, 0], [3, -4]], np.int64)),
    (-1, np.array(2, np.int64)),
    (1, np.array([3, 1], np.int32)),
], ids=["axis0", "axis1-2d", "scalar", "int32"])
def test_gather(cp, axis, indices, dtype):
    check(cp, "Gather", [rand(3, 4, 5), indices], {"axis": axis}, 13, dtype)


SLICES = [
    ([1], [3], [0], None),
    ([0, 1], [2, -1], [0, 2], None),
    ([-1], [-1000], [1], [-1]),
    ([3, 0], [0, 100], [0, 1], [-2, 2]),
    ([10], [20], [2], None),
    ([0], [2**63 - 1], [-1], [3]),
    ([-100], [0], [1], [-1]),
]


@gpu
@BOTH
@pytest.mark.parametrize("starts,ends,axes,steps", SLICES, ids=str)
def test_slice(cp, starts, ends, axes, steps, dtype):
    inputs = [rand(4, 5, 6), np.array(starts, np.int64), np.array(ends, np.int64), np.array(axes, np.int64)]
    if steps is not None:
        inputs.append(np.array(steps, np.int64))
    check(cp, "Slice", inputs, {}, 13, dtype)


@gpu
def test_slice_attributes_opset_9(cp):
    check(cp, "Slice", [rand(4, 5, 6)], {"starts": [1, -3], "ends": [3, 100], "axes": [0, 2]}, 9)


@gpu
@BOTH
@pytest.mark.parametrize("shape,allowzero", [([0, -1], 0), ([6, 4], 0), ([-1], 0), ([2, 0, 4], 0), ([3, 8], 1)],
                         ids=str)
def test_reshape(cp, shape, allowzero, dtype):
    check(cp, "Reshape", [rand(2, 3, 4), np.array(shape, np.int64)], {"allowzero": allowzero}, 14, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axes", [None, [1], [-1, 1]], ids=str)
def test_squeeze(cp, opset, axes, dtype):
    x = rand(2, 1, 3, 1)
    if opset >= 13:
        inputs = [x] if axes is None else [x, np.array(axes, np.int64)]
        check(cp, "Squeeze", inputs, {}, opset, dtype)
    else:
        check(cp, "Squeeze", [x], {} if axes is None else {"axes": axes}, opset, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axes", [[0], [1, -1], [0, 3]], ids=str)
def test_unsqueeze(cp, opset, axes, dtype):
    x = rand(2, 3)
    if opset >= 13:
        check(cp, "Unsqueeze", [x, np.array(axes, np.int64)], {}, opset, dtype)
    else:
        check(cp, "Unsqueeze", [x], {"axes": axes}, opset, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("axis", [0, 1, 2, -1, 3])
def test_flatten(cp, axis, dtype):
    check(cp, "Flatten", [rand(2, 3, 4)], {"axis": axis}, 13, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("x_shape,shape", [((3, 1), (2, 3, 4)), ((1, 4), (3, 1)), ((2, 3), (2, 3))], ids=str)
def test_expand(cp, x_shape, shape, dtype):
    check(cp, "Expand", [rand(*x_shape), np.array(shape, np.int64)], {}, 13, dtype)


@gpu
@BOTH
def test_identity_and_dropout(cp, dtype):
    check(cp, "Identity", [rand(3, 4)], {}, 16, dtype)
    got = run_kernel(cp, "Dropout", [rand(3, 4).astype(dtype)], {}, 13, num_outputs=2)
    np.testing.assert_array_equal(got[0], rand(3, 4).astype(dtype))
    assert got[1].dtype == np.bool_ and got[1].all()


# ---------------------------------------------------------------------------------------------
# MatMul / Gemm (cuBLAS)


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),          # folded into one GEMM
    ((3, 4), (2, 4, 5)),          # A broadcast as stride 0
    ((2, 3, 4), (2, 4, 5)),       # equal batches
    ((1, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (1, 5, 4, 6)),  # both broadcast: a loop over the outer dim
    ((5, 1, 3, 4), (2, 4, 6)),
    ((2, 3, 4), (4,)),
    ((4,), (2, 4, 5)),
    ((3, 0), (0, 5)),             # K = 0: zeros
    ((0, 4), (4, 5)),
]


@gpu
@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES, ids=str)
def test_matmul_tf32(cp, cublas_handle, a_shape, b_shape):
    a, b = rand(*a_shape, seed=1), rand(*b_shape, seed=2)
    got = run_kernel(cp, "MatMul", [a, b], {}, 13, cublas_handle)[0]
    np.testing.assert_allclose(got, np.matmul(a, b), **TF32_TOL)


@gpu
@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES[:10], ids=str)
def test_matmul_fp32_exact_mode(cp, cublas_handle_fp32, a_shape, b_shape):
    a, b = rand(*a_shape, seed=1), rand(*b_shape, seed=2)
    got = run_kernel(cp, "MatMul", [a, b], {}, 13, cublas_handle_fp32)[0]
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES, ids=str)
def test_matmul_fp16(cp, cublas_handle, a_shape, b_shape):
    a, b = rand(*a_shape, seed=1).astype(F16), rand(*b_shape, seed=2).astype(F16)
    got = run_kernel(cp, "MatMul", [a, b], {}, 13, cublas_handle)[0]
    assert got.dtype == F16
    want = np.matmul(a.astype(F32), b.astype(F32))
    np.testing.assert_allclose(got.astype(F32), want, rtol=1e-2, atol=2e-2)


@gpu
def test_matmul_non_contiguous_input(cp, cublas_handle):
    a, b = rand(4, 3, seed=1), rand(4, 5, seed=2)
    from plugin_cuda.device import cublas

    out = cp.empty((3, 5), F32)
    cublas.matmul(cublas_handle, cp.asarray(a).T, cp.asarray(b), out)
    np.testing.assert_allclose(cp.asnumpy(out), a.T @ b, **TF32_TOL)


GEMM_C_SHAPES = [None, (), (5,), (1, 5), (3, 1), (3, 5)]


@gpu
@BOTH
@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", GEMM_C_SHAPES, ids=str)
def test_gemm(cp, cublas_handle, trans_a, trans_b, c_shape, dtype):
    a = rand(*((4, 3) if trans_a else (3, 4)), seed=1)
    b = rand(*((5, 4) if trans_b else (4, 5)), seed=2)
    inputs = [a, b] if c_shape is None else [a, b, rand(*c_shape, seed=3)]
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": 0.5, "beta": 2.0}
    check(cp, "Gemm", inputs, attrs, 13, dtype, handle=cublas_handle,
          tol=TF32_TOL if dtype == F32 else GEMM_TOL[np.dtype(dtype)])


@gpu
def test_gemm_defaults(cp, cublas_handle_fp32):
    check(cp, "Gemm", [rand(3, 4), rand(4, 5, seed=1), rand(5, seed=2)], {}, 13, handle=cublas_handle_fp32,
          tol=dict(rtol=1e-4, atol=1e-4))


# ---------------------------------------------------------------------------------------------
# Conv and pooling


CONVS = [
    ("plain", (2, 3, 7, 6), (4, 3, 3, 3), {}),
    ("pads-strides", (1, 4, 9, 8), (6, 4, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ("dilations", (1, 2, 9, 9), (3, 2, 3, 3), {"dilations": [2, 1], "pads": [1, 1, 1, 1]}),
    ("groups", (2, 4, 6, 6), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ("depthwise", (1, 5, 6, 7), (5, 1, 3, 3), {"group": 5, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("pointwise", (2, 6, 5, 4), (3, 6, 1, 1), {}),
    ("same-upper", (1, 3, 7, 7), (2, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ("same-lower", (1, 3, 6, 6), (2, 3, 2, 2), {"auto_pad": "SAME_LOWER"}),
    ("valid", (1, 3, 7, 6), (2, 3, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
    ("1d", (2, 3, 10), (4, 3, 3), {"pads": [2, 1], "strides": [2]}),
    ("1d-groups", (1, 4, 9), (4, 2, 3), {"group": 2, "dilations": [2]}),
]


@gpu
@BOTH
@pytest.mark.parametrize("name,x_shape,w_shape,attrs", CONVS, ids=[c[0] for c in CONVS])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv(cp, cublas_handle, name, x_shape, w_shape, attrs, with_bias, dtype):
    inputs = [rand(*x_shape, seed=1), rand(*w_shape, seed=2, low=-1, high=1)]
    if with_bias:
        inputs.append(rand(w_shape[0], seed=3))
    check(cp, "Conv", inputs, attrs, 11, dtype, handle=cublas_handle,
          tol=TF32_TOL if dtype == F32 else dict(rtol=2e-2, atol=5e-2))


POOLS = [
    ("k3s2p1", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (2, 3, 9, 8)),
    ("k2", {"kernel_shape": [2, 2]}, (1, 2, 6, 6)),
    ("asym-pads", {"kernel_shape": [3, 2], "pads": [0, 1, 2, 0], "strides": [1, 2]}, (1, 2, 7, 7)),
    ("ceil", {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 8, 8)),
    ("same-upper", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 7, 8)),
    ("1d", {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 9)),
]


@gpu
@BOTH
@pytest.mark.parametrize("name,attrs,shape", POOLS, ids=[p[0] for p in POOLS])
def test_max_pool(cp, name, attrs, shape, dtype):
    check(cp, "MaxPool", [rand(*shape)], attrs, 12, dtype)


@gpu
@BOTH
def test_max_pool_dilations(cp, dtype):
    attrs = {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]}
    check(cp, "MaxPool", [rand(1, 2, 7, 7)], attrs, 12, dtype)


@gpu
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_indices(cp, storage_order):
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "storage_order": storage_order}
    check(cp, "MaxPool", [rand(2, 3, 7, 6)], attrs, 12, num_outputs=2)


@gpu
@BOTH
@pytest.mark.parametrize("name,attrs,shape", POOLS, ids=[p[0] for p in POOLS])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool(cp, name, attrs, shape, include_pad, dtype):
    check(cp, "AveragePool", [rand(*shape)], dict(attrs, count_include_pad=include_pad), 19, dtype)


@gpu
@BOTH
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (2, 3, 7)])
def test_global_average_pool(cp, shape, dtype):
    check(cp, "GlobalAveragePool", [rand(*shape)], {}, 1, dtype)


# ---------------------------------------------------------------------------------------------
# Errors carry the node name


@gpu
def test_compute_error_names_the_node(cp):
    kernel = kernels.lookup("Reshape", 14)({}, 14, "my_reshape")
    ctx = FakeContext(cp, [rand(2, 3), np.array([4, -1], np.int64)], host_inputs=(1,))
    with pytest.raises(ValueError, match="^Reshape node 'my_reshape': cannot infer -1") as info:
        kernel.compute(ctx)
    assert any("my_reshape" in note for note in info.value.__notes__)


# ---------------------------------------------------------------------------------------------
# CPU-only: registry, claimable, attribute validation


EXPECTED_OPS = {
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Sqrt", "Exp", "Log", "Reciprocal", "Tanh", "Sigmoid",
    "Relu", "LeakyRelu", "Erf", "Gelu", "Max", "Min", "Where", "Cast", "Equal", "Less", "Greater", "Not",
    "Clip", "MatMul", "Gemm", "Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization",
    "ReduceSum", "ReduceMean", "ReduceMax", "Transpose", "Concat", "Gather", "Slice", "Reshape", "Squeeze",
    "Unsqueeze", "Flatten", "Expand", "Identity", "Dropout", "Conv", "MaxPool", "AveragePool",
    "GlobalAveragePool",
    # issue 10 (tests in test_kernels_math_logic.py, _data_movement.py, _fused.py, _claims.py)
    "IsNaN", "IsInf", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Split", "Tile", "Pad", "Range",
    "ConstantOfShape", "Trilu", "GatherElements", "GatherND", "ScatterND", "CumSum", "ArgMax", "ArgMin", "Einsum",
    "Mish", "HardSwish", "HardSigmoid", "Softplus", "Sign", "Mod", "Sum", "Cos", "Sin", "Floor", "Ceil", "Round",
    "RMSNormalization", "RotaryEmbedding", "Attention",
    "ConvTranspose",  # issue 25: claimed only where cuDNN loads (test_cudnn_gpu.py)
    # issue 26: recurrent layers (tests in test_rnn_cpu.py, test_rnn_gpu.py)
    "LSTM", "GRU", "RNN",
    "ai.ephost.SkipLayerNormalization", "ai.ephost.BiasGelu", "ai.ephost.FusedMatMul",
    # issue 27: quantized ops (tests in test_quant_cpu.py, test_quant_gpu.py)
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul", "ConvInteger",
    "QLinearConv", "com.microsoft.QGemm", "com.microsoft.MatMulIntegerToFloat", "com.microsoft.DynamicQuantizeMatMul",
    "com.microsoft.QLinearAdd", "com.microsoft.QLinearMul", "com.microsoft.QLinearGlobalAveragePool",
}


def test_supported_ops_cover_the_list():
    assert set(kernels.supported_ops()) == EXPECTED_OPS


def test_lookup_picks_the_newest_version_at_or_below_the_opset():
    assert kernels.lookup("Gelu", 20).op_type == "Gelu"
    with pytest.raises(kernels.UnsupportedOpError, match="^CUDA plugin has Gelu kernels from opset 20"):
        kernels.lookup("Gelu", 19)
    with pytest.raises(kernels.UnsupportedOpError, match="^CUDA plugin has no kernel for op type 'Foo'"):
        kernels.lookup("Foo", 13)


def test_register_twice_is_refused():
    @base.register("EphostTestOnlyOp", 3)
    class First(base.CudaKernel):
        pass

    try:
        with pytest.raises(RuntimeError, match="^kernel for EphostTestOnlyOp since opset 3 registered twice"):
            @base.register("EphostTestOnlyOp", 3)
            class Second(base.CudaKernel):
                pass
    finally:
        del base.KERNELS["EphostTestOnlyOp"]


@pytest.mark.parametrize("op_type,attrs,dtypes,opset,expected", [
    ("Add", {}, [TensorProto.FLOAT, TensorProto.FLOAT], None, True),
    ("Add", {}, ["float16", "float16"], None, True),
    ("Add", {}, [np.float32, np.float16], None, False),
    ("Add", {}, [TensorProto.INT64, TensorProto.INT64], None, True),
    ("Add", {}, [TensorProto.DOUBLE, TensorProto.DOUBLE], None, False),
    ("Pow", {}, ["float32", "int64"], None, True),
    ("Gather", {"axis": 0}, ["float16", "int64"], None, True),
    ("Gather", {"axis": 0}, ["float16", "float32"], None, False),
    ("Reshape", {}, ["float32", "int64"], 14, True),
    ("Where", {}, ["bool", "float32", "float32"], None, True),
    ("Where", {}, ["float32", "float32", "float32"], None, False),
    ("Cast", {"to": TensorProto.FLOAT}, [TensorProto.INT64], None, True),
    ("Cast", {"to": TensorProto.INT32}, [TensorProto.INT64], None, True),
    ("Cast", {"to": TensorProto.DOUBLE}, [TensorProto.FLOAT], None, False),
    ("Gelu", {"approximate": "tanh"}, ["float32"], 20, True),
    ("Gelu", {"approximate": "erf"}, ["float32"], 20, False),
    ("Gelu", {}, ["float32"], 19, False),
    ("Conv", {"kernel_shape": [3, 3, 3]}, ["float32", "float32"], None, False),
    ("Conv", {"kernel_shape": [3, 3], "group": 2}, ["float32", "float32", "float32"], None, True),
    ("MaxPool", {}, ["float32"], None, False),
    ("Clip", {}, ["float32", None, "float32"], None, True),
    ("Slice", {}, ["float32", "int64", "int64", None, "int32"], None, True),
    ("BatchNormalization", {"training_mode": 1}, ["float32"] * 5, None, False),
    ("BatchNormalization", {}, ["float16", "float32", "float32", "float32", "float32"], None, True),
    ("Concat", {"axis": 1}, ["float16"] * 5, None, True),
    ("Concat", {}, ["float16"] * 2, None, False),
    ("NoSuchOp", {}, ["float32"], None, False),
])
def test_claimable(op_type, attrs, dtypes, opset, expected):
    assert kernels.claimable(op_type, attrs, dtypes, opset) is expected


@pytest.mark.parametrize("op_type,attrs,opset,message", [
    ("Gelu", {"approximate": "fast"}, 20,
     r"^Gelu node 'n': attribute 'approximate' is 'fast'; allowed: 'none', 'tanh'$"),
    ("Gemm", {"transA": 2}, 13, r"^Gemm node 'n': attribute 'transA' is 2; allowed: 0 or 1$"),
    ("Conv", {"group": 0}, 11, r"^Conv node 'n': attribute 'group' is 0; allowed: an integer >= 1$"),
    ("Conv", {"auto_pad": "SAME"}, 11, r"^Conv node 'n': attribute 'auto_pad' is 'SAME'; allowed: 'NOTSET', "),
    ("MaxPool", {"kernel_shape": [0, 3]}, 12,
     r"^MaxPool node 'n': attribute 'kernel_shape' is \(0, 3\); allowed: integers >= 1$"),
    ("Transpose", {"perm": [0, 0]}, 13,
     r"^Transpose node 'n': attribute 'perm' is \(0, 0\); allowed: a permutation of 0..1$"),
    ("Cast", {"to": 11}, 19, r"^Cast node 'n': attribute 'to' is 11; allowed: "),
    ("LeakyRelu", {"alpha": "big"}, 16, r"^LeakyRelu node 'n': attribute 'alpha' is 'big'; allowed: a number$"),
    ("ReduceSum", {"keepdims": 5}, 13, r"^ReduceSum node 'n': attribute 'keepdims' is 5; allowed: 0 or 1$"),
    ("Concat", {}, 13, r"^Concat node 'n': attribute 'axis' is None; allowed: an integer"),
])
def test_bad_attributes_raise_value_error(op_type, attrs, opset, message):
    with pytest.raises(ValueError, match=message):
        kernels.lookup(op_type, opset)(attrs, opset, "n")


def test_host_inputs_declared_for_shape_like_inputs():
    assert kernels.lookup("Reshape", 14).host_inputs == (1,)
    assert kernels.lookup("Slice", 13).host_inputs == (1, 2, 3, 4)
    assert kernels.lookup("Expand", 13).host_inputs == (1,)
    assert kernels.lookup("Squeeze", 13).host_inputs == (1,)
    assert kernels.lookup("ReduceMean", 18).host_inputs == (1,)
    assert kernels.lookup("MatMul", 13).host_inputs == ()
