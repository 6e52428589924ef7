"""CPU EP kernels against onnx.reference.ReferenceEvaluator on single-node models.

Tolerances: rtol 1e-5 / atol 1e-6 for float32 unless a case says why it needs more.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from host.cpu_ep import CPU_KERNELS, OpKernel, create_kernel, lookup, register, supported_ops
from host.errors import InvalidArgument, KernelError, ModelError
from host.runtime.node import NodeInfo, node_info

OPSET = 21
RTOL, ATOL = 1e-5, 1e-6
# Sums of many products (GEMM, Conv, pools, normalizations) may be accumulated in another
# order than the reference's: allow a few float32 ulps of the accumulated magnitude.
SUM_TOL = {"rtol": 1e-4, "atol": 1e-5}

rng = np.random.default_rng(20240611)


def f32(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def i32(*shape, low=-5, high=6, dtype=np.int32):
    return rng.integers(low, high, size=shape).astype(dtype)


def i64(*values):
    return np.array(values, dtype=np.int64)


def idx(*shape, high, low=None):
    """int64 indices in [low, high), negatives included by default (ONNX counts them from the end)."""
    return rng.integers(-high if low is None else low, high, size=shape).astype(np.int64)


def boolean(*shape):
    return rng.integers(0, 2, size=shape).astype(bool)


def case(op, inputs, n_out=1, opset=OPSET, tol=None, id=None, **attrs):
    """One parametrized case: `inputs` is an ordered dict name -> array or None (absent)."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    outputs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outputs, name=f"{op.lower()}_node", **attrs)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    return pytest.param(node, feeds, opset, tol or {}, id=id or op)


def reference(node, feeds, opset):
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output]
    graph = helper.make_graph([node], "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, feeds)


def ort_single(node, feeds, opset):
    """onnxruntime's CPU EP on a model of the one node: a second reference where it implements the op."""
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def ours(node, feeds, opset):
    kernel = create_kernel(node_info(node, opset))
    return kernel.run(*[feeds[name] if name else None for name in node.input])


def assert_same(got, want, tol):
    want = np.asarray(want)
    assert got.shape == want.shape
    if want.dtype.kind in "OU":
        assert got.astype(str).tolist() == want.astype(str).tolist()
        return
    assert got.dtype == want.dtype
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=tol.get("rtol", RTOL), atol=tol.get("atol", ATOL))
    else:
        np.testing.assert_array_equal(got, want)


# -- cases ------------------------------------------------------------------------------

_POS = dict(low=0.1, high=3.0)
_with_nan = f32(3, 4)
_with_nan[0, 1] = np.nan
_with_nan[2, 3] = np.nan

UNARY = [
    case("Neg", {"x": f32(3, 4)}),
    case("Neg", {"x": i32(3, 4)}, id="Neg-int32"),
    case("Abs", {"x": f32(3, 4)}),
    case("Sqrt", {"x": f32(3, 4, **_POS)}),
    case("Exp", {"x": f32(3, 4)}),
    case("Log", {"x": f32(3, 4, **_POS)}),
    case("Reciprocal", {"x": f32(3, 4, **_POS)}),
    case("Floor", {"x": f32(3, 4)}),
    case("Ceil", {"x": f32(3, 4)}),
    case("Tanh", {"x": f32(3, 4)}),
    case("Sigmoid", {"x": f32(3, 4, low=-30, high=30)}),
    case("Relu", {"x": f32(3, 4)}),
    case("Erf", {"x": f32(3, 4)}),
    case("Sin", {"x": f32(3, 4)}),
    case("Cos", {"x": f32(3, 4)}),
    case("Sign", {"x": np.array([-2.5, 0.0, 3.0, -0.0], np.float32)}),
    case("IsNaN", {"x": _with_nan}),
    case("Not", {"x": boolean(3, 4)}),
    case("Softplus", {"x": f32(3, 4, low=-10, high=10)}),
    case("LeakyRelu", {"x": f32(3, 4)}, alpha=0.2),
    case("Elu", {"x": f32(3, 4)}, alpha=0.7),
    case("Selu", {"x": f32(3, 4)}),
    case("HardSigmoid", {"x": f32(3, 4, low=-5, high=5)}, alpha=0.3, beta=0.4),
    case("Gelu", {"x": f32(3, 4, low=-4, high=4)}),
    case("Gelu", {"x": f32(3, 4, low=-4, high=4)}, approximate="tanh", id="Gelu-tanh"),
    case("PRelu", {"x": f32(2, 3, 4), "slope": f32(3, 1)}),
    case("Clip", {"x": f32(3, 4), "min": np.float32(-0.5), "max": np.float32(0.7)}),
    case("Clip", {"x": f32(3, 4), "min": None, "max": np.float32(0.3)}, id="Clip-max-only"),
    case("Clip", {"x": i32(3, 4), "min": np.int32(-2), "max": np.int32(3)}, id="Clip-int32"),
    case("Clip", {"x": f32(3, 4)}, opset=6, min=-0.5, max=0.5, id="Clip-opset6-attrs"),
]

