"""Convolutions on the CUDA EP: cuDNN against the plugin's own kernels, and ResNet-50 against PyTorch.

    python bench/conv_gpu.py check          # cuDNN version, one Conv and one ConvTranspose vs onnxruntime CPU
    python bench/conv_gpu.py layers         # per-layer: cuDNN vs the direct kernels (per-node and plan)
    python bench/conv_gpu.py resnet50 [--batch 8] [--iters 50] [--graph on|off|both]
    python bench/conv_gpu.py calls          # host and GPU time per call: legacy API vs graph-API plans

`resnet50`: torchvision ResNet-50 (random weights, eval), exported to ONNX; ephost eager and CUDA-graph
replay (IOBinding) against torch eager and torch.cuda.CUDAGraph, TF32 off then on, on both sides.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

CUDA = "CUDAExecutionProvider"


def _env():
    import build
    import host

    env = host.Environment()
    env.register_plugin("cuda", str(build.build_python_plugin("cuda", max(build.PYTHON_PLUGINS["cuda"].versions))))
    return env


def conv_model(x_shape, w_shape, op="Conv", bias=True, relu=False, seed=0, **attrs):
    """A one-node Conv / ConvTranspose model (weights as initializers), optionally followed by Relu."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(w_shape).astype(np.float32) / np.sqrt(np.prod(w_shape[1:]))
    m = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
    inits = [numpy_helper.from_array(w, "W")]
    inputs = ["X", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "B"))
        inputs.append("B")
    nodes = [helper.make_node(op, inputs, ["C" if relu else "Y"], **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["C"], ["Y"]))
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _median_ms(fn, iters=30, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e3


def _bound(sess, x, out_shape):
    import cupy as cp

    binding = sess.io_binding()
    xd = cp.asarray(x)
    yd = cp.zeros(out_shape, np.float32)
    binding.bind_input("X", xd)
    binding.bind_output("Y", yd)
    return binding, (xd, yd)


def compare(env, model, x, options, label: str, iters=30) -> tuple:
    """(max abs error vs onnxruntime CPU, median ms with IOBinding) of one model under `options`."""
    import cupy as cp
    import onnxruntime

    from host.runtime.session import InferenceSession

    ref = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = ref.run(None, {"X": x})[0]
    sess = InferenceSession(model, providers=[(CUDA, options)], env=env)
    binding, keep = _bound(sess, x, want.shape)
    sess.run_with_iobinding(binding)
    err = float(np.abs(cp.asnumpy(keep[1]) - want).max())
    ms = _median_ms(lambda: sess.run_with_iobinding(binding), iters)
    sess.close()
    print(f"  {label:<44} max abs err {err:.2e}  (ref max {np.abs(want).max():.2f})  {ms:.3f} ms", flush=True)
    return err, ms


def check(env) -> None:
    from plugin_cuda.device import cudnn

    reason = cudnn.availability()
    print("cuDNN:", cudnn.version() if reason is None else f"NOT AVAILABLE: {reason}", flush=True)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64, 56, 56)).astype(np.float32)
    model = conv_model(x.shape, (64, 64, 3, 3), pads=[1, 1, 1, 1])
    for opts in ({"use_tf32": "0", "compiled_plan": "0"}, {"use_tf32": "0"}, {"use_tf32": "1"},
                 {"use_tf32": "0", "cudnn_conv_algo_search": "EXHAUSTIVE"}):
        compare(env, model, x, opts, f"Conv 8x64x56x56 k3 {opts}")
    xt = rng.standard_normal((2, 16, 9, 9)).astype(np.float32)
    model = conv_model(xt.shape, (16, 8, 3, 3), op="ConvTranspose", strides=[2, 2], pads=[1, 1, 1, 1],
                       output_padding=[1, 1])
    compare(env, model, xt, {"use_tf32": "0"}, "ConvTranspose 2x16x9x9 s2 op1")


