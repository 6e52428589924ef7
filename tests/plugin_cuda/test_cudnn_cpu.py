"""The pure-Python parts of the cuDNN convolutions (no GPU): geometry, math types, the plan's ReLU /
residual folding, the provider option and the message when cuDNN cannot be loaded."""

from __future__ import annotations

import numpy as np
import pytest

from host.runtime.node import NodeInfo
from plugin_cuda.device import cudnn, cudnn_conv
from plugin_cuda.kernels.conv_transpose import transpose_output
from plugin_cuda.options import OptionError, parse_options
from plugin_cuda.plan import cudnn_step
from plugin_cuda.plan.program import Op, Program, Value


def test_forward_geometry_2d_passes_through_and_asymmetric_pads_are_refused():
    geo = cudnn_conv.forward_geometry((2, 8, 9, 9), (4, 4, 3, 3), (2, 4, 5, 5), 2, (1, 1), (1, 1), (2, 2), (1, 1))
    assert geo == cudnn_conv.ConvGeometry((2, 8, 9, 9), (4, 4, 3, 3), (2, 4, 5, 5), (1, 1), (2, 2), (1, 1), 2)
    assert cudnn_conv.forward_geometry((1, 4, 9, 9), (4, 4, 3, 3), (1, 4, 8, 8), 1, (0, 1), (1, 1), (1, 1),
                                       (1, 1)) is None
    assert cudnn_conv.forward_geometry((1, 4, 9, 9, 9, 9), (4, 4, 3, 3, 3, 3), (1, 4, 7, 7, 7, 7), 1,
                                       (0,) * 4, (0,) * 4, (1,) * 4, (1,) * 4) is None


def test_forward_geometry_lifts_1d_to_a_unit_height():
    geo = cudnn_conv.forward_geometry((2, 6, 31), (8, 6, 5), (2, 8, 16), 1, (2,), (2,), (2,), (3,))
    assert geo.x_shape == (2, 6, 1, 31) and geo.w_shape == (8, 6, 1, 5) and geo.y_shape == (2, 8, 1, 16)
    assert (geo.pads, geo.strides, geo.dilations) == ((0, 2), (1, 2), (1, 3))


def _cpu_transpose(x_shape, w_shape, **attrs):
    """The CPU EP's ConvTranspose geometry (an independent implementation) as (begin, out)."""
    from host.cpu_ep.ops_conv_transpose import ConvTranspose

    attrs = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in attrs.items()}
    geo = ConvTranspose(NodeInfo("t", "ConvTranspose", "", 17, attrs, ("x", "w"), ("y",)))._geometry(x_shape, w_shape)
    return geo.begin, geo.out