BINARY = [
    case("Add", {"a": f32(2, 3, 4), "b": f32(4)}),
    case("Sub", {"a": f32(3, 1), "b": f32(1, 4)}),
    case("Mul", {"a": f32(2, 3, 4), "b": f32(3, 1)}),
    case("Div", {"a": f32(3, 4), "b": f32(3, 4, **_POS)}),
    case("Div", {"a": i32(3, 4, low=-20, high=20), "b": i32(3, 4, low=1, high=6) * rng.choice([-1, 1], (3, 4))
                 .astype(np.int32)}, id="Div-int32-truncates"),
    case("Pow", {"a": f32(3, 4, **_POS), "b": f32(4)}),
    case("Pow", {"a": i32(3, 4, low=0, high=5, dtype=np.int64), "b": i32(4, low=0, high=4, dtype=np.int64)},
         id="Pow-int64"),
    case("Pow", {"a": f32(3, 4, **_POS), "b": i32(4, low=-2, high=3)}, id="Pow-float-int-exponent"),
    case("Equal", {"a": i32(3, 4, low=0, high=3), "b": i32(4, low=0, high=3)}),
    case("Less", {"a": i32(3, 4, low=0, high=3), "b": i32(4, low=0, high=3)}),
    case("Greater", {"a": f32(3, 4), "b": f32(4)}),
    case("LessOrEqual", {"a": i32(3, 4, low=0, high=3), "b": i32(3, 1, low=0, high=3)}),
    case("GreaterOrEqual", {"a": i32(3, 4, low=0, high=3), "b": i32(3, 1, low=0, high=3)}),
    case("And", {"a": boolean(3, 4), "b": boolean(4)}),
    case("Or", {"a": boolean(3, 4), "b": boolean(4)}),
    case("Xor", {"a": boolean(3, 4), "b": boolean(3, 4)}),
    case("Max", {"a": f32(3, 4), "b": f32(4), "c": f32(3, 1)}),
    case("Min", {"a": f32(3, 4), "b": f32(4), "c": f32(3, 1)}),
    case("Sum", {"a": f32(3, 4), "b": f32(4), "c": f32(3, 1)}),
    case("Sum", {"a": f32(3, 4)}, id="Sum-single"),
    case("Mean", {"a": f32(3, 4), "b": f32(4), "c": f32(3, 1)}),
    case("Where", {"c": boolean(3, 4), "x": f32(3, 4), "y": f32(4)}),
    case("Cast", {"x": f32(3, 4, low=-50, high=50)}, to=TensorProto.INT32, id="Cast-float-int32"),
    case("Cast", {"x": f32(3, 4)}, to=TensorProto.FLOAT16, id="Cast-float-float16"),
    case("Cast", {"x": i32(3, 4)}, to=TensorProto.DOUBLE, id="Cast-int32-double"),
    case("Cast", {"x": f32(3, 4)}, to=TensorProto.BOOL, id="Cast-float-bool"),
    # Cast to string follows onnxruntime's number format ('%.8g'), not the reference's (NumPy's repr):
    # tests/host/test_cpu_ops_strings.py checks it against onnxruntime.
    case("Cast", {"x": np.array([[0.5, -1.25], [2.5, 0.125]], np.float32)}, to=TensorProto.STRING,
         id="Cast-float-string"),
    case("CastLike", {"x": f32(3, 4, low=-50, high=50), "like": i32(1, dtype=np.int64)}),
]

MATH = [
    case("MatMul", {"a": f32(2, 3, 4), "b": f32(4, 5)}, tol=SUM_TOL),
    case("MatMul", {"a": f32(4), "b": f32(2, 4, 3)}, tol=SUM_TOL, id="MatMul-1d-batched"),
    case("MatMul", {"a": i32(3, 4), "b": i32(4, 2)}, id="MatMul-int32"),
    case("Gemm", {"a": f32(4, 3), "b": f32(5, 4), "c": f32(5)}, tol=SUM_TOL,
         transA=1, transB=1, alpha=0.5, beta=2.0),
    case("Gemm", {"a": f32(3, 4), "b": f32(4, 5)}, tol=SUM_TOL, id="Gemm-no-C"),
    case("Softmax", {"x": f32(2, 3, 4, low=-5, high=5)}, axis=1),
    case("LogSoftmax", {"x": f32(2, 3, 4, low=-5, high=5)}),
]

