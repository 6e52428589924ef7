"""Where loading a saved context model spends its time, on a machine without a GPU (issue 29).

    python -m bench.context_load_cpu [--layers 24] [--hidden 1024] [--profile 20]

Two parts, each with ~100 MB of float32 weights:

  host     a chain of MatMul -> Sigmoid -> Relu layers saved as a context model through the example
           plugin (tests/plugins/example_ep.py, fuse=1), then loaded: seconds of InferenceSession(...)
           for the plain model, the saving session and the context model, with the cProfile top of the
           last (what the host does that the context made unnecessary shows there);
  cuda     the CUDA plugin's pure-Python part of loading a ResNet-50-shaped graph (53 convolutions,
           25.6 M parameters) from its plan context: plan/saved.py's unpack, the graph section, then
           lowering, fusion and code generation (what a GPU adds: the NVRTC module load, constant
           upload, cuDNN/cuBLAS setup, is not here).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def chain(layers: int, hidden: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((hidden, hidden)) * 0.03).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Sigmoid", [f"m{i}"], [f"s{i}"]),
                  helper.make_node("Relu", [f"s{i}"], [f"r{i}"])]
        x = f"r{i}"
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8, hidden]) for n in ("x", x)]
    model = helper.make_model(helper.make_graph(nodes, "chain", io[:1], io[1:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def resnet50(batch: int = 8) -> onnx.ModelProto:
    """ResNet-50's convolutions (bottlenecks 3-4-6-3, BatchNormalization folded), pools and classifier."""
    rng = np.random.default_rng(0)
    nodes, inits, count = [], [], [0]

    def conv(x, cin, cout, k, stride=1, relu=True):
        count[0] += 1
        i = count[0]
        inits.extend([numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * 0.05).astype(np.float32), f"w{i}"),
                      numpy_helper.from_array(np.zeros(cout, np.float32), f"b{i}")])
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[k, k], strides=[stride] * 2,
                                      pads=[k // 2] * 4))
        if not relu:
            return f"c{i}"
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        return f"r{i}"

    x = conv("X", 3, 64, 7, 2)
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4))
    x, cin = "pool", 64
    for stage, (blocks, mid) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        for j in range(blocks):
            stride = 2 if j == 0 and stage > 0 else 1
            y = conv(conv(conv(x, cin, mid, 1), mid, mid, 3, stride), mid, mid * 4, 1, relu=False)
            skip = conv(x, cin, mid * 4, 1, stride, relu=False) if j == 0 else x
            nodes += [helper.make_node("Add", [y, skip], [f"{y}_add"]), helper.make_node("Relu", [f"{y}_add"], [f"{y}_out"])]
            x, cin = f"{y}_out", mid * 4
    inits += [numpy_helper.from_array((rng.standard_normal((1000, 2048)) * 0.02).astype(np.float32), "fc_w"),
              numpy_helper.from_array(np.zeros(1000, np.float32), "fc_b")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"]), helper.make_node("Flatten", ["gap"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["out"], transB=1)]
    graph = helper.make_graph(nodes, "resnet50", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, 3, 224, 224])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 1000])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def host_part(layers: int, hidden: int, rows: int, work: Path) -> None:
    import abi
    import build
    from host.plugins.environment import Environment
    from host.runtime.options import SessionOptions
    from host.runtime.session import InferenceSession

    path, ctx = work / "chain.onnx", work / "chain_ctx.onnx"
    onnx.save(chain(layers, hidden), str(path))
    env = Environment()
    env.register_plugin("example", str(build.build_python_plugin("example", abi.ABI_VERSION)))
    providers = [("ExampleEP", {"fuse": "1", "ops": "MatMul,Sigmoid,Relu"})]
    so = SessionOptions()
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_file_path", str(ctx))
    for what, model, opts in (("plain", path, None), ("saving", path, so), ("context", ctx, None)):
        profiler = cProfile.Profile() if what == "context" else None
        if profiler is not None:
            profiler.enable()
        session, seconds = _timed(lambda m=model, o=opts: InferenceSession(str(m), o, providers=providers, env=env))
        if profiler is not None:
            profiler.disable()
        first = " (the first session of the process: imports included)" if what == "plain" else ""
        print(f"host: {what} model, creation {seconds:.3f} s{first}, {session.fallbacks['context_loaded']} contexts loaded")
        session.close()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(rows)
    env.close()


def cuda_part() -> None:
    from abi.graph_spec import FusedGraph
    from plugin_cuda.plan import codegen, fuse, lower, saved
    from plugin_cuda.plan.onnx_spec import spec_from_onnx

    spec = spec_from_onnx(resnet50())
    blob = saved.pack(saved.SavedPlan.of(FusedGraph("resnet50", spec), cc="90"))
    plan, t_unpack = _timed(lambda: saved.unpack(blob))
    graph, t_graph = _timed(lambda: plan.fused_graph().graph)
    prog, t_lower = _timed(lambda: lower.lower(graph))
    steps, t_fuse = _timed(lambda: (fuse.build_steps(prog, tiled=True), fuse.build_steps(prog, tiled=False)))
    _, t_codegen = _timed(lambda: [codegen.generate(prog, s, "ep_k") for s in steps])
    print(f"cuda: ResNet-50 context of {len(blob) / 1e6:.1f} MB: unpack {t_unpack:.3f} s, graph section "
          f"{t_graph:.3f} s, lowering {t_lower:.3f} s, fusion {t_fuse:.3f} s, code generation {t_codegen:.3f} s "
          f"({len(steps[0])} steps)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--profile", type=int, default=20, help="cProfile rows of the context model's creation")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        host_part(args.layers, args.hidden, args.profile, Path(tmp))
    cuda_part()
    return 0


if __name__ == "__main__":
    sys.exit(main())
