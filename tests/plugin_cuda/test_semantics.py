"""One place for ONNX op semantics (plugin_cuda/semantics): the per-node kernels and the compiled
plan's lowering read attributes and compute shapes with the same rules, and those rules are
ONNX's (checked against onnx.reference and NumPy). CPU only: kernels are built without a GPU and
asked for their output shapes; the plan is lowered without one."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest

from plugin_cuda import kernels
from plugin_cuda.plan import lower
from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from plugin_cuda.semantics import GELU_CUDA, Attributes, OpError, shapes
from tests.plugin_cuda.layout_models import _model


def _reshape_model(in_shape, target, allowzero=0):
    return _model("Reshape", {"X": in_shape}, {"S": np.array(target, np.int64)}, 1, 14, allowzero=allowzero)


def _reference_shape(model, inputs):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, inputs)[0].shape


def _plan_shape(model):
    prog = lower.lower(spec_from_onnx(model))
    return prog.values[prog.outputs[0]].shape


def _kernel_reshape(in_shape, target, allowzero=0):
    kernel = kernels.lookup("Reshape", 14)({"allowzero": allowzero}, 14, "n")
    return kernel._out_shape(tuple(in_shape), tuple(target))


@pytest.mark.parametrize("in_shape, target, allowzero", [
    ((2, 3, 4), (4, -1), 0),
    ((2, 3, 4), (0, -1), 0),
    ((2, 3, 4), (0, 0, 4), 0),
    ((2, 3, 4), (-1,), 0),
    ((2, 3, 4), (2, 12), 1),
    ((2, 3, 4), (1, 2, 1, 12), 0),
])
def test_reshape_shapes_match_onnx_reference_on_both_paths(in_shape, target, allowzero):
    model = _reshape_model(in_shape, target, allowzero)
    want = _reference_shape(model, {"X": np.zeros(in_shape, np.float32)})
    assert _kernel_reshape(in_shape, target, allowzero) == want
    assert _plan_shape(model) == want


@pytest.mark.parametrize("target", [(-2, -3), (2, -3)])
def test_reshape_dim_below_minus_one_is_refused_by_both_paths(target):
    """The two paths disagreed: the plan's lowering accepted (-2, -3) for 6 elements, the kernels
    refused it. ONNX refuses any dimension below -1 (its shape inference, as onnxruntime does);
    so do both paths now, with one message, and the plan never claims such a node."""
    import onnx

    model = _reshape_model((2, 3), target)
    with pytest.raises(onnx.shape_inference.InferenceError, match="Invalid dimension value: -"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    shown = str(tuple(target)).replace("(", r"\(").replace(")", r"\)")
    message = rf"^Reshape node 'n': shape {shown} has a dimension below -1; allowed: -1, 0 or more$"
    with pytest.raises(OpError, match=message):
        _kernel_reshape((2, 3), target)
    with pytest.raises(PlanError, match=message):
        _plan_shape(model)
    spec = spec_from_onnx(model)
    assert "has a dimension below -1" in lower.unsupported_reason(spec, spec.nodes[0])


@pytest.mark.parametrize("target, message", [
    ((4, -1, -1), r"^Reshape node 'n': shape \(4, -1, -1\) has more than one -1$"),
    ((5, -1), r"^Reshape node 'n': cannot infer -1 in \(5, -1\) for input shape \(2, 3, 4\)$"),
    ((0, 0, 0, 0), r"^Reshape node 'n': shape \(0, 0, 0, 0\) copies dim 3 that input shape \(2, 3, 4\) lacks$"),
    ((5, 5), r"^Reshape node 'n': input shape \(2, 3, 4\) does not fit \(5, 5\)$"),
])
def test_reshape_errors_are_one_message_on_both_paths(target, message):
    with pytest.raises(OpError, match=message):
        _kernel_reshape((2, 3, 4), target)
    with pytest.raises(PlanError, match=message):
        _plan_shape(_reshape_model((2, 3, 4), target))


def test_unsqueeze_with_a_repeated_axis_is_refused_by_both_paths():
    model = _model("Unsqueeze", {"X": (2, 3)}, {"A": np.array([0, 0], np.int64)}, 1, 13)
    message = r"^Unsqueeze node 'n': axes \(0, 0\) repeat an axis$"
    kernel = kernels.lookup("Unsqueeze", 13)({}, 13, "n")
    with pytest.raises(OpError, match=message):
        kernel._out_shape((2, 3), (0, 0))
    with pytest.raises(PlanError, match=message):
        _plan_shape(model)


@pytest.mark.parametrize("op, in_shape, consts, attrs, opset", [
    ("Transpose", (2, 3, 4), {}, {}, 13),
    ("Transpose", (2, 3, 4), {}, {"perm": [1, 0, 2]}, 13),
    ("Flatten", (2, 3, 4), {}, {"axis": -1}, 13),
    ("Flatten", (2, 3, 4), {}, {"axis": 3}, 13),
    ("Squeeze", (1, 3, 1), {"A": np.array([-1], np.int64)}, {}, 13),
    ("Squeeze", (1, 3, 1), {}, {}, 13),
    ("Unsqueeze", (2, 3), {"A": np.array([-1, 0], np.int64)}, {}, 13),
])
def test_layout_shapes_match_onnx_reference_on_both_paths(op, in_shape, consts, attrs, opset):
    model = _model(op, {"X": in_shape}, consts, 1, opset, **attrs)
    want = _reference_shape(model, {"X": np.zeros(in_shape, np.float32)})
    assert _plan_shape(model) == want
    kernel = kernels.lookup(op, opset)(attrs, opset, "n")
    if op == "Transpose":
        got = kernel._plan(in_shape)[1]
    elif op == "Flatten":
        got = kernel._out_shape(in_shape)
    else:
        axes = tuple(consts["A"].tolist()) if consts else None
        got = kernel._out_shape(in_shape, axes)
    assert got == want


def test_concat_requires_its_axis_on_both_paths():
    model = _model("Concat", {"X": (2, 3), "Z": (2, 3)}, {}, 1, 13)
    message = r"^Concat node 'n': attribute 'axis' is None; allowed: an integer \(the attribute is required\)$"
    with pytest.raises(ValueError, match=message):
        kernels.lookup("Concat", 13)({}, 13, "n")
    with pytest.raises(PlanError, match=message):
        _plan_shape(model)


def test_attribute_errors_name_node_value_and_what_is_allowed():
    attrs = Attributes({"transA": 2, "alpha": "x", "perm": [1, "a"], "mode": b"linear"}, "Gemm", "g")
    with pytest.raises(OpError, match=r"^Gemm node 'g': attribute 'transA' is 2; allowed: 0 or 1$"):
        attrs.flag("transA")
    with pytest.raises(OpError, match=r"^Gemm node 'g': attribute 'alpha' is 'x'; allowed: a number$"):
        attrs.number("alpha")
    with pytest.raises(OpError, match=r"^Gemm node 'g': attribute 'perm' is \[1, 'a'\]; allowed: a list of integers$"):
        attrs.integers("perm")
    assert attrs.string("mode") == "linear" and attrs.integer("absent", 7) == 7 and attrs.number("absent") is None


def test_a_gemm_flag_other_than_0_or_1_is_refused_by_both_paths():
    from onnx import TensorProto, helper

    node = helper.make_node("Gemm", ["A", "B"], ["Y"], name="g", transA=2)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, 4]),
                                            helper.make_tensor_value_info("B", TensorProto.FLOAT, [4, 5])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    message = r"^Gemm node 'g': attribute 'transA' is 2; allowed: 0 or 1$"
    with pytest.raises(ValueError, match=message):
        kernels.lookup("Gemm", 13)({"transA": 2}, 13, "g")
    with pytest.raises(PlanError, match=message):
        _plan_shape(model)


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ((1,), (100,), None, None), ((-1,), (-100,), (1,), (-1,)), ((0, 2), (2, 0), (0, 1), (1, -1)), ((5,), (9,), (0,), None),
])
def test_slice_clamping_matches_numpy(starts, ends, axes, steps):
    x = np.arange(12).reshape(3, 4)
    index, out_shape = shapes.slice_indices(x.shape, starts, ends, axes, steps, "Slice node 's'")
    want = x
    for k, (s, e) in enumerate(zip(starts, ends)):
        axis = axes[k] if axes else k
        sl = [slice(None)] * 2
        sl[axis] = slice(s, e, steps[k] if steps else 1)
        want = want[tuple(sl)]
    np.testing.assert_array_equal(x[index], want)
    assert out_shape == want.shape


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed: cannot compile GELU_CUDA on the CPU")
def test_gelu_cuda_matches_onnx_reference(tmp_path):
    """GELU_CUDA, the one definition every CUDA source includes, compiled by g++ and compared with
    onnx.reference's Gelu-20 in both forms."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    shim = "#include <math.h>\n#define __device__\n#define __forceinline__ inline\n" + GELU_CUDA + """
extern "C" void run(const float* x, float* erf_out, float* tanh_out, int n) {
  for (int i = 0; i < n; ++i) { erf_out[i] = ep_gelu(x[i]); tanh_out[i] = ep_gelu_tanh(x[i]); }
}
"""
    (tmp_path / "gelu.cpp").write_text(shim)
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "gelu.so"), str(tmp_path / "gelu.cpp")],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(tmp_path / "gelu.so"))
    x = np.linspace(-6, 6, 241, dtype=np.float32)
    got = {"none": np.empty_like(x), "tanh": np.empty_like(x)}
    ptr = ctypes.c_void_p
    lib.run(x.ctypes.data_as(ptr), got["none"].ctypes.data_as(ptr), got["tanh"].ctypes.data_as(ptr), len(x))
    for approximate in ("none", "tanh"):
        node = helper.make_node("Gelu", ["X"], ["Y"], approximate=approximate)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [len(x)])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [len(x)])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
        want = ReferenceEvaluator(model).run(None, {"X": x})[0]
        np.testing.assert_allclose(got[approximate], want, rtol=1e-6, atol=1e-6)
    assert math.isclose(float(got["tanh"][-1]), 6.0, rel_tol=1e-6)