NORM = [
    case("LayerNormalization", {"x": f32(2, 3, 4), "scale": f32(4), "bias": f32(4)}, n_out=3, tol=SUM_TOL),
    case("LayerNormalization", {"x": f32(2, 3, 4), "scale": f32(3, 4)}, n_out=3, tol=SUM_TOL,
         axis=1, epsilon=1e-3, id="LayerNormalization-axis1-nobias"),
    case("BatchNormalization", {"x": f32(2, 3, 4, 5), "s": f32(3), "b": f32(3), "m": f32(3),
                                "v": f32(3, **_POS)}, tol=SUM_TOL, epsilon=1e-3),
    case("BatchNormalization", {"x": f32(4, 3, 5), "s": f32(3), "b": f32(3), "m": f32(3), "v": f32(3, **_POS)},
         n_out=3, opset=15, tol=SUM_TOL, training_mode=1, momentum=0.8, id="BatchNormalization-training"),
    case("Dropout", {"x": f32(3, 4)}, n_out=2, opset=13),
    case("Dropout", {"x": f32(3, 4), "r": np.float32(0.3), "t": np.array(False)}, n_out=2, id="Dropout-inputs"),
    case("Dropout", {"x": f32(3, 4)}, opset=10, ratio=0.2, id="Dropout-opset10"),
]


def _reduce_cases():
    ops = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]
    out = []
    for op in ops:
        x = f32(2, 3, 4, **_POS) if op == "ReduceLogSum" else f32(2, 3, 4)
        out.append(case(op, {"x": x, "axes": i64(0, -1)}, tol=SUM_TOL, id=f"{op}-axes-input"))
        out.append(case(op, {"x": x}, keepdims=0, tol=SUM_TOL, id=f"{op}-all"))
        out.append(case(op, {"x": x, "axes": i64(1)}, keepdims=0, tol=SUM_TOL, id=f"{op}-keepdims0"))
    out += [
        case("ReduceSum", {"x": f32(2, 3), "axes": np.zeros(0, np.int64)}, noop_with_empty_axes=1,
             id="ReduceSum-noop"),
        case("ReduceSum", {"x": i32(2, 3, 4)}, opset=11, axes=[1], id="ReduceSum-opset11-attr"),
        case("ReduceMean", {"x": f32(2, 3, 4)}, opset=13, axes=[-1, 0], tol=SUM_TOL, id="ReduceMean-opset13-attr"),
        case("ReduceMax", {"x": np.zeros((2, 0, 3), np.float32), "axes": i64(1)}, id="ReduceMax-empty-set"),
        case("ReduceMin", {"x": i32(3, 4), "axes": i64(1)}, id="ReduceMin-int32"),
        case("ReduceProd", {"x": i32(3, 4, low=-3, high=4), "axes": i64(0)}, id="ReduceProd-int32"),
        case("ArgMax", {"x": i32(3, 4, low=0, high=3)}, axis=1),
        case("ArgMax", {"x": i32(3, 4, low=0, high=3)}, axis=-1, keepdims=0, select_last_index=1,
             id="ArgMax-last"),
        case("ArgMin", {"x": f32(3, 4)}),
        case("ArgMin", {"x": i32(3, 4, low=0, high=3)}, axis=0, select_last_index=1, id="ArgMin-last"),
    ]
    return out


