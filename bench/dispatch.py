"""Per-node dispatch cost: a kernel through the full ABI path versus the same kernel called directly.

A chain of 1,000 tiny Relu nodes (float32[4]) runs three ways:
  A  InferenceSession with ExampleEP claiming every node: each node goes host -> Compute (cffi
     callback into the plugin) -> KernelContext_GetIO -> KernelContext_GetOutput -> the plugin's
     allocator, then back;
  B  the plugin's own NumPy Relu called 1,000 times in a Python loop (no session, no ABI);
  C  InferenceSession on the built-in CPU EP (no ABI, but the host's plan and kernel wrapper).
The ABI overhead per node is (A - B) / 1000, from the median run times.

    python bench/dispatch.py            # table
    python bench/dispatch.py --json     # the same numbers as JSON
    python bench/dispatch.py --profile  # plus the top 15 functions of path A by tottime
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from host.cli.benchutil import bench_session  # noqa: E402

EP_NAME = "ExampleEP"


def relu_chain(nodes: int = 1000, size: int = 4, opset: int = 17):
    """`nodes` Relu nodes in a row on a float32[size] tensor."""
    names = ["x"] + [f"r{i}" for i in range(nodes - 1)] + ["y"]
    graph = helper.make_graph(
        [helper.make_node("Relu", [names[i]], [names[i + 1]], name=f"relu{i}") for i in range(nodes)],
        "relu_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])],
    )
    ops = [helper.make_opsetid("", opset)]
    return helper.make_model(graph, opset_imports=ops, ir_version=helper.find_min_ir_version_for(ops))


def plugin_kernel():
    """The NumPy function ExampleEP's Relu kernel calls (imported, so B times exactly that code)."""
    from tests.plugins.example_ep import _OPS

    return _OPS["Relu"]


def example_plugin(path: str | None) -> Path:
    """The example plugin at ABI v5: `path` if given, else build/lib's, built when missing."""
    if path:
        return Path(path)
    import build

    lib = build.library_path("example", 5)
    return lib if lib.exists() else build.build_python_plugin("example", 5)


def _direct(kernel, x: np.ndarray, nodes: int):
    def run():
        y = x
        for _ in range(nodes):
            y = kernel(y)
        return y

    return run


def _strip(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "samples_us"}


def measure(nodes: int = 1000, size: int = 4, warmup: int = 5, iters: int = 50, plugin: str | None = None,
            profile_runs: int = 0) -> dict:
    """Times paths A, B and C; returns their stats, per-node costs and (optionally) a profile."""
    from host.plugins.environment import Environment
    from host.runtime.session import InferenceSession

    model = relu_chain(nodes, size)
    x = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    feeds = {"x": x}
    kernel = plugin_kernel()
    with Environment() as env:
        env.register_plugin("example", example_plugin(plugin))
        with InferenceSession(model, providers=[(EP_NAME, {"ops": "Relu"})], env=env) as sa, \
                InferenceSession(model, providers=[], env=env) as sc:
            on_plugin = sum(ep == EP_NAME for ep in sa.node_assignment().values())
            if on_plugin != nodes:
                raise RuntimeError(f"{EP_NAME} claimed {on_plugin} of {nodes} nodes; expected all")
            expected = kernel(x)
            for s in (sa, sc):
                np.testing.assert_array_equal(s.run(None, feeds)[0], expected)

            def run_a():
                sa.run(None, feeds)

            def run_c():
                sc.run(None, feeds)

            stats = {
                "A": bench_session(run_a, warmup, iters),
                "B": bench_session(_direct(kernel, x, nodes), warmup, iters),
                "C": bench_session(run_c, warmup, iters),
            }
            profile = _profile(run_a, profile_runs) if profile_runs else None
    per_node = {k: s["p50_us"] / nodes for k, s in stats.items()}
    return {
        "nodes": nodes, "shape": [size], "dtype": "float32", "warmup": warmup, "iters": iters,
        "paths": {k: _strip(s) for k, s in stats.items()},
        "us_per_node": per_node,
        "abi_overhead_us_per_node": (stats["A"]["p50_us"] - stats["B"]["p50_us"]) / nodes,
        "host_overhead_us_per_node": (stats["C"]["p50_us"] - stats["B"]["p50_us"]) / nodes,
        "profile": profile,
    }


def _profile(run, runs: int, top: int = 15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        run()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


LABELS = {
    "A": f"{EP_NAME} through the ABI (session.run)",
    "B": "NumPy kernel called directly (Python loop)",
    "C": "built-in CPU EP (session.run)",
}


def format_table(r: dict) -> str:
    n = r["nodes"]
    lines = [
        f"dispatch cost: chain of {n} Relu nodes on {r['dtype']}{r['shape']} "
        f"(warm-up {r['warmup']}, {r['iters']} timed runs; per-node figures from the median run)",
        "",
        f"{'path':<3} {'what':<44} {'p50 us/run':>11} {'mean us/run':>12} {'us/node':>8}",
    ]
    for key, label in LABELS.items():
        s = r["paths"][key]
        lines.append(f"{key:<3} {label:<44} {s['p50_us']:>11.1f} {s['mean_us']:>12.1f} {r['us_per_node'][key]:>8.2f}")
    lines += [
        "",
        f"ABI overhead per node   (A-B)/{n}: {r['abi_overhead_us_per_node']:.2f} us",
        f"host overhead per node  (C-B)/{n}: {r['host_overhead_us_per_node']:.2f} us",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--size", type=int, default=4, help="elements in the float32 tensor")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--plugin", help="example plugin library (default: build/lib/libephost_example_v5.so)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--profile", action="store_true", help="cProfile path A and print the top 15 by tottime")
    p.add_argument("--profile-runs", type=int, default=20, help="runs of path A under the profiler")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.size < 1:
        p.error("--nodes and --size must be positive")
    r = measure(args.nodes, args.size, args.warmup, args.iters, args.plugin,
                args.profile_runs if args.profile else 0)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(format_table(r))
        if r["profile"]:
            print(f"\ncProfile of path A, {args.profile_runs} runs, top 15 by tottime:")
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
