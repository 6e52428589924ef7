"""cuDNN convolutions on the CUDA EP against onnxruntime CPU: Conv of many geometries (per node and in
compiled plans), ConvTranspose, strict float32 (use_tf32=0: tight tolerance), TF32, float16, CUDA-graph
capture, the three algorithm searches, and the fallback to the plugin's own kernels without cuDNN.

Tolerances: strict float32 2e-4 relative to the reference's largest magnitude (cuDNN sums in
another order than MLAS; K up to 2304 products); TF32 2e-2 (10-bit mantissa inputs); float16
inputs and outputs 2e-2 against the reference computed on the same float16-rounded inputs.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"


def model_of(x_shape, w_shape, op="Conv", bias=True, relu=False, residual=False, dtype=np.float32, seed=0,
             **attrs):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    m = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits = [numpy_helper.from_array(w, "W")]
    inputs = ["X", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(m).astype(dtype), "B"))
        inputs.append("B")
    nodes = [helper.make_node(op, inputs, ["C"], **attrs)]
    last = "C"
    if residual:
        nodes.append(helper.make_node("Add", ["C", "R"], ["S"]))
        last = "S"
    nodes.append(helper.make_node("Relu" if relu else "Identity", [last], ["Y"]))
    ins = [helper.make_tensor_value_info("X", elem, x_shape)]
    if residual:  # static, as a compiled plan needs: the convolution's output shape
        ins.append(helper.make_tensor_value_info("R", elem, residual))
    # The output's rank with unknown dims: onnx's checker (1.20+) wants a shape field on graph outputs.
    out = helper.make_tensor_value_info("Y", elem, [None] * len(x_shape))
    graph = helper.make_graph(nodes, "conv", ins, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # what the onnxruntime of every machine reads
    return model


def reference(model, feeds):
    import onnxruntime

    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def run_ephost(genv, model, feeds, **options):
    from host.runtime.session import InferenceSession

    sess = InferenceSession(model, providers=[(CUDA, {k: str(v) for k, v in options.items()})], env=genv)
    try:
        assert set(sess.node_assignment().values()) == {CUDA}, sess.node_assignment()
        return sess.run(None, feeds)[0]
    finally:
        sess.close()


def used_cudnn(kind: str) -> bool:
    """Whether a cuDNN setup of `kind` was made since the last cudnn_conv.clear_setups()."""
    from plugin_cuda.device import cudnn_conv

    return any(key[0] == kind for key in cudnn_conv._setups)


def assert_close(got, want, rel):
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max())
    print(f"max abs error {err:.3e} (scale {scale:.2f})")
    assert err <= rel * scale, f"max abs error {err} > {rel} * {scale}"


CONV_CASES = [  # (id, x shape, w shape, attrs)
    ("3x3-pad1", (2, 8, 13, 11), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("1x1", (2, 32, 7, 7), (24, 32, 1, 1), {}),
    ("7x7-s2", (1, 3, 33, 35), (16, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    ("groups-2", (2, 8, 9, 9), (12, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    ("depthwise", (2, 16, 15, 15), (16, 1, 3, 3), dict(group=16, pads=[1, 1, 1, 1])),
    ("depthwise-mult2-s2", (1, 8, 16, 16), (16, 1, 5, 5), dict(group=8, strides=[2, 2], pads=[2, 2, 2, 2])),
    ("dilation-2", (1, 4, 17, 19), (6, 4, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    ("stride-2-odd", (3, 5, 11, 9), (7, 5, 3, 2), dict(strides=[2, 3])),
    ("same-upper-odd-kernel", (1, 4, 10, 10), (4, 4, 3, 3), dict(auto_pad="SAME_UPPER")),
    ("same-lower-even-kernel", (1, 4, 9, 9), (4, 4, 4, 4), dict(auto_pad="SAME_LOWER")),
    ("valid", (1, 4, 9, 9), (4, 4, 3, 3), dict(auto_pad="VALID")),
    ("asymmetric-pads", (1, 4, 9, 9), (4, 4, 3, 3), dict(pads=[0, 1, 2, 1])),
    ("1-D", (2, 6, 31), (8, 6, 5), dict(pads=[2, 2], strides=[2])),
]


@pytest.mark.parametrize("compiled_plan", ["0", "1"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_strict_float32(genv, case, compiled_plan):
    _, xs, ws, attrs = case
    if compiled_plan == "1" and len(xs) != 4:
        pytest.skip("compiled plans run 2-D convolutions only (lower_conv.py); 1-D runs per node")
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    model = model_of(xs, ws, relu=True, **attrs)
    from plugin_cuda.device import cudnn_conv
    from plugin_cuda.plan import cudnn_step

    cudnn_conv.clear_setups()
    floor, cudnn_step.CUDNN_MIN_MACS = cudnn_step.CUDNN_MIN_MACS, 0  # every plan conv on cuDNN here
    try:
        got = run_ephost(genv, model, {"X": x}, use_tf32=0, compiled_plan=compiled_plan)
    finally:
        cudnn_step.CUDNN_MIN_MACS = floor
    assert_close(got, reference(model, {"X": x}), 2e-4)
    # cuDNN ran it (a setup was made), except where the pads differ: then the plugin's own kernels.
    assert used_cudnn("forward") == (case[0] not in ("same-lower-even-kernel", "asymmetric-pads"))


def test_plan_folds_residual_add_and_relu(genv):
    from plugin_cuda.plan import cudnn_step

    xs, ws = (2, 16, 12, 12), (16, 16, 3, 3)
    rng = np.random.default_rng(3)
    feeds = {"X": rng.standard_normal(xs).astype(np.float32), "R": rng.standard_normal(xs).astype(np.float32)}
    model = model_of(xs, ws, relu=True, residual=xs, pads=[1, 1, 1, 1])
    floor, cudnn_step.CUDNN_MIN_MACS = cudnn_step.CUDNN_MIN_MACS, 0
    try:
        got = run_ephost(genv, model, feeds, use_tf32=0)
    finally:
        cudnn_step.CUDNN_MIN_MACS = floor
    assert_close(got, reference(model, feeds), 2e-4)


@pytest.mark.parametrize("search", ["HEURISTIC", "EXHAUSTIVE", "DEFAULT"])
def test_algo_searches_agree_with_reference(genv, search):
    xs, ws = (4, 32, 28, 28), (64, 32, 3, 3)
    x = np.random.default_rng(4).standard_normal(xs).astype(np.float32)
    model = model_of(xs, ws, pads=[1, 1, 1, 1])
    from plugin_cuda.device import cudnn_conv

    cudnn_conv.clear_setups()
    got = run_ephost(genv, model, {"X": x}, use_tf32=0, compiled_plan=0, cudnn_conv_algo_search=search)
    assert_close(got, reference(model, {"X": x}), 2e-4)
    assert [key[4] for key in cudnn_conv._setups] == [search]


def test_tf32_and_float16(genv):
    xs, ws = (4, 64, 28, 28), (64, 64, 3, 3)
    x = np.random.default_rng(5).standard_normal(xs).astype(np.float32)
    model = model_of(xs, ws, pads=[1, 1, 1, 1])
    want = reference(model, {"X": x})
    assert_close(run_ephost(genv, model, {"X": x}, use_tf32=1, compiled_plan=0), want, 2e-2)
    assert_close(run_ephost(genv, model, {"X": x}, use_tf32=1), want, 2e-2)
    half = model_of(xs, ws, dtype=np.float16, pads=[1, 1, 1, 1])
    xh = x.astype(np.float16)
    want16 = reference(model_of(xs, ws, pads=[1, 1, 1, 1]), {"X": xh.astype(np.float32)})
    from host.runtime.session import InferenceSession

    sess = InferenceSession(half, providers=[(CUDA, {})], env=genv)
    assert sess.node_assignment()  # float16 Conv: per node (plans are float32)
    assert_close(sess.run(None, {"X": xh})[0], want16, 2e-2)
    sess.close()


TRANSPOSE_CASES = [
    ("s2-pad1-outpad1", (2, 16, 9, 9), (16, 8, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    ("s1", (1, 4, 7, 8), (4, 6, 3, 3), {}),
    ("groups-2-dil2", (1, 8, 6, 6), (8, 3, 3, 3), dict(group=2, dilations=[2, 2], pads=[1, 1, 1, 1])),
    ("asymmetric-pads", (1, 4, 5, 5), (4, 4, 3, 3), dict(strides=[2, 2], pads=[0, 1, 2, 0])),
    ("output-shape", (1, 4, 5, 5), (4, 4, 3, 3), dict(strides=[2, 2], output_shape=[10, 11])),
    ("same-upper", (1, 4, 5, 6), (4, 2, 4, 4), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    ("same-lower", (1, 4, 5, 6), (4, 2, 3, 3), dict(strides=[3, 2], auto_pad="SAME_LOWER")),
    ("depthwise-upsample", (2, 6, 8, 8), (6, 1, 2, 2), dict(group=6, strides=[2, 2])),
    ("1-D", (2, 4, 9), (4, 5, 4), dict(strides=[2], pads=[1, 2])),
    ("3-D", (1, 2, 4, 5, 3), (2, 3, 3, 3, 3), dict(strides=[2, 1, 2], pads=[1, 1, 0, 1, 1, 0])),
]


@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=[c[0] for c in TRANSPOSE_CASES])
def test_conv_transpose_strict_float32(genv, case):
    _, xs, ws, attrs = case
    from plugin_cuda.device import cudnn_conv

    x = np.random.default_rng(6).standard_normal(xs).astype(np.float32)
    model = model_of(xs, ws, op="ConvTranspose", **attrs)
    cudnn_conv.clear_setups()
    got = run_ephost(genv, model, {"X": x}, use_tf32=0, compiled_plan=0)
    assert_close(got, reference(model, {"X": x}), 2e-4)
    assert used_cudnn("backward_data")


@pytest.mark.parametrize("compiled_plan", ["0", "1"])
def test_capture_and_replay(cp, genv, compiled_plan):
    from host.runtime.session import InferenceSession
    from plugin_cuda.plan import cudnn_step

    xs, ws = (2, 16, 20, 20), (32, 16, 3, 3)
    model = model_of(xs, ws, relu=True, pads=[1, 1, 1, 1])
    floor, cudnn_step.CUDNN_MIN_MACS = cudnn_step.CUDNN_MIN_MACS, 0
    try:
        sess = InferenceSession(model, providers=[(CUDA, {"use_tf32": "0", "enable_cuda_graph": "1",
                                                         "compiled_plan": compiled_plan})], env=genv)
        binding = sess.io_binding()
        xd = cp.zeros(xs, np.float32)
        yd = cp.zeros((2, 32, 20, 20), np.float32)
        binding.bind_input("X", xd)
        binding.bind_output("Y", yd)
        for k in range(4):  # warm-up runs, the capture, then replays that must read each new input
            x = np.random.default_rng(10 + k).standard_normal(xs).astype(np.float32)
            xd.set(x)
            cp.cuda.Device().synchronize()
            sess.run_with_iobinding(binding)
            assert_close(cp.asnumpy(yd), reference(model, {"X": x}), 2e-4)
        sess.close()
    finally:
        cudnn_step.CUDNN_MIN_MACS = floor


def test_without_cudnn_the_own_kernels_run_and_warn_once(genv, monkeypatch):
    from plugin_cuda.device import cudnn

    xs, ws = (2, 8, 10, 10), (8, 8, 3, 3)
    x = np.random.default_rng(7).standard_normal(xs).astype(np.float32)
    model = model_of(xs, ws, pads=[1, 1, 1, 1])
    from plugin_cuda.device import cudnn_conv

    saved = cudnn._lib, cudnn._lib_path
    cudnn.reset_for_tests()
    cudnn_conv.clear_setups()
    monkeypatch.setattr(cudnn, "candidates", lambda tried: ["/nonexistent/libcudnn.so.9"])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run_ephost(genv, model, {"X": x}, use_tf32=0, compiled_plan=0)
            again = run_ephost(genv, model, {"X": x}, use_tf32=0, compiled_plan=0)
        texts = [str(w.message) for w in caught if "cuDNN" in str(w.message)]
        assert len(texts) == 1, texts
        assert texts[0].startswith("CUDA plugin: convolutions run on the plugin's own kernels: cannot load cuDNN 9")
        assert "/nonexistent/libcudnn.so.9" in texts[0]
        want = reference(model, {"X": x})
        assert_close(got, want, 1e-3)
        assert not used_cudnn("forward")
        np.testing.assert_array_equal(got, again)
        # ConvTranspose is not claimed without cuDNN: the CPU EP runs it.
        from host.runtime.session import InferenceSession

        tmodel = model_of((1, 4, 5, 5), (4, 4, 3, 3), op="ConvTranspose", strides=[2, 2])
        sess = InferenceSession(tmodel, providers=[(CUDA, {})], env=genv)
        assert CUDA not in set(sess.node_assignment().values())
        sess.close()
    finally:
        cudnn.reset_for_tests()
        cudnn._lib, cudnn._lib_path = saved