SHAPE = [
    case("Reshape", {"x": f32(2, 3, 4), "shape": i64(0, -1, 2)}),
    case("Reshape", {"x": np.zeros((0, 3), np.float32), "shape": i64(3, 0)}, allowzero=1, id="Reshape-allowzero"),
    case("Transpose", {"x": f32(2, 3, 4)}, perm=[1, 2, 0]),
    case("Transpose", {"x": f32(2, 3, 4)}, id="Transpose-default"),
    case("Concat", {"a": f32(2, 3), "b": f32(2, 1), "c": f32(2, 2)}, axis=-1),
    case("Split", {"x": f32(6, 2), "split": i64(1, 2, 3)}, n_out=3),
    case("Split", {"x": f32(2, 7)}, n_out=3, opset=18, axis=1, num_outputs=3, id="Split-num-outputs-uneven"),
    case("Split", {"x": f32(6, 2)}, n_out=2, opset=11, split=[2, 4], id="Split-opset11-attr"),
    case("Split", {"x": f32(6, 2)}, n_out=3, id="Split-equal"),
    case("Slice", {"x": f32(5, 6), "starts": i64(1, -1), "ends": i64(4, -100), "axes": i64(0, 1),
                   "steps": i64(2, -2)}),
    case("Slice", {"x": f32(5, 6), "starts": i64(-3), "ends": i64(2**62), "axes": i64(-1)}, id="Slice-clamp"),
    case("Slice", {"x": f32(5, 6)}, opset=9, starts=[1, 0], ends=[3, 4], id="Slice-opset9-attrs"),
    case("Gather", {"x": f32(3, 4, 2), "i": i64(-1, 0, 2, 1).reshape(2, 2)}, axis=1),
    case("Gather", {"x": f32(5, 2), "i": np.array(-2, np.int64)}, id="Gather-scalar-index"),
    case("Squeeze", {"x": f32(1, 3, 1, 2), "axes": i64(-2)}),
    case("Squeeze", {"x": f32(1, 3, 1, 2)}, id="Squeeze-all"),
    case("Squeeze", {"x": f32(1, 3, 1)}, opset=11, axes=[0], id="Squeeze-opset11-attr"),
    case("Unsqueeze", {"x": f32(3, 2), "axes": i64(0, -1)}),
    case("Unsqueeze", {"x": f32(3, 2)}, opset=11, axes=[1], id="Unsqueeze-opset11-attr"),
    case("Flatten", {"x": f32(2, 3, 4)}, axis=2),
    case("Flatten", {"x": f32(2, 3, 4)}, axis=0, id="Flatten-axis0"),
    case("Shape", {"x": f32(2, 3, 4, 5)}, start=1, end=-1),
    case("Shape", {"x": f32(2, 3)}, id="Shape-full"),
    case("Size", {"x": f32(2, 3, 4)}),
    case("Expand", {"x": f32(3, 1), "shape": i64(2, 1, 4)}),
    case("ConstantOfShape", {"shape": i64(2, 3)},
         value=helper.make_tensor("v", TensorProto.INT64, [1], [7])),
    case("ConstantOfShape", {"shape": i64(2, 3)}, id="ConstantOfShape-default"),
    case("Range", {"s": np.float32(1.0), "l": np.float32(9.5), "d": np.float32(1.5)}),
    case("Range", {"s": np.int32(10), "l": np.int32(1), "d": np.int32(-3)}, id="Range-int-negative"),
    case("Constant", {}, value=helper.make_tensor("v", TensorProto.FLOAT, [2, 2], [1, 2, 3, 4])),
    case("Constant", {}, value_ints=[1, 2, 3], id="Constant-ints"),
    case("Constant", {}, value_float=2.5, id="Constant-float"),
    case("Identity", {"x": f32(3, 4)}),
    case("Tile", {"x": f32(2, 3), "r": i64(2, 1)}),
    case("Pad", {"x": f32(2, 3), "pads": i64(1, 0, 2, 1), "v": np.float32(1.5)}),
    case("Pad", {"x": f32(3, 4), "pads": i64(2, 1, 1, 2)}, mode="reflect", id="Pad-reflect"),
    case("Pad", {"x": f32(3, 4), "pads": i64(1, 2, 3, 0)}, mode="edge", id="Pad-edge"),
    case("Pad", {"x": f32(3, 4), "pads": i64(1, 2, 2, 1)}, mode="wrap", id="Pad-wrap"),
    case("Pad", {"x": f32(2, 3, 4), "pads": i64(1, 2), "v": None, "axes": i64(-1)}, id="Pad-axes"),
    case("Pad", {"x": f32(2, 3)}, opset=2, pads=[0, 1, 1, 0], value=2.0, id="Pad-opset2-attrs"),
    case("Trilu", {"x": f32(2, 4, 5), "k": np.array(1, np.int64)}),
    case("Trilu", {"x": f32(4, 5), "k": np.array(-1, np.int64)}, upper=0, id="Trilu-lower"),
]

