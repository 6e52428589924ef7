"""A mixed plan against a CPU-only plan: do the CPU EP's run-loop speedups survive one plugin node?

For each fixture model (tests/models), two sessions on the same model with one extra node at the
end (a Sigmoid on the first output, a new graph output):
  cpu    every node on the CPU EP;
  mixed  the example plugin (ExampleEP, ops=Sigmoid) claims the Sigmoid nodes (the added one, and any
         the model has), the rest stays on the CPU EP.
The ratio mixed / cpu of the p50 run times says what the plugin node costs the CPU nodes; with one
executor of prepared steps (host/runtime/steps) the CPU nodes of both plans run the same segment loop
(chains, bound constants, native kernels), so the ratio is 1 plus the plugin node's own crossing.

    python -m bench.mixed_plan [--models bert_dynamo,...] [--iters 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
from onnx import helper

from bench.dispatch import example_plugin
from host.cli.benchutil import bench_session
from tests.models import available_models, load

EP_NAME = "ExampleEP"


def with_sigmoid(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` plus Sigmoid(first output) as an extra graph output 'mixed_plan_out'."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    first = m.graph.output[0]
    m.graph.node.append(helper.make_node("Sigmoid", [first.name], ["mixed_plan_out"], name="mixed_plan_sigmoid"))
    out = m.graph.output.add()
    out.CopyFrom(first)
    out.name = "mixed_plan_out"
    return m


def measure(name: str, env, warmup: int, iters: int) -> dict:
    from host.runtime.session import InferenceSession

    path, feeds, _ = load(name)
    model = with_sigmoid(onnx.load(str(path)))
    cpu = InferenceSession(model.SerializeToString(), providers=[], env=env)
    mixed = InferenceSession(model.SerializeToString(), providers=[(EP_NAME, {"ops": "Sigmoid"})], env=env)
    try:
        on_plugin = sum(ep == EP_NAME for ep in mixed.node_assignment().values())
        want, got = cpu.run(None, feeds), mixed.run(None, feeds)
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        stats = {"cpu": bench_session(lambda: cpu.run(None, feeds), warmup, iters),
                 "mixed": bench_session(lambda: mixed.run(None, feeds), warmup, iters)}
    finally:
        cpu.close()
        mixed.close()
    return {"model": name, "nodes": len(cpu.plan.nodes), "on_plugin": on_plugin,
            "cpu_p50_ms": stats["cpu"]["p50_us"] / 1000, "mixed_p50_ms": stats["mixed"]["p50_us"] / 1000,
            "ratio": stats["mixed"]["p50_us"] / stats["cpu"]["p50_us"]}


def main(argv=None) -> int:
    from host.plugins.environment import Environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert_dynamo,gpt2_torchscript,mobilenetv3_torchscript,vit_dynamo")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n in available_models()]
    rows = []
    with Environment() as env:
        env.register_plugin("example", example_plugin(None))
        for name in names:
            rows.append(measure(name, env, args.warmup, args.iters))
    print("| model | plan nodes | on ExampleEP | CPU-only p50 ms | mixed p50 ms | mixed / CPU-only |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['nodes']} | {r['on_plugin']} | {r['cpu_p50_ms']:.3f} | {r['mixed_p50_ms']:.3f} "
              f"| {r['ratio']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
