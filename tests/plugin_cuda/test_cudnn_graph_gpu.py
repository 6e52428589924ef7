"""Plan convolutions through cuDNN's graph API (device/cudnn_graph.py) against onnxruntime CPU: each
epilogue (none, bias, bias + ReLU, bias + residual + ReLU) in strict float32, float16 and bfloat16,
grouped and strided geometries, the exhaustive search, the numerical-note filter of strict float32,
an unaligned address, the plan step (eager, capture and replay) and the legacy switch.

Tolerances as test_cudnn_gpu.py: strict float32 2e-4 of the reference's largest magnitude; half
types against the float32 reference on the same rounded inputs, 2e-2 (float16) and 6e-2 (bfloat16:
an 8-bit mantissa on the output).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.plugin_cuda.test_cudnn_gpu import assert_close, model_of, reference

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"

GEOMETRIES = [  # (id, x shape, w shape, pads, strides, group)
    ("3x3", (2, 16, 12, 12), (32, 16, 3, 3), (1, 1), (1, 1), 1),
    ("1x1-s2", (2, 64, 14, 14), (32, 64, 1, 1), (0, 0), (2, 2), 1),
    ("groups-4", (2, 32, 10, 10), (32, 8, 3, 3), (1, 1), (1, 1), 4),
]
EPILOGUES = {"none": (False, False, False), "bias": (True, False, False), "bias-relu": (True, False, True),
             "bias-residual-relu": (True, True, True)}
DTYPES = {"float32": (np.float32, 2e-4), "float16": (np.float16, 2e-2), "bfloat16": ("bfloat16", 6e-2)}


def _dtype(name):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _out_shape(xs, ws, pads, strides):
    return (xs[0], ws[0]) + tuple((i + 2 * p - k) // s + 1 for i, p, k, s in zip(xs[2:], pads, ws[2:], strides))


def _reference(xs, ws, ys, pads, strides, group, ep, arrays):
    """onnxruntime's float32 result for the same (rounded) operands."""
    x, w, b, z = (a.astype(np.float32) if a is not None else None for a in arrays)
    model = model_of(xs, ws, bias=ep.bias, relu=ep.relu, residual=ys if ep.residual else False,
                     pads=list(pads) * 2, strides=list(strides), group=group)
    from onnx import numpy_helper

    for init in model.graph.initializer:  # the test's own (rounded) weights and bias
        init.CopyFrom(numpy_helper.from_array(w if init.name == "W" else b, init.name))
    feeds = {"X": x}
    if ep.residual:
        feeds["R"] = z
    return reference(model, feeds)


def _run_graph(cp, handle, geo, dtype, ep, arrays):
    """Run a new graph on the operands; device buffers are raw bytes (CuPy has no bfloat16)."""
    from plugin_cuda.device import cudnn_graph

    graph = cudnn_graph.make(handle, geo, dtype, ep)
    dev = [cp.asarray(np.ascontiguousarray(a).view(np.uint8)) for a in arrays]
    y = cp.zeros(int(np.prod(geo.y_shape)) * np.dtype(dtype).itemsize, np.uint8)
    ws = cp.empty(max(graph.workspace_bytes, 1), np.uint8)
    ptrs = [int(dev[0].data.ptr), int(dev[1].data.ptr), int(y.data.ptr)]
    ptrs += [int(dev[2].data.ptr)] if ep.bias else []
    ptrs += [int(dev[3].data.ptr)] if ep.residual else []
    pack = graph.pack(ptrs, int(ws.data.ptr))
    assert graph.execute(handle.raw, pack) == 0
    cp.cuda.Device().synchronize()
    return graph, cp.asnumpy(y).view(dtype).reshape(geo.y_shape)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("case", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
def test_graph_against_onnxruntime(cp, case, epilogue, dtype_name):
    from plugin_cuda.device import cudnn, cudnn_conv, cudnn_graph

    _, xs, ws, pads, strides, group = case
    dtype, tol = _dtype(dtype_name), DTYPES[dtype_name][1]
    ep = cudnn_graph.Epilogue(*EPILOGUES[epilogue])
    ys = _out_shape(xs, ws, pads, strides)
    geo = cudnn_conv.forward_geometry(xs, ws, ys, group, pads, pads, strides, (1, 1))
    rng = np.random.default_rng(11)
    arrays = [(rng.standard_normal(s) / (np.sqrt(np.prod(ws[1:])) if s == ws else 1)).astype(dtype)
              for s in (xs, ws, (ws[0],), ys)]
    handle = cudnn.CudnnHandle(0, use_tf32=False)
    try:
        graph, got = _run_graph(cp, handle, geo, dtype, ep, arrays)
    except cudnn.CudnnError as e:
        # No engine for this tail: the step then runs the convolution alone through the graph API,
        # which must exist for every case, and the tail as legacy calls (test_plan_step_* below).
        assert ep != cudnn_graph.Epilogue(), e
        assert "no engine" in str(e)
        graph, got = _run_graph(cp, handle, geo, dtype, cudnn_graph.Epilogue(), arrays)
        ep = cudnn_graph.Epilogue()
    finally:
        handle.close()
    want = _reference(xs, ws, ys, pads, strides, group, ep, arrays)
    assert_close(got, want, tol)
    if dtype_name == "float32":  # strict float32: no TF32 or other down-converting engine was taken
        assert not graph.notes & {cudnn_graph.NOTE_TENSOR_CORE, cudnn_graph.NOTE_DOWN_CONVERT_INPUTS}


def test_exhaustive_search_times_candidates_and_stays_correct(cp):
    from plugin_cuda.device import cudnn, cudnn_conv, cudnn_graph

    xs, ws, pads = (4, 32, 28, 28), (64, 32, 3, 3), (1, 1)
    ys = _out_shape(xs, ws, pads, (1, 1))
    geo = cudnn_conv.forward_geometry(xs, ws, ys, 1, pads, pads, (1, 1), (1, 1))
    rng = np.random.default_rng(12)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in (xs, ws, (64,), ys)]
    handle = cudnn.CudnnHandle(0, use_tf32=False, algo_search="EXHAUSTIVE")
    try:
        _, got = _run_graph(cp, handle, geo, np.float32, cudnn_graph.Epilogue(True), arrays)
    finally:
        handle.close()
    assert_close(got, _reference(xs, ws, ys, pads, (1, 1), 1, cudnn_graph.Epilogue(True), arrays), 2e-4)