NN = [
    case("Conv", {"x": f32(1, 3, 7, 6), "w": f32(4, 3, 3, 3), "b": f32(4)}, tol=SUM_TOL, pads=[1, 1, 1, 1]),
    case("Conv", {"x": f32(2, 2, 9, 8), "w": f32(3, 2, 3, 2)}, tol=SUM_TOL,
         strides=[2, 1], dilations=[1, 2], pads=[0, 1, 2, 0], id="Conv-strides-dilations"),
    case("Conv", {"x": f32(1, 4, 6, 6), "w": f32(6, 2, 3, 3), "b": f32(6)}, tol=SUM_TOL, group=2,
         id="Conv-groups"),
    case("Conv", {"x": f32(2, 3, 7, 7), "w": f32(6, 1, 3, 3)}, tol=SUM_TOL, group=3, strides=[2, 2],
         pads=[1, 1, 1, 1], id="Conv-depthwise"),
    case("Conv", {"x": f32(2, 3, 10), "w": f32(4, 3, 3), "b": f32(4)}, tol=SUM_TOL,
         strides=[2], pads=[1, 2], id="Conv-1d"),
    case("Conv", {"x": f32(1, 2, 7, 5), "w": f32(3, 2, 3, 2)}, tol=SUM_TOL, strides=[2, 2],
         auto_pad="SAME_UPPER", id="Conv-same-upper"),
    case("Conv", {"x": f32(1, 2, 7, 5), "w": f32(3, 2, 2, 2)}, tol=SUM_TOL, auto_pad="SAME_LOWER",
         id="Conv-same-lower"),
    case("Conv", {"x": f32(1, 2, 7, 5), "w": f32(3, 2, 3, 3)}, tol=SUM_TOL, strides=[2, 2],
         auto_pad="VALID", id="Conv-valid"),
    case("Conv", {"x": f32(1, 2, 4, 5, 3), "w": f32(2, 2, 2, 3, 2)}, tol=SUM_TOL, pads=[1, 0, 1, 0, 1, 1],
         id="Conv-3d"),
    case("MaxPool", {"x": f32(2, 3, 7, 6)}, kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1]),
    case("MaxPool", {"x": f32(1, 2, 7, 7)}, n_out=2, kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1,
         id="MaxPool-ceil-indices"),
    case("MaxPool", {"x": f32(1, 2, 6, 5)}, n_out=2, kernel_shape=[2, 2], strides=[2, 1], storage_order=1,
         id="MaxPool-indices-colmajor"),
    case("MaxPool", {"x": f32(1, 2, 9, 9)}, kernel_shape=[2, 2], dilations=[2, 2], strides=[2, 1],
         id="MaxPool-dilations"),
    case("MaxPool", {"x": f32(2, 3, 11)}, kernel_shape=[3], strides=[2], auto_pad="SAME_UPPER",
         id="MaxPool-1d-same"),
    case("AveragePool", {"x": f32(2, 3, 7, 6)}, tol=SUM_TOL, kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 1, 1, 1]),
    case("AveragePool", {"x": f32(2, 3, 7, 6)}, tol=SUM_TOL, kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 1, 1, 1], count_include_pad=1, id="AveragePool-count-pad"),
    case("AveragePool", {"x": f32(1, 2, 8, 8)}, tol=SUM_TOL, kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1, id="AveragePool-ceil-count-pad"),
    case("AveragePool", {"x": f32(1, 2, 7, 5)}, tol=SUM_TOL, kernel_shape=[2, 3], auto_pad="SAME_LOWER",
         id="AveragePool-same-lower"),
    case("AveragePool", {"x": f32(1, 2, 9, 9)}, tol=SUM_TOL, kernel_shape=[2, 2], dilations=[2, 2],
         opset=19, id="AveragePool-dilations"),
    case("GlobalAveragePool", {"x": f32(2, 3, 4, 5)}, tol=SUM_TOL),
    case("GlobalMaxPool", {"x": f32(2, 3, 4, 5)}),
]

ALL_CASES = UNARY + BINARY + MATH + NORM + _reduce_cases() + SHAPE + NN


def check_reference(node, feeds, opset, tol) -> None:
    """ephost's outputs of one node equal the reference evaluator's (the case files' common check)."""
    want = reference(node, feeds, opset)
    got = ours(node, feeds, opset)
    assert len(got) >= len(want)
    for g, w in zip(got, want):
        assert_same(g, w, tol)


def check_onnxruntime(node, feeds, opset, tol) -> None:
    """ephost's outputs of one node equal onnxruntime's CPU provider's."""
    want = ort_single(node, feeds, opset)
    got = ours(node, feeds, opset)
    for g, w in zip(got, want):
        assert_same(g, w, tol)


@pytest.mark.parametrize(("node", "feeds", "opset", "tol"), ALL_CASES)
def test_matches_reference(node, feeds, opset, tol):
    check_reference(node, feeds, opset, tol)


