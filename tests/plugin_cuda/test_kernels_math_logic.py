"""The CUDA plugin's elementwise kernels of issue 10 (unary math, IsNaN/IsInf, integer arithmetic and Mod,
comparisons, logic, Where on any dtype, integer casts) against the ONNX reference evaluator, float32 and
float16 with test_kernels.py's tolerances, integers and bools exactly."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from tests.plugin_cuda.test_kernels import BF16, BOTH, F16, F32, bools, check, exact, ints, rand

gpu = pytest.mark.gpu

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
@pytest.mark.parametrize("dtype", [F32, F16, BF16, np.int64, np.int32], ids=["f32", "f16", "bf16", "i64", "i32"])
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
@pytest.mark.parametrize("dtype", [np.int64, np.bool_, F16, BF16], ids=["i64", "bool", "f16", "bf16"])
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