LAYERS = [  # (label, x shape, w shape, attrs)
    ("resnet stem 7x7 s2", (8, 3, 224, 224), (64, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),
    ("3x3 64 @56", (8, 64, 56, 56), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("1x1 64->256 @56", (8, 64, 56, 56), (256, 64, 1, 1), {}),
    ("3x3 256 @14", (8, 256, 14, 14), (256, 256, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("1x1 2048->512 @7", (8, 2048, 7, 7), (512, 2048, 1, 1), {}),
    ("depthwise 3x3 96 @56", (8, 96, 56, 56), (96, 1, 3, 3), dict(pads=[1, 1, 1, 1], group=96)),
    ("depthwise 3x3 576 @7 b1", (1, 576, 7, 7), (576, 1, 3, 3), dict(pads=[1, 1, 1, 1], group=576)),
    ("tiny 3x3 8 @8 b1", (1, 8, 8, 8), (8, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("small 3x3 16 @16 b1", (1, 16, 16, 16), (16, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("mid 3x3 32 @32 b1", (1, 32, 32, 32), (32, 32, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("1x1 16->64 @112 b1", (1, 16, 112, 112), (64, 16, 1, 1), {}),
    ("3x3 64 @28 b1", (1, 64, 28, 28), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("3x3 64 @56 b1", (1, 64, 56, 56), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
]


def layers(env, names=None) -> None:
    """Per-node and plan timings of each layer with cuDNN on and off (TF32 off)."""
    from plugin_cuda.device import cudnn
    from plugin_cuda.plan import cudnn_step

    rng = np.random.default_rng(2)
    default_floor = cudnn_step.CUDNN_MIN_MACS
    for label, xs, ws, attrs in LAYERS:
        if names and label not in names:
            continue
        x = rng.standard_normal(xs).astype(np.float32)
        model = conv_model(xs, ws, relu=True, **attrs)
        print(label, flush=True)
        for mode, opts in (("per-node", {"compiled_plan": "0"}), ("plan", {})):
            for use, floor in (("cudnn", 0), ("own", 1 << 62)):
                cudnn_step.CUDNN_MIN_MACS = floor
                saved = cudnn._lib
                if use == "own" and mode == "per-node":
                    cudnn.reset_for_tests()
                    cudnn._load_error = "disabled by bench/conv_gpu.py"
                    cudnn._warned = True
                try:
                    compare(env, model, x, {"use_tf32": "0", **opts}, f"{mode} {use}")
                finally:
                    if use == "own" and mode == "per-node":
                        cudnn.reset_for_tests()
                        cudnn._lib = saved
    cudnn_step.CUDNN_MIN_MACS = default_floor


def _resnet_onnx(batch: int):
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval().cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    buf = io.BytesIO()
    try:  # the TorchScript exporter folds BatchNormalization into the convolutions
        torch.onnx.export(model, (x,), buf, input_names=["X"], output_names=["Y"], opset_version=17, dynamo=False)
    except Exception as exc:  # noqa: BLE001 - a torch without it: the dynamo exporter
        print(f"TorchScript export failed ({type(exc).__name__}: {exc}); dynamo export", flush=True)
        buf = io.BytesIO()
        torch.onnx.export(model, (x,), buf, input_names=["X"], output_names=["Y"], opset_version=18, dynamo=True)
    data = buf.getvalue()
    import onnx

    ops = {}
    for node in onnx.load_from_string(data).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    print("exported ops:", ops, flush=True)
    return model, x, data


def resnet50(env, batch: int, iters: int) -> None:
    import cupy as cp
    import torch

    from bench.torch_models import _timed, _torch_graph
    from host.runtime.session import InferenceSession

    model, x, onnx_bytes = _resnet_onnx(batch)
    xn = x.cpu().numpy()
    print(f"ResNet-50 batch {batch} at 224, {torch.cuda.get_device_name()}; median ms over {iters} runs", flush=True)
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        with torch.inference_mode():
            ref = model(x).float().cpu().numpy()

        def torch_eager():
            with torch.inference_mode():
                model(x)
            torch.cuda.synchronize()
        row = {"torch eager": _timed(torch_eager, iters, 5) / 1e3}
        replay, _ = _torch_graph(model, (x,))
        row["torch graph"] = _timed(replay, iters, 5) / 1e3
        for mode, extra in (("ephost eager", {}), ("ephost replay", {"enable_cuda_graph": "1"})):
            sess = InferenceSession(onnx_bytes, providers=[(CUDA, {"use_tf32": "1" if tf32 else "0", **extra})],
                                    env=env)
            binding, keep = _bound(sess, xn, ref.shape)
            cp.cuda.Device().synchronize()
            sess.run_with_iobinding(binding)
            err = float(np.abs(cp.asnumpy(keep[1]) - ref).max())
            row[mode] = _timed(lambda s=sess, b=binding: s.run_with_iobinding(b), iters, 5) / 1e3
            row[mode + " max abs vs torch"] = err
            sess.close()
        print(f"TF32 {'on ' if tf32 else 'off'}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
        print(f"  replay / torch graph = {row['ephost replay'] / row['torch graph']:.2f}x, "
              f"eager / torch eager = {row['ephost eager'] / row['torch eager']:.2f}x", flush=True)


CALL_SHAPES = [  # ResNet-50 batch 8 layers: (x shape, w shape, pads, strides)
    ((8, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1)),
    ((8, 256, 56, 56), (64, 256, 1, 1), (0, 0), (1, 1)),
    ((8, 512, 28, 28), (128, 512, 1, 1), (0, 0), (1, 1)),
    ((8, 256, 14, 14), (256, 256, 3, 3), (1, 1), (1, 1)),
    ((8, 3, 224, 224), (64, 3, 7, 7), (3, 3), (2, 2)),
]


def _host_and_gpu_us(launch, n=50) -> tuple:
    """(host µs per call, GPU µs per call) of `n` calls on the null stream."""
    import cupy as cp

    launch()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        launch()
    host = (time.perf_counter() - t0) / n * 1e6
    end.record()
    end.synchronize()
    return host, cp.cuda.get_elapsed_time(start, end) * 1e3 / n


def _call_row(handle, name: str, dtype, shape, iters: int) -> str:
    import cupy as cp

    from plugin_cuda.device import cudnn, cudnn_conv, cudnn_graph

    xs, ws, pads, strides = shape
    ys = (xs[0], ws[0]) + tuple((i + 2 * p - k) // s + 1 for i, p, k, s in zip(xs[2:], pads, ws[2:], strides))
    geo = cudnn_conv.forward_geometry(xs, ws, ys, 1, pads, pads, strides, (1, 1))
    rng = np.random.default_rng(0)
    # Raw bytes on the device (CuPy has no bfloat16); results are read back through NumPy views.
    x, w, z, b = (cp.asarray(rng.standard_normal(s).astype(dtype).view(np.uint8)) for s in (xs, ws, ys, (ws[0],)))
    y_legacy, y_graph = (cp.empty(math.prod(ys) * np.dtype(dtype).itemsize, np.uint8) for _ in range(2))
    setup = cudnn_conv.setup(handle, "forward", geo, dtype)
    ws_mem = cp.empty(max(setup.workspace_bytes, 256 << 20), np.uint8)
    p = [int(a.data.ptr) for a in (x, w, y_legacy, b, z)]
    wsp = int(ws_mem.data.ptr)
    row = [f"{name:>13} x{xs} w{ws[2:]}"]
    host, gpu = _host_and_gpu_us(
        lambda: cudnn_conv.forward(handle, setup, p[0], p[1], p[2], wsp, bias=p[3], relu=True, z=p[4]), iters)
    row.append(f"legacy host {host:6.1f} gpu {gpu:6.1f} (fused {setup.fused_ok})")
    for label, ep in (("graph", cudnn_graph.Epilogue(True, True, True)), ("conv-only graph", cudnn_graph.Epilogue())):
        try:
            t0 = time.perf_counter()
            g = cudnn_graph.make(handle, geo, dtype, ep)
            built = (time.perf_counter() - t0) * 1e3
        except cudnn.CudnnError as e:
            row.append(f"{label}: refused ({str(e)[:60]})")
            continue
        ptrs = [int(y_graph.data.ptr) if i == 2 else p[i] for i in range(3)] + ([p[3], p[4]] if ep.bias else [])
        pack = g.pack(ptrs, wsp)
        host, gpu = _host_and_gpu_us(lambda g=g, pack=pack: g.execute(handle.raw, pack), iters)
        t0 = time.perf_counter()
        for _ in range(20):
            g.pack(ptrs, wsp)
        pack_us = (time.perf_counter() - t0) / 20 * 1e6
        diff = ""
        if ep.bias:
            cp.cuda.Device().synchronize()
            want, got = (cp.asnumpy(a).view(dtype).astype(np.float32) for a in (y_legacy, y_graph))
            diff = f" diff {float(np.abs(got - want).max()) / float(np.abs(want).max()):.1e}"
        row.append(f"{label} host {host:5.1f} gpu {gpu:6.1f} build {built:6.1f} ms pack {pack_us:4.1f} us{diff}")
    return " | ".join(row)


def calls(iters: int) -> None:
    """Per-call cost of one convolution (+ bias + residual + ReLU) through the legacy API and through a
    graph-API execution plan, with the build time of the plan and the two results' difference."""
    import cupy as cp
    import ml_dtypes

    from plugin_cuda.device import cudnn

    print(f"cuDNN {cudnn.version()['cudnn']}, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    for dtype, tf32 in ((np.float32, False), (np.float32, True), (np.float16, True), (ml_dtypes.bfloat16, True)):
        handle = cudnn.CudnnHandle(0, use_tf32=tf32)
        name = np.dtype(dtype).name + (" tf32" if tf32 and dtype == np.float32 else "")
        for shape in CALL_SHAPES:
            try:
                print(_call_row(handle, name, dtype, shape, iters), flush=True)
            except Exception as e:  # noqa: BLE001 - a bench row fails alone
                print(f"{name} {shape}: {type(e).__name__}: {e}", flush=True)
        handle.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("check", "layers", "resnet50", "calls"))
    parser.add_argument("--graph", choices=("on", "off", "both"), default="on",
                        help="resnet50: plan convolutions through the graph API, the legacy calls, or both")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layer", action="append")
    args = parser.parse_args(argv)
    env = _env()
    if args.what == "check":
        check(env)
    elif args.what == "layers":
        layers(env, args.layer)
    elif args.what == "calls":
        calls(args.iters)
    else:
        for graph in (("on", "off") if args.graph == "both" else (args.graph,)):
            os.environ["EPHOST_CUDNN_GRAPH"] = "1" if graph == "on" else "0"
            print(f"-- plan convolutions through the {'graph API' if graph == 'on' else 'legacy calls'}", flush=True)
            resnet50(env, args.batch, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
