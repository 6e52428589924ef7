"""Quantized models on the CUDA EP (int8 GEMMs on cuBLASLt) against onnxruntime's CPU provider: each
quantized op on odd sizes (integer outputs bit-exact; QLinearAdd / QLinearMul within one step of
onnxruntime, whose vectorized kernels may round a tie the other way, and bit-exact with ephost's CPU EP),
the small CNN and transformer quantized by onnxruntime's quantizer (QOperator, QDQ, dynamic) end to end
with their quantized nodes on the GPU, and CUDA-graph capture + replay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
U8, I8, I32, F = TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32, TensorProto.FLOAT
NP = {U8: np.uint8, I8: np.int8, I32: np.int32, F: np.float32}
RNG = np.random.default_rng(0)


def codes(elem, *shape):
    info = np.iinfo(NP[elem])
    return RNG.integers(info.min, info.max + 1, shape).astype(NP[elem])


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def node_model(op, inputs: dict, outputs: dict, inits=(), opset=21, domain="", **attrs):
    """A one-node model named 'n': `inputs` name -> (elem, shape) graph inputs, `inits` initializers,
    inputs in the order of `order`."""
    order = attrs.pop("order")
    node = helper.make_node(op, order, list(outputs), name="n", domain=domain, **attrs)
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
                              [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()], list(inits))
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10  # what the onnxruntime of every machine reads
    return model


def ort_run(model, feeds):
    import onnxruntime

    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def cuda_session(genv, model, **options):
    from host.runtime.session import InferenceSession

    return InferenceSession(model, providers=[(CUDA, {"use_tf32": "0", **options})], env=genv)


def check(genv, model, feeds, max_step=0, quantized=("n",)):
    """ephost on CUDA against onnxruntime CPU (integer outputs within `max_step`, float outputs to 1e-6) and
    bit-exact against ephost's CPU EP (the same float32 operations in the same order); the nodes named in
    `quantized` must run on the CUDA EP."""
    from host.runtime.session import InferenceSession

    sess = cuda_session(genv, model)
    placed = sess.node_assignment()
    assert all(placed.get(name) == CUDA for name in quantized), placed
    got = sess.run(None, feeds)
    for g, e, c in zip(got, ort_run(model, feeds), InferenceSession(model).run(None, feeds)):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        if e.dtype.kind in "iu":
            diff = np.abs(g.astype(np.int64) - e.astype(np.int64))
            assert diff.max(initial=0) <= max_step, (diff.max(), np.argwhere(diff > max_step)[:5])
        else:
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(g, c)
    return got


@pytest.mark.parametrize("elem", [U8, I8])
def test_quantize_dequantize_per_tensor_with_ties_and_saturation(genv, elem):
    x = np.concatenate([np.array([-300, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.49, 7e4], np.float32),
                        RNG.standard_normal(4001).astype(np.float32) * 40])
    zp = np.array(3, NP[elem])
    q = node_model("QuantizeLinear", {"x": (F, [x.size])}, {"y": (elem, [x.size])},
                   [const("s", np.float32(0.5)), const("zp", zp)], order=["x", "s", "zp"])
    y = check(genv, q, {"x": x})[0]
    dq = node_model("DequantizeLinear", {"q": (elem, [y.size])}, {"z": (F, [y.size])},
                    [const("s", np.float32(0.37)), const("zp", zp)], order=["q", "s", "zp"])
    check(genv, dq, {"q": y})


def test_quantize_dequantize_per_axis_and_blocked(genv):
    x = RNG.standard_normal((3, 7, 5)).astype(np.float32) * 9
    scales = (RNG.random(7) + 0.05).astype(np.float32)
    per_axis = node_model("QuantizeLinear", {"x": (F, [3, 7, 5])}, {"y": (I8, [3, 7, 5])},
                          [const("s", scales), const("zp", codes(I8, 7))], order=["x", "s", "zp"], axis=1)
    check(genv, per_axis, {"x": x})
    blocked_scales = (RNG.random((3, 7, 2)) + 0.05).astype(np.float32)
    blocked = node_model("QuantizeLinear", {"x": (F, [3, 7, 5])}, {"y": (U8, [3, 7, 5])},
                         [const("s", blocked_scales), const("zp", codes(U8, 3, 7, 2))], order=["x", "s", "zp"],
                         axis=2, block_size=3)
    check(genv, blocked, {"x": x})
    dq = node_model("DequantizeLinear", {"q": (U8, [3, 7, 5])}, {"z": (F, [3, 7, 5])},
                    [const("s", scales), const("zp", codes(U8, 7))], order=["q", "s", "zp"], axis=1)
    check(genv, dq, {"q": codes(U8, 3, 7, 5)})
    bias = node_model("DequantizeLinear", {"b": (I32, [9])}, {"z": (F, [9])}, [const("s", np.float32(1e-3))],
                      order=["b", "s"])
    check(genv, bias, {"b": RNG.integers(-2**20, 2**20, 9).astype(np.int32)})


def test_dynamic_quantize_linear(genv):
    model = node_model("DynamicQuantizeLinear", {"x": (F, [7, 13])},
                       {"y": (U8, [7, 13]), "s": (F, []), "zp": (U8, [])}, order=["x"], opset=13)
    for x in (RNG.standard_normal((7, 13)).astype(np.float32) * 3, (RNG.random((7, 13)) + 0.5).astype(np.float32)):
        check(genv, model, {"x": x})


@pytest.mark.parametrize("a_elem, b_elem", [(U8, I8), (I8, I8), (U8, U8)])
def test_matmul_integer_with_column_zero_points(genv, a_elem, b_elem):
    a, b = codes(a_elem, 2, 5, 37), codes(b_elem, 37, 11)
    model = node_model("MatMulInteger", {"a": (a_elem, [2, 5, 37])}, {"y": (I32, [2, 5, 11])},
                       [const("b", b), const("az", codes(a_elem)), const("bz", codes(b_elem, 11))],
                       order=["a", "b", "az", "bz"], opset=13)
    check(genv, model, {"a": a})
    batched = node_model("MatMulInteger", {"a": (a_elem, [3, 6, 9]), "b": (b_elem, [3, 9, 7])},
                         {"y": (I32, [3, 6, 7])}, [const("az", codes(a_elem))], order=["a", "b", "az"], opset=13)
    check(genv, batched, {"a": codes(a_elem, 3, 6, 9), "b": codes(b_elem, 3, 9, 7)})


@pytest.mark.parametrize("per_column", [False, True])
def test_qlinear_matmul(genv, per_column):
    n = 13
    b_scale = (RNG.random(n) * 0.02 + 0.001).astype(np.float32) if per_column else np.float32(0.01)
    b_zp = np.zeros(n, np.int8) if per_column else np.int8(0)
    model = node_model("QLinearMatMul", {"a": (U8, [1, 9, 75])}, {"y": (U8, [1, 9, n])},
                       [const("as", np.float32(0.02)), const("az", np.uint8(121)), const("b", codes(I8, 75, n)),
                        const("bs", b_scale), const("bz", b_zp), const("ys", np.float32(0.15)),
                        const("yz", np.uint8(117))],
                       order=["a", "as", "az", "b", "bs", "bz", "ys", "yz"])
    check(genv, model, {"a": codes(U8, 1, 9, 75)})


@pytest.mark.parametrize("elem", [U8, I8])
@pytest.mark.parametrize("geometry", [
    dict(x=[2, 6, 9, 11], w=[4, 6, 3, 3], pads=[1, 1, 1, 1]),
    dict(x=[1, 6, 10, 7], w=[6, 2, 3, 2], pads=[1, 0, 2, 1], strides=[2, 1], group=3, dilations=[1, 2]),
    dict(x=[3, 5, 17], w=[7, 5, 4], strides=[2]),
])
def test_qlinear_conv_and_conv_integer(genv, elem, geometry):
    geometry = dict(geometry)
    x_shape, w_shape = geometry.pop("x"), geometry.pop("w")
    m = w_shape[0]
    x, w = codes(elem, *x_shape), codes(I8, *w_shape)
    params = [const("xs", np.float32(0.03)), const("xz", codes(elem)), const("w", w),
              const("ws", (RNG.random(m) * 0.01 + 0.001).astype(np.float32)), const("wz", np.zeros(m, np.int8)),
              const("ys", np.float32(0.2)), const("yz", codes(elem)), const("bias", RNG.integers(-999, 999, m).astype(np.int32))]
    model = node_model("QLinearConv", {"x": (elem, x_shape)}, {"y": (elem, [None] * len(x_shape))}, params,
                       order=["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "bias"], opset=13, **geometry)
    check(genv, model, {"x": x})
    integer = node_model("ConvInteger", {"x": (elem, x_shape)}, {"y": (I32, [None] * len(x_shape))},
                         [const("w", w), const("xz", codes(elem)), const("wz", codes(I8))], order=["x", "w", "xz", "wz"],
                         opset=13, **geometry)
    check(genv, integer, {"x": x})


MS = "com.microsoft"


@pytest.mark.parametrize("quantized_out", [False, True])
def test_qgemm(genv, quantized_out):
    n, k = 10, 21
    inits = [const("as", np.float32(0.02)), const("az", np.uint8(100)), const("b", codes(I8, n, k)),
             const("bs", (RNG.random(n) * 0.02).astype(np.float32)), const("bz", np.zeros(n, np.int8)),
             const("c", RNG.integers(-500, 500, n).astype(np.int32))]
    order = ["a", "as", "az", "b", "bs", "bz", "c"]
    if quantized_out:
        inits += [const("ys", np.float32(0.3)), const("yz", np.uint8(128))]
        order += ["ys", "yz"]
    model = node_model("QGemm", {"a": (U8, [7, k])}, {"y": (U8 if quantized_out else F, [7, n])}, inits,
                       order=order, domain=MS, transB=1, alpha=0.75)
    check(genv, model, {"a": codes(U8, 7, k)})


def test_matmul_integer_to_float_and_dynamic_quantize_matmul(genv):
    k, n = 33, 9
    b, bias = codes(I8, k, n), RNG.standard_normal(n).astype(np.float32)
    to_float = node_model("MatMulIntegerToFloat", {"a": (U8, [2, 3, k])}, {"y": (F, [2, 3, n])},
                          [const("b", b), const("as", np.float32(0.03)), const("bs", (RNG.random(n) * 0.01).astype(np.float32)),
                           const("az", np.uint8(77)), const("bz", np.zeros(n, np.int8)), const("bias", bias)],
                          order=["a", "b", "as", "bs", "az", "bz", "bias"], domain=MS)
    check(genv, to_float, {"a": codes(U8, 2, 3, k)})
    dynamic = node_model("DynamicQuantizeMatMul", {"a": (F, [5, k])}, {"y": (F, [5, n])},
                         [const("b", b), const("bs", np.float32(0.01)), const("bz", np.int8(0)), const("bias", bias)],
                         order=["a", "b", "bs", "bz", "bias"], domain=MS)
    check(genv, dynamic, {"a": RNG.standard_normal((5, k)).astype(np.float32)})


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("elem", [U8, I8])
def test_qlinear_add_and_mul(genv, op, elem):
    model = node_model(op, {"a": (elem, [4, 1, 33]), "b": (elem, [5, 33])}, {"c": (elem, [4, 5, 33])},
                       [const("as", np.float32(0.05)), const("az", codes(elem)), const("bs", np.float32(0.07)),
                        const("bz", codes(elem)), const("cs", np.float32(0.09)), const("cz", codes(elem))],
                       order=["a", "as", "az", "b", "bs", "bz", "cs", "cz"], domain=MS)
    check(genv, model, {"a": codes(elem, 4, 1, 33), "b": codes(elem, 5, 33)}, max_step=1)


@pytest.mark.parametrize("channels_last", [0, 1])
def test_qlinear_global_average_pool(genv, channels_last):
    shape = [2, 5, 7, 3] if channels_last else [2, 3, 5, 7]
    model = node_model("QLinearGlobalAveragePool", {"x": (U8, shape)}, {"y": (U8, [None] * 4)},
                       [const("xs", np.float32(0.05)), const("xz", np.uint8(131)), const("ys", np.float32(0.02)),
                        const("yz", np.uint8(125))], order=["x", "xs", "xz", "ys", "yz"], domain=MS,
                       channels_last=channels_last)
    check(genv, model, {"x": codes(U8, *shape)})


# ---- models from onnxruntime's quantizer ----------------------------------------------------------

QUANTIZED_NODE_OPS = {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "MatMulInteger",
                      "QLinearGlobalAveragePool", "ConvInteger", "DynamicQuantizeLinear", "QuantizeLinear",
                      "DequantizeLinear", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}


def quantized_model(out_dir: str, name: str, fmt: str) -> str:
    """tests/host/test_quantized.py's model quantized by onnxruntime's quantizer; the float model is written
    first at IR 10 (the quantizer's calibration session refuses the IR a newer onnx writes)."""
    import os

    test_quantized = pytest.importorskip("tests.host.test_quantized", reason="onnxruntime's quantizer makes the models")
    src = os.path.join(out_dir, f"{name}.onnx")
    if not os.path.exists(src):
        model = test_quantized.MODELS[name][0]()
        model.ir_version = 10
        onnx.save(model, src)
    return test_quantized._quantized(out_dir, name, fmt)


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quantized_gpu"))


@pytest.mark.parametrize("fmt", ["qop", "qdq", "dynamic"])
@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_quantized_models_end_to_end(genv, quant_dir, name, fmt):
    model = onnx.load(quantized_model(quant_dir, name, fmt))
    model.ir_version = 10
    for out in model.graph.output:
        out.type.tensor_type.shape.SetInParent()
    x = np.random.RandomState(2).rand(*(1, 3, 8, 8) if name == "cnn" else (1, 4, 16)).astype(np.float32)
    sess = cuda_session(genv, model)
    placed = sess.node_assignment()
    graph_ops = {n.name: n.op_type for n in sess.graph.model.graph.node} if hasattr(sess, "graph") else {}
    on_cuda = {graph_ops.get(k, k) for k, v in placed.items() if v == CUDA}
    elsewhere = {graph_ops.get(k, k) for k, v in placed.items() if v != CUDA}
    print(f"{name}/{fmt}: on CUDA {sorted(on_cuda)}; elsewhere {sorted(elsewhere)}")
    assert not (elsewhere & QUANTIZED_NODE_OPS), placed
    assert on_cuda & QUANTIZED_NODE_OPS
    got = sess.run(None, {"x": x})[0]
    expected = ort_run(model, {"x": x})[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if (name, fmt) == ("transformer", "qdq"):  # tests/host/test_quantized.py says why: one output step
        np.testing.assert_allclose(got, expected, atol=1 / 255 + 1e-6)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_capture_and_replay(genv, cp):
    """Quantize -> QLinearMatMul -> QLinearAdd -> Dequantize and a DynamicQuantizeMatMul, captured as a
    CUDA graph: replays equal onnxruntime on new data (nothing reads the device on the host)."""
    k, n = 24, 12
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["q"], name="q"),
        helper.make_node("QLinearMatMul", ["q", "xs", "xz", "b", "bs", "bz", "ys", "yz"], ["m"], name="mm"),
        helper.make_node("QLinearAdd", ["m", "ys", "yz", "m", "ys", "yz", "ys", "yz"], ["s"], name="add",
                         domain=MS),
        helper.make_node("DequantizeLinear", ["s", "ys", "yz"], ["y"], name="dq"),
        helper.make_node("DynamicQuantizeMatMul", ["x", "b", "bs", "bz"], ["d"], name="dyn", domain=MS),
    ]
    inits = [const("xs", np.float32(0.05)), const("xz", np.uint8(128)), const("b", codes(I8, k, n)),
             const("bs", np.float32(0.01)), const("bz", np.int8(0)), const("ys", np.float32(0.4)),
             const("yz", np.uint8(120))]
    graph = helper.make_graph(nodes, "cap", [helper.make_tensor_value_info("x", F, [6, k])],
                              [helper.make_tensor_value_info("y", F, [6, n]), helper.make_tensor_value_info("d", F, [6, n])],
                              inits, value_info=[helper.make_tensor_value_info("q", U8, [6, k]),  # onnx does not
                                                 helper.make_tensor_value_info("m", U8, [6, n]),  # infer com.microsoft
                                                 helper.make_tensor_value_info("s", U8, [6, n])])  # ops' types
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    sess = cuda_session(genv, model, enable_cuda_graph="1")
    assert set(sess.node_assignment().values()) == {CUDA}, sess.node_assignment()
    x = cp.asarray(RNG.standard_normal((6, k)).astype(np.float32))
    outs = {"y": cp.zeros((6, n), np.float32), "d": cp.zeros((6, n), np.float32)}
    binding = sess.io_binding()
    binding.bind_input("x", x)
    for name, buf in outs.items():
        binding.bind_output(name, buf)
    cp.cuda.get_current_stream().synchronize()
    sess.run_with_iobinding(binding)  # warm-up and capture
    assert sess.capture.captured(0)
    for seed in range(2):
        new = np.random.default_rng(seed + 10).standard_normal((6, k)).astype(np.float32) * (seed + 1)
        x[...] = cp.asarray(new)
        cp.cuda.get_current_stream().synchronize()
        sess.run_with_iobinding(binding)
        expected = ort_run(model, {"x": new})
        np.testing.assert_array_equal(cp.asnumpy(outs["y"]), expected[0])
        np.testing.assert_array_equal(cp.asnumpy(outs["d"]), expected[1])


def test_every_integer_gemm_ran_on_cublaslt():
    """Runs last in this module: no GEMM of the tests above fell back to CuPy's integer matmul."""
    from plugin_cuda.kernels import quant_gemm

    assert quant_gemm.stats["fallbacks"] == 0