def test_an_unaligned_address_gets_no_pack(cp):
    from plugin_cuda.device import cudnn, cudnn_conv, cudnn_graph

    geo = cudnn_conv.forward_geometry((1, 8, 8, 8), (8, 8, 3, 3), (1, 8, 8, 8), 1, (1, 1), (1, 1), (1, 1), (1, 1))
    handle = cudnn.CudnnHandle(0, use_tf32=False)
    try:
        graph = cudnn_graph.make(handle, geo, np.float32, cudnn_graph.Epilogue())
        base = cp.zeros(4096, np.float32)
        p = int(base.data.ptr)
        assert graph.pack([p, p + 1024, p + 2048], 0) is not None
        assert graph.pack([p + 4, p + 1024, p + 2048], 0) is None  # 4-byte aligned only: the legacy calls run
    finally:
        handle.close()


def _resnet_block():
    xs, ws = (2, 32, 16, 16), (32, 32, 3, 3)
    return xs, model_of(xs, ws, relu=True, residual=xs, pads=[1, 1, 1, 1])


def _session(genv, model, **options):
    from host.runtime.session import InferenceSession

    return InferenceSession(model, providers=[(CUDA, {k: str(v) for k, v in options.items()})], env=genv)


@pytest.mark.parametrize("graph_api", ["1", "0"])
def test_plan_step_eager_capture_and_replay(cp, genv, monkeypatch, graph_api):
    """A residual block's folded convolution in a compiled plan, eager then captured and replayed with
    new inputs each time; EPHOST_CUDNN_GRAPH=0 runs the legacy calls (no graph built)."""
    from plugin_cuda.device import cudnn_graph
    from plugin_cuda.plan import cudnn_step

    monkeypatch.setenv("EPHOST_CUDNN_GRAPH", graph_api)
    monkeypatch.setattr(cudnn_step, "CUDNN_MIN_MACS", 0)
    cudnn_graph.clear()
    built, packs = cudnn_graph.stats["built"] + cudnn_graph.stats["refused"], cudnn_graph.stats["packs"]
    xs, model = _resnet_block()
    for graph_mode in ("0", "1"):
        sess = _session(genv, model, use_tf32=0, enable_cuda_graph=graph_mode)
        binding = sess.io_binding()
        xd, rd, yd = cp.zeros(xs, np.float32), cp.zeros(xs, np.float32), cp.zeros(xs, np.float32)
        binding.bind_input("X", xd)
        binding.bind_input("R", rd)
        binding.bind_output("Y", yd)
        for k in range(4):
            rng = np.random.default_rng(20 + k)
            feeds = {"X": rng.standard_normal(xs).astype(np.float32), "R": rng.standard_normal(xs).astype(np.float32)}
            xd.set(feeds["X"])
            rd.set(feeds["R"])
            cp.cuda.Device().synchronize()
            sess.run_with_iobinding(binding)
            assert_close(cp.asnumpy(yd), reference(model, feeds), 2e-4)
        sess.close()
    made = cudnn_graph.stats["built"] + cudnn_graph.stats["refused"] - built
    if graph_api == "1":
        assert made >= 1 and cudnn_graph.stats["packs"] > packs
    else:
        assert made == 0 and cudnn_graph.stats["packs"] == packs


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_plan_step_half_types(cp, genv, monkeypatch, dtype_name):
    """float16 / bfloat16 residual blocks (ephost convert) run their plan convolution through the graph."""
    from host.precision import convert_precision
    from plugin_cuda.device import cudnn_graph
    from plugin_cuda.plan import cudnn_step

    monkeypatch.setattr(cudnn_step, "CUDNN_MIN_MACS", 0)
    cudnn_graph.clear()
    xs, model = _resnet_block()
    half = convert_precision(model, "fp16" if dtype_name == "float16" else "bf16", keep_io_types=True)
    rng = np.random.default_rng(30)
    feeds = {"X": rng.standard_normal(xs).astype(np.float32), "R": rng.standard_normal(xs).astype(np.float32)}
    built = cudnn_graph.stats["built"]
    sess = _session(genv, half)
    got = sess.run(None, feeds)[0]
    sess.close()
    assert cudnn_graph.stats["built"] > built
    assert_close(np.asarray(got, np.float32), reference(model, feeds), 2e-2 if dtype_name == "float16" else 6e-2)