def _subject_cases() -> list:
    """The cases of the ops added for real exports, one file per subject."""
    from tests.host import (
        test_cpu_ops_conv_recurrent,
        test_cpu_ops_indexing,
        test_cpu_ops_math,
        test_cpu_ops_resize,
        test_cpu_ops_transformer,
    )

    return [p for m in (test_cpu_ops_indexing, test_cpu_ops_math, test_cpu_ops_resize, test_cpu_ops_transformer,
                        test_cpu_ops_conv_recurrent) for p in m.CASES]


def test_the_ops_added_for_real_exports_are_registered_and_have_cases():
    export_ops = {"GatherElements", "GatherND", "ScatterND", "ScatterElements", "OneHot", "NonZero", "TopK", "CumSum",
                  "HardSwish", "Mish", "IsInf", "Mod", "Einsum", "Resize", "Attention", "RMSNormalization",
                  "RotaryEmbedding"}
    assert export_ops <= {op for _, op in supported_ops()}
    assert export_ops <= {p.values[0].op_type for p in _subject_cases()}


def test_every_registered_op_has_a_case():
    from tests.host import backend_compare as bc
    from tests.host.quant_ml_ops import ML_OPS, QUANT_OPS
    from tests.host.test_cpu_ops_detection import TESTED_OPS as DETECTION_OPS
    from tests.host.test_cpu_ops_strings import TESTED_OPS as STRING_OPS
    from tests.host.test_cpu_ops_transformer import EPHOST_OPS

    covered = {p.values[0].op_type for p in ALL_CASES + _subject_cases()} | set(EPHOST_OPS) | DETECTION_OPS
    covered |= STRING_OPS | QUANT_OPS | ML_OPS
    # Ops on subgraphs, sequences and optionals: tests/host/test_control_flow.py and test_sequences.py.
    covered |= {"If", "Loop", "Scan", "SequenceMap", "ConcatFromSequence", "SequenceAt", "SequenceConstruct",
                "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength", "SplitToSequence", "Optional",
                "OptionalGetElement", "OptionalHasElement"}
    # The ops added for onnx's backend suite (issue 26) have their cases there: an op counts when one of its
    # own node tests (not a function-expanded one) is expected to pass (tests/host/backend_exclusions.txt).
    exclusions = bc.load_exclusions()
    covered |= {bc.category(n) for n in bc.test_names() if bc.kind_of(n) == "node" and "_expanded" not in n
                and bc.exclusion_of(n, exclusions) is None} | COVERED_HERE
    missing = [op for domain, op in supported_ops() if op not in covered]
    assert missing == []


# -- semantics the reference cannot check -------------------------------------------------


# Registered ops that neither onnx's reference evaluator nor a backend node test exercises: their own test here.
COVERED_HERE = {"GlobalLpPool"}


@pytest.mark.parametrize("p", [1, 2, 3])
def test_global_lp_pool_matches_the_formula(p):
    """Neither onnxruntime nor onnx's reference evaluator has GlobalLpPool: NumPy's p-norm is the reference."""
    node = helper.make_node("GlobalLpPool", ["x"], ["y"], name="lp", p=p)
    x = np.random.default_rng(p).standard_normal((2, 3, 4, 5)).astype(np.float32)
    (got,) = ours(node, {"x": x}, 22)
    want = np.linalg.norm(x.reshape(2, 3, -1), ord=p, axis=-1).reshape(2, 3, 1, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)



def _kernel(op, opset=OPSET, n_out=1, name="n", inputs=("x",), **attrs):
    node = helper.make_node(op, list(inputs), [f"y{i}" for i in range(n_out)], name=name, **attrs)
    return create_kernel(node_info(node, opset))


def test_integer_div_truncates_toward_zero():
    a = np.array([-7, 7, -7, 7, 0], np.int32)
    b = np.array([2, 2, -2, -2, 3], np.int32)
    (y,) = _kernel("Div", inputs=("a", "b")).run(a, b)
    np.testing.assert_array_equal(y, np.array([-3, 3, 3, -3, 0], np.int32))
    assert y.dtype == np.int32


def test_negative_pads_crop():
    x = f32(3, 4)
    (y,) = _kernel("Pad", inputs=("x", "p")).run(x, i64(-1, 1, 0, -2))
    want = np.pad(x[1:, :2], [(0, 0), (1, 0)])
    np.testing.assert_array_equal(y, want)