TRANSPOSES = [
    ((2, 16, 9, 9), (16, 8, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    ((1, 4, 5, 5), (4, 4, 3, 3), dict(strides=[2, 2], pads=[0, 1, 2, 0])),
    ((1, 4, 5, 5), (4, 4, 3, 3), dict(strides=[2, 2], output_shape=[10, 11])),
    ((1, 4, 5, 6), (4, 2, 4, 4), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    ((1, 4, 5, 6), (4, 2, 3, 3), dict(strides=[3, 2], auto_pad="SAME_LOWER")),
    ((1, 8, 6, 6), (8, 3, 3, 3), dict(dilations=[2, 2], pads=[1, 1, 1, 1])),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", TRANSPOSES)
def test_transpose_geometry_matches_the_cpu_ep_and_maps_back_onto_the_input(x_shape, w_shape, attrs):
    nd = len(x_shape) - 2
    get = lambda k, d: tuple(attrs.get(k, (d,) * nd))  # noqa: E731
    geo = transpose_output("t", x_shape, w_shape[2:], get("strides", 1), get("dilations", 1),
                           tuple(attrs.get("pads", (0,) * 2 * nd)), get("output_padding", 0),
                           attrs.get("output_shape"), attrs.get("auto_pad", "NOTSET"))
    assert (geo.begin, geo.out) == _cpu_transpose(x_shape, w_shape, **attrs)
    conv, crop = cudnn_conv.transpose_geometry(x_shape, w_shape, geo.out, 1, geo.begin, geo.strides,
                                               geo.dilations)
    taps = [(k - 1) * d + 1 for k, d in zip(w_shape[2:], geo.dilations)]
    # cuDNN's consistency rule: the matching Conv of the result maps back onto the input's size.
    for dx, p, t, s, size in zip(conv.x_shape[2:], conv.pads, taps, geo.strides, x_shape[2:]):
        assert (dx + 2 * p - t) // s + 1 == size
    if crop is None:
        assert conv.x_shape[2:] == geo.out and conv.pads == geo.begin
    else:
        assert conv.pads == (0,) * nd
        assert all(c + o <= dx for c, o, dx in zip(crop, geo.out, conv.x_shape[2:]))


def test_transpose_output_refuses_output_padding_past_the_stride():
    with pytest.raises(ValueError, match=r"^t: output_padding\[0\] = 2 must be less than max\(stride, dilation\) = 2$"):
        transpose_output("t", (1, 1, 4, 4), (3, 3), (2, 2), (1, 1), (0,) * 4, (2, 0), None, "NOTSET")


def test_math_types_strict_tf32_and_half():
    assert cudnn_conv.math_type(np.float32, False) == cudnn.CUDNN_FMA_MATH == 3
    assert cudnn_conv.math_type(np.float32, True) == cudnn.CUDNN_DEFAULT_MATH == 0
    assert cudnn_conv.math_type(np.float16, False) == cudnn.CUDNN_TENSOR_OP_MATH == 1
    assert cudnn.data_type(np.float16) == 2
    with pytest.raises(cudnn.CudnnError, match="^cuDNN convolution got dtype float64; allowed: float32, float16, "
                                               "bfloat16$"):
        cudnn.data_type(np.float64)


def _program(ops_spec, residual=False):
    values = {i: Value(i, f"v{i}", (1, 4, 5, 5)) for i in range(8)}
    values[1] = Value(1, "w", (4, 4, 3, 3), np.zeros((4, 4, 3, 3), np.float32))
    values[2] = Value(2, "b", (4,), np.zeros(4, np.float32))
    return Program(values, ops_spec, [0, 5] if residual else [0], [7])


def test_fold_relu_and_residual_into_the_cudnn_conv():
    conv = Op("cudnn_conv", "c", [0, 1, 2], [3], {"group": 1})
    add = Op("ew", "a", [3, 5], [6], {"expr": cudnn_step.ADD})
    relu = Op("ew", "r", [6], [7], {"expr": cudnn_step.RELU})
    folded = cudnn_step.fold_epilogues(_program([conv, add, relu], residual=True))
    assert [(op.kind, op.inputs, op.outputs, op.attrs.get("relu")) for op in folded.ops] == [
        ("cudnn_conv", [0, 1, 2, 5], [7], True)]
    plain = cudnn_step.fold_epilogues(_program([conv, Op("ew", "r", [3], [7], {"expr": cudnn_step.RELU})]))
    assert [(op.inputs, op.outputs, op.attrs.get("relu")) for op in plain.ops] == [([0, 1, 2], [7], True)]


def test_no_fold_without_bias_or_when_the_result_has_other_readers():
    no_bias = Op("cudnn_conv", "c", [0, 1], [3], {})
    relu = Op("ew", "r", [3], [7], {"expr": cudnn_step.RELU})
    assert cudnn_step.fold_epilogues(_program([no_bias, relu])).ops == [no_bias, relu]
    conv = Op("cudnn_conv", "c", [0, 1, 2], [3], {})
    other = Op("ew", "n", [3], [4], {"expr": "(-{0})"})
    prog = _program([conv, relu, other])
    assert cudnn_step.fold_epilogues(prog).ops == [conv, relu, other]


def test_algo_search_option():
    assert parse_options({}, 1).cudnn_conv_algo_search == "HEURISTIC"
    assert parse_options({"cudnn_conv_algo_search": "exhaustive"}, 1).cudnn_conv_algo_search == "EXHAUSTIVE"
    assert parse_options({"ep.cuda.cudnn_conv_algo_search": "DEFAULT"}, 1).cudnn_conv_algo_search == "DEFAULT"
    with pytest.raises(OptionError, match=r"^option cudnn_conv_algo_search='FAST': expected a cuDNN algorithm "
                                          r"search; allowed: HEURISTIC, EXHAUSTIVE, DEFAULT$"):
        parse_options({"cudnn_conv_algo_search": "FAST"}, 1)


def test_load_failure_is_a_typed_error_naming_what_was_tried(monkeypatch):
    saved = cudnn._lib, cudnn._lib_path, cudnn._load_error, cudnn._warned
    cudnn.reset_for_tests()
    monkeypatch.setattr(cudnn, "candidates", lambda tried: tried.append("nvidia.cudnn: not installed") or
                        ["/nonexistent/libcudnn.so.9"])
    try:
        with pytest.raises(cudnn.CudnnError, match=r"^cannot load cuDNN 9: install the nvidia-cudnn-cu13 wheel "
                                                   r"\(pip install nvidia-cudnn-cu13\) matching CuPy's CUDA version; "
                                                   r"tried: nvidia.cudnn: not installed; /nonexistent/libcudnn.so.9: "):
            cudnn.load_library()
        with pytest.warns(RuntimeWarning, match="^CUDA plugin: convolutions run on the plugin's own kernels: "
                                                "cannot load cuDNN 9"):
            assert cudnn.availability().startswith("cannot load cuDNN 9")
        assert cudnn.HandlePool(True, "HEURISTIC").take(0) is None  # no handle, no second warning
    finally:
        cudnn._lib, cudnn._lib_path, cudnn._load_error, cudnn._warned = saved


def _conv_relu_model(x_shape, w_shape, **attrs):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones(w_shape, np.float32), "W")
    b = numpy_helper.from_array(np.ones(w_shape[0], np.float32), "B")
    nodes = [helper.make_node("Conv", ["X", "W", "B"], ["C"], name="conv", **attrs),
             helper.make_node("Relu", ["C"], ["Y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("x_shape, pads, on_cudnn", [
    ((8, 64, 56, 56), [1, 1, 1, 1], True),  # 8 * 64 * 56 * 56 * 576 multiply-adds
    ((1, 4, 8, 8), [1, 1, 1, 1], False),  # too small: a generated kernel with its epilogue
    ((8, 64, 56, 56), [0, 0, 1, 1], False),  # asymmetric pads: cuDNN pads symmetrically
])
def test_plan_lowering_chooses_cudnn_and_folds_the_relu(monkeypatch, x_shape, pads, on_cudnn):
    from plugin_cuda.plan import fuse, lower
    from plugin_cuda.plan.onnx_spec import spec_from_onnx

    monkeypatch.setattr(cudnn, "usable", lambda: True)  # as on a machine where cuDNN loads
    monkeypatch.setattr(cudnn_step, "descriptors_ok", lambda geo, dtype=None: geo is not None)
    prog = lower.lower(spec_from_onnx(_conv_relu_model(x_shape, (x_shape[1], x_shape[1], 3, 3), pads=pads)))
    steps = fuse.build_steps(prog)
    kinds = [s.kind for s in steps]
    if on_cudnn:
        assert kinds == ["cudnn_conv"] and steps[0].op.attrs["relu"] is True
        assert steps[0].writes == prog.outputs
    else:
        assert "cudnn_conv" not in kinds


def test_no_cudnn_keeps_the_generated_convolution(monkeypatch):
    from plugin_cuda.plan import lower
    from plugin_cuda.plan.onnx_spec import spec_from_onnx

    monkeypatch.setattr(cudnn, "usable", lambda: False)
    prog = lower.lower(spec_from_onnx(_conv_relu_model((8, 64, 56, 56), (64, 64, 3, 3), pads=[1, 1, 1, 1])))
    assert "cudnn_conv" not in [op.kind for op in prog.ops] and "conv" in [op.kind for op in prog.ops]


def test_two_convolutions_meeting_in_one_add_fold_only_the_first():
    first = Op("cudnn_conv", "c3", [0, 1, 2], [3], {})
    second = Op("cudnn_conv", "ds", [0, 1, 2], [4], {})
    add = Op("ew", "a", [3, 4], [6], {"expr": cudnn_step.ADD})
    relu = Op("ew", "r", [6], [7], {"expr": cudnn_step.RELU})
    folded = cudnn_step.fold_epilogues(_program([first, second, add, relu]))
    assert [(op.node, op.inputs, op.outputs, op.attrs.get("relu")) for op in folded.ops] == [
        ("ds", [0, 1, 2], [4], None), ("c3", [0, 1, 2, 4], [7], True)]


def test_a_shim_without_its_sublibraries_is_skipped_before_any_call(tmp_path, monkeypatch):
    # libcudnn.so.9 aborts the process at its first call when libcudnn_graph.so.9 is missing.
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cudnn.ctypes, "CDLL", no_library)
    (tmp_path / "libcudnn.so.9").write_bytes(b"")
    assert cudnn.missing_sublibrary(str(tmp_path / "libcudnn.so.9")) == "libcudnn_graph.so.9"
    for name in ("libcudnn_graph.so.9", "libcudnn_ops.so.9"):
        (tmp_path / name).write_bytes(b"")
    assert cudnn.missing_sublibrary(str(tmp_path / "libcudnn.so.9")) == "libcudnn_cnn.so.9"
    (tmp_path / "libcudnn_cnn.so.9").write_bytes(b"")
    assert cudnn.missing_sublibrary(str(tmp_path / "libcudnn.so.9")) is None


def test_a_handle_that_cannot_be_made_means_the_own_kernels_and_one_warning(monkeypatch):
    def refuse(*args):
        raise cudnn.CudnnError("cudnnCreate failed: CUDNN_STATUS_NOT_INITIALIZED (1001)", 1001)

    monkeypatch.setattr(cudnn, "availability", lambda: None)
    monkeypatch.setattr(cudnn, "CudnnHandle", refuse)
    pool = cudnn.HandlePool(False, "HEURISTIC")
    with pytest.warns(RuntimeWarning, match=r"^CUDA plugin: convolutions run on the plugin's own kernels: "
                                            r"cudnnCreate failed: CUDNN_STATUS_NOT_INITIALIZED \(1001\)$"):
        assert pool.take(0) is None
    assert pool.take(0) is None and pool.failed.startswith("cudnnCreate failed")


def test_conv_transpose_plan_errors_name_the_node_and_what_fits():
    from plugin_cuda.kernels.conv_transpose import ConvTranspose

    kernel = ConvTranspose({"strides": [2, 2]}, 17, "up")
    with pytest.raises(ValueError, match=r"^ConvTranspose node 'up': weight \(8, 4, 3, 3\) must have the input's 4 "
                                         r"channels first, a multiple of group 1$"):
        kernel._plan((1, 4, 5, 5), (8, 4, 3, 3))
    with pytest.raises(ValueError, match=r"^ConvTranspose node 'up': attribute 'strides' is \[2, 2\]; allowed: 1 "
                                         r"values for an input of 1 spatial dims$"):
        kernel._plan((1, 4, 5), (4, 4, 3))
    plan = kernel._plan((1, 4, 5, 5), (4, 6, 3, 3))
    assert plan.out_shape == (1, 6, 11, 11) and plan.crop is None and plan.geo.pads == (0, 0)


def test_descriptors_of_the_gpu_cases_build_and_give_the_onnx_output_shapes():
    """Descriptor calls are host-only: where the cuDNN wheel is installed this checks, without a GPU, that
    every geometry of test_cudnn_gpu.py makes valid descriptors whose output shape is ONNX's
    (ConvSetup compares cudnnGetConvolutionNdForwardOutputDim with it)."""
    from plugin_cuda.kernels.conv import Conv
    from plugin_cuda.kernels.conv_transpose import ConvTranspose
    from tests.plugin_cuda.test_cudnn_gpu import CONV_CASES, TRANSPOSE_CASES

    try:
        lib = cudnn.load_library()
    except cudnn.CudnnError as e:
        pytest.skip(f"cuDNN 9 is not installed here (pip install nvidia-cudnn-cu13): {str(e)[:80]}")
    on_cudnn = 0
    for name, xs, ws, attrs in CONV_CASES:
        plan = Conv(attrs, 17, name)._plan(xs, ws)
        if plan.cudnn_geo is not None:
            on_cudnn += 1
            for dtype in (np.float32, np.float16):
                setup = cudnn_conv.ConvSetup(lib, "forward", plan.cudnn_geo, dtype, False)
                assert setup.geo.y_shape[:2] == plan.out_shape[:2]
    assert on_cudnn == len(CONV_CASES) - 2  # the two asymmetric-pad cases stay on im2col
    for name, xs, ws, attrs in TRANSPOSE_CASES:
        plan = ConvTranspose(attrs, 17, name)._plan(xs, ws)
        cudnn_conv.ConvSetup(lib, "backward_data", plan.geo, np.float32, False)
