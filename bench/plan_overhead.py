"""Plan overhead: the same kernels launched raw vs through a compiled plan, host time per kernel.

    python bench/plan_overhead.py [--iters 2000] [--json out.json]

For each model the plan is built once; then, in the same process and on the same stream:
  raw      a Python loop of `cuLaunchKernel(*prepacked)` over the plan's own prepacked launches
           (cffi, ABI mode): the floor for launching these kernels from Python;
  plan     Plan.run(stream, inputs, outputs): what a v6 Compute does after reading the frame;
  compute  PlanFunction.compute(state, frame) with a minimal frame object (pointer lists), i.e.
           the plugin's whole Compute body short of the ABI crossing.
Each sample times one call; the stream is synchronised between samples, outside the timing, so
the launch queue never fills. Overhead per kernel = (median(plan) - median(raw)) / kernels; the
goal is <= 1 µs. Models whose plans contain cuBLAS steps report them separately (cuBLAS calls are
not kernels we launch, and run in both loops). Without CuPy or a GPU it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL_US = 1.0


def _models():
    from host.cli import zoo

    return {
        "mlp-8x256": zoo.mlp(layers=8, hidden=256, batch=1),
        "mlp-8x1024": zoo.mlp(layers=8, hidden=1024, batch=1),
        "elementwise-32": _chain(32),
        "transformer-256": zoo.transformer_block(),
    }


def _chain(n: int):
    """n alternating Relu/Neg-on-Transpose layers: n kernels that fusion cannot merge (Transpose)."""
    from onnx import TensorProto, helper

    nodes, x = [], "input"
    for i in range(n):
        y = f"t{i}"
        nodes.append(helper.make_node("Transpose", [x], [y], name=f"transpose{i}", perm=[1, 0]))
        x = y
    nodes[-1].output[0] = "output"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("output", TensorProto.FLOAT, [64, 64])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _median_us(fn, iters: int, warmup: int, sync) -> float:
    for _ in range(warmup):
        fn()
        sync()
    samples = np.empty(iters, np.int64)
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for i in range(iters):
            t0 = clock()
            fn()
            samples[i] = clock() - t0
            sync()
    finally:
        gc.enable()
    return float(np.median(samples)) / 1e3


class _Frame:
    """The part of sdk.CallFrame a PlanFunction reads."""

    def __init__(self, stream, ins, outs):
        self.stream, self._ins, self._outs, self.capturing = stream, ins, outs, False

    def input_ptrs(self):
        return list(self._ins)

    def output_ptrs(self):
        return list(self._outs)


def measure(cp, name, model, iters, warmup) -> dict:
    from host.cli import zoo
    from plugin_cuda.device import driver
    from plugin_cuda.plan.onnx_spec import spec_from_onnx
    from plugin_cuda.plan.plan import Plan

    spec = spec_from_onnx(model)
    plan = Plan.build(spec)
    feeds = zoo.random_inputs(model)
    ins = [cp.asarray(feeds[n]) for n in plan.input_names]
    outs = [cp.empty(s, np.float32) for s in plan.output_shapes]
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    ip, op = [a.data.ptr for a in ins], [o.data.ptr for o in outs]
    plan.run(stream.ptr, ip, op)
    stream.synchronize()
    inst = plan._instances[stream.ptr]
    launches = [item for item in inst.eager_seq if item.__class__ is tuple]
    cublas_steps = [item for item in inst.eager_seq if item.__class__ is not tuple]
    launch = driver.lib().cuLaunchKernel
    # The plan's own launches in the plan's order, each a ready call: nothing but the launches.
    calls = [functools.partial(launch, *item) if item.__class__ is tuple else item for item in inst.eager_seq]

    def raw():
        for call in calls:
            call()

    def plan_run():
        plan.run(stream.ptr, ip, op)

    class _Ep:  # what PlanFunction.compute touches when the stream is not one of an EP's
        streams: dict = {}

    from plugin_cuda.plan.compute import PlanFunction

    fn = PlanFunction.__new__(PlanFunction)
    fn.ep, fn.plan, fn._shapes, fn.name = _Ep(), plan, plan.output_shapes, name
    frame = _Frame(stream.ptr, ip, op)

    def compute():
        fn.compute(None, frame)

    sync = stream.synchronize
    res = {"kernels": len(launches), "cublas_steps": len(cublas_steps), "nodes": plan.num_nodes}
    for label, f in (("raw_us", raw), ("plan_us", plan_run), ("compute_us", compute)):
        res[label] = _median_us(f, iters, warmup, sync)
    k = max(len(launches), 1)
    res["plan_overhead_per_kernel_us"] = (res["plan_us"] - res["raw_us"]) / k
    res["compute_overhead_per_kernel_us"] = (res["compute_us"] - res["raw_us"]) / k
    res["raw_per_launch_us"] = res["raw_us"] / k if not cublas_steps else None
    plan.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        import cupy as cp

        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        device = name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # noqa: BLE001 - no CuPy / driver / GPU
        print(f"plan_overhead: SKIPPED: no CUDA device ({type(exc).__name__}: {exc})")
        return 0
    print(f"plan_overhead on {device}: median host time per call, {args.iters} samples, stream synced between")
    results = {"device": device, "models": {}}
    print(f"| model | nodes | kernels | cuBLAS | raw loop µs | plan.run µs | compute µs | plan overhead/kernel µs "
          f"| compute overhead/kernel µs | goal <= {GOAL_US} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, model in _models().items():
        try:
            r = measure(cp, name, model, args.iters, args.warmup)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"| {name} | ERROR {type(exc).__name__}: {exc} |")
            continue
        results["models"][name] = r
        ok = "yes" if r["plan_overhead_per_kernel_us"] <= GOAL_US else "NO"
        print(f"| {name} | {r['nodes']} | {r['kernels']} | {r['cublas_steps']} | {r['raw_us']:.1f} | "
              f"{r['plan_us']:.1f} | {r['compute_us']:.1f} | {r['plan_overhead_per_kernel_us']:.2f} | "
              f"{r['compute_overhead_per_kernel_us']:.2f} | {ok} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