def test_dropout_training_scales_kept_values():
    x = f32(50, 40, **_POS)
    kernel = _kernel("Dropout", n_out=2, inputs=("x", "r", "t"), seed=3)
    y, mask = kernel.run(x, np.float32(0.25), np.array(True))
    assert mask.dtype == np.bool_ and 0.6 < mask.mean() < 0.9
    np.testing.assert_allclose(y, np.where(mask, x / 0.75, 0), rtol=RTOL)


@pytest.mark.parametrize(("op", "opset", "axis"), [("Softmax", 11, None), ("LogSoftmax", 12, 2),
                                                    ("Softmax", 12, 0)])
def test_legacy_softmax_coerces_to_2d(op, opset, axis):
    # Before opset 13 the input is viewed as 2-D at `axis` (default 1). The reference
    # evaluator ignores this, so the expectation is spelled out here.
    x = f32(2, 3, 4, low=-5, high=5)
    attrs = {} if axis is None else {"axis": axis}
    (y,) = _kernel(op, opset=opset, **attrs).run(x)
    a = 1 if axis is None else axis
    x2 = x.reshape(int(np.prod(x.shape[:a])), -1).astype(np.float64)
    log_p = x2 - x2.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    want = (log_p if op == "LogSoftmax" else np.exp(log_p)).reshape(x.shape)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)


def test_constant_output_is_read_only():
    (y,) = _kernel("Constant", inputs=(), value_floats=[1.0, 2.0]).run()
    assert not y.flags.writeable


FLOAT32_NODES = [
    ("LeakyRelu", {}, [f32(3, 4)]),
    ("Selu", {}, [f32(3, 4)]),
    ("HardSigmoid", {}, [f32(3, 4)]),
    ("Gelu", {}, [f32(3, 4)]),
    ("Softplus", {}, [f32(3, 4)]),
    ("Gemm", {"alpha": 0.3, "beta": 0.7}, [f32(2, 3), f32(3, 4), f32(4)]),
    ("Softmax", {}, [f32(2, 3)]),
    ("ReduceMean", {}, [f32(2, 3)]),
    ("ReduceL2", {}, [f32(2, 3)]),
    ("Mean", {}, [f32(2, 3), f32(3)]),
    ("Clip", {}, [f32(2, 3), np.float32(0), None]),
    ("AveragePool", {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1]}, [f32(1, 2, 4, 4)]),
    ("Conv", {"pads": [1, 1, 1, 1]}, [f32(1, 2, 4, 4), f32(3, 2, 3, 3), f32(3)]),
    ("BatchNormalization", {}, [f32(2, 3, 4), f32(3), f32(3), f32(3), f32(3, **_POS)]),
    ("LayerNormalization", {}, [f32(2, 3), f32(3), f32(3)]),
    ("GlobalAveragePool", {}, [f32(1, 2, 3, 3)]),
]


@pytest.mark.parametrize(("op", "attrs", "inputs"), FLOAT32_NODES, ids=[n[0] for n in FLOAT32_NODES])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_dtype_is_kept(op, attrs, inputs, dtype):
    args = [None if a is None else np.asarray(a).astype(dtype) for a in inputs]
    names = [f"i{k}" if a is not None else "" for k, a in enumerate(args)]
    outputs = _kernel(op, inputs=names, **attrs).run(*args)
    assert outputs[0].dtype == dtype


def test_erf_fallback_matches_math_erf():
    from host.cpu_ep.ops_elementwise import erf, erf_fallback

    x = np.linspace(-6, 6, 101)
    np.testing.assert_allclose(erf_fallback(x), erf(x), rtol=1e-12, atol=1e-15)
    assert erf_fallback(x.astype(np.float32)).dtype == np.float32


# -- errors -------------------------------------------------------------------------------


def test_unsupported_op_raises_model_error():
    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="weird")
    with pytest.raises(ModelError, match=r"^CPUExecutionProvider has no kernel for op 'NoSuchOp' "
                                         r"\(domain 'ai\.onnx', opset 21\) used by node 'weird'$"):
        create_kernel(node_info(node, 21))


def test_op_before_its_opset_is_unsupported():
    node = helper.make_node("Gelu", ["x"], ["y"], name="g")
    with pytest.raises(ModelError, match=r"^CPUExecutionProvider has no kernel for op 'Gelu' "
                                         r"\(domain 'ai\.onnx', opset 19\)"):
        create_kernel(node_info(node, 19))


def test_bad_attribute_raises_model_error():
    with pytest.raises(ModelError, match=r"^node 'g' \(Gelu\): attribute 'approximate' is 'fast'; "
                                         r"allowed: one of 'none', 'tanh'$"):
        _kernel("Gelu", name="g", approximate="fast")


def test_missing_attribute_raises_model_error():
    with pytest.raises(ModelError, match=r"^node 'c' \(Concat\): attribute 'axis' is nothing \(missing\)"):
        _kernel("Concat", name="c", inputs=("a", "b"))


def test_kernel_failure_names_the_node():
    kernel = _kernel("MatMul", name="mm", inputs=("a", "b"))
    with pytest.raises(KernelError, match=r"^node 'mm' \(MatMul\) on CPUExecutionProvider failed: ") as info:
        kernel.run(f32(2, 3), f32(4, 5))
    assert info.value.node == "mm"
    assert info.value.ep == "CPUExecutionProvider"
    assert isinstance(info.value.__cause__, ValueError)


def test_ephost_errors_pass_through_unwrapped():
    class Refuses(OpKernel):
        def _run(self, x):
            raise InvalidArgument("no")

    kernel = Refuses(NodeInfo("r", "Refuses", "", OPSET, {}, ("x",), ("y",)))
    with pytest.raises(InvalidArgument, match="^no$"):
        kernel.run(f32(1))


# -- registry and node decoding -------------------------------------------------------------


def test_registry_lookup_and_ranges():
    assert lookup("", "Add", 14) is lookup("ai.onnx", "Add", 14) is not None
    assert lookup("", "LayerNormalization", 16) is None
    assert ("", "Conv") in supported_ops()

    @register("TestOnlyOp", domain="test.domain", since=3, until=5)
    class First(OpKernel):
        pass

    try:
        assert lookup("test.domain", "TestOnlyOp", 4) is First
        assert lookup("test.domain", "TestOnlyOp", 6) is None
        with pytest.raises(ValueError, match="^Second and First both serve TestOnlyOp at opsets 5..5$"):
            register("TestOnlyOp", domain="test.domain", since=5)(type("Second", (OpKernel,), {}))
    finally:
        del CPU_KERNELS[("test.domain", "TestOnlyOp")]


def test_node_info_decodes_attributes():
    body = helper.make_graph([], "body", [], [])
    node = helper.make_node(
        "Custom", ["a", "", "b"], ["y"], name="c", domain="my.dom",
        i=3, f=0.5, s="text", ints=[1, 2], floats=[0.5], strings=["p", "q"],
        t=helper.make_tensor("t", TensorProto.INT64, [2], [4, 5]), g=body,
    )
    info = node_info(node, 2)
    assert (info.name, info.op_type, info.domain, info.opset) == ("c", "Custom", "my.dom", 2)
    assert info.inputs == ("a", "", "b") and info.outputs == ("y",)
    a = info.attrs
    assert (a["i"], a["f"], a["s"], a["ints"], a["floats"], a["strings"]) == (
        3, 0.5, "text", [1, 2], [0.5], ["p", "q"])
    np.testing.assert_array_equal(a["t"], np.array([4, 5], np.int64))
    assert isinstance(a["g"], onnx.GraphProto)


# -- properties -----------------------------------------------------------------------------

BROADCAST_OPS = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Max": np.maximum, "Min": np.minimum}


@settings(deadline=None, max_examples=40)
@given(
    op=st.sampled_from(sorted(BROADCAST_OPS)),
    shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=4),
    seed=st.integers(0, 2**16),
)
def test_broadcasting_binary_ops(op, shapes, seed):
    gen = np.random.default_rng(seed)
    a = gen.standard_normal(shapes.input_shapes[0]).astype(np.float32)
    b = gen.standard_normal(shapes.input_shapes[1]).astype(np.float32)
    (y,) = _kernel(op, inputs=("a", "b")).run(a, b)
    assert y.shape == shapes.result_shape and y.dtype == np.float32
    np.testing.assert_array_equal(y, BROADCAST_OPS[op](a, b))


@settings(deadline=None, max_examples=30)
@given(
    shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4),
    seed=st.integers(0, 2**16),
)
def test_broadcasting_integer_div(shapes, seed):
    gen = np.random.default_rng(seed)
    a = gen.integers(-50, 50, shapes.input_shapes[0]).astype(np.int64)
    b = gen.integers(1, 9, shapes.input_shapes[1]) * gen.choice([-1, 1], shapes.input_shapes[1])
    (y,) = _kernel("Div", inputs=("a", "b")).run(a, b)
    want = np.trunc(a / b).astype(np.int64)  # exact: |a| < 2**53
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, want)
