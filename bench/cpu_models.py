"""ephost's CPU EP against onnxruntime's CPU provider on the real-model fixtures (tests/models).

    python -m bench.cpu_models [--iters 200] [--warmup 20] [--repeat 1] [--stat median|best] [--busy N]
                               [--models bert_dynamo,...,zoo_transformer] [--json out.json]

For each fixture: p50 latency of one `run` (batch 1, the fixture's inputs) for onnxruntime (default
optimization level, default threads), ephost with the optimizer off (ORT_DISABLE_ALL) and ephost at its
default level (ORT_ENABLE_ALL), all in this process, in rounds (a block of back-to-back calls of each per
round); the ratio is ephost p50 / onnxruntime p50 (lower is better; 1.0 = parity). With --repeat N the
whole measurement of a model runs N times and each p50 is the median of the N p50s, or with --stat best
each side's lowest: on a loaded machine onnxruntime's thread pool has good and bad stretches (its p50
doubles while the other core is busy), which one measurement catches or not, and each side's best p50
compares the two at their least loaded. With --repeat N the table also gives each side's stability:
the largest of the N p50s over the smallest (the issue's goal: <= 1.5 with N = 15). Results go to stdout
as a Markdown table.

`--busy N` starts N other busy processes (each a Python loop spinning on one core) for the whole
measurement, and stops them at the end: issue 28's stability condition ("a 2-core machine with one other
busy process", `--busy 1`), reproducible on an idle machine. The table's header line gives the load
average at the end.

Besides the fixtures, `--models` takes the zoo models as `ephost make-model` writes them by default
(zoo_mlp, zoo_cnn, zoo_transformer; random inputs, seed 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession
from tests.models import available_models, load

try:
    from host.optimizer import GraphOptimizationLevel
except ImportError:  # pragma: no cover - the optimizer lands separately
    GraphOptimizationLevel = None


def _ephost_session(path, level: str | None, threads: int = 0) -> InferenceSession:
    so = SessionOptions()
    so.intra_op_num_threads = threads
    if level is not None and GraphOptimizationLevel is not None:
        so.graph_optimization_level = getattr(GraphOptimizationLevel, level)
    return InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


ZOO = ("zoo_mlp", "zoo_cnn", "zoo_transformer")


def _zoo(name: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A zoo model with make-model's defaults, written to a temporary file, and random feeds."""
    import onnx

    from host.cli import zoo

    model = {"zoo_mlp": zoo.mlp, "zoo_cnn": zoo.cnn, "zoo_transformer": zoo.transformer_block}[name]()
    path = Path(tempfile.mkdtemp(prefix="ephost-bench-")) / f"{name}.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    return path, feeds


def bench_model(name: str, warmup: int, iters: int, block: int = 20, repeat: int = 1, stat: str = "median",
                threads: int = 0) -> dict:
    """`threads`: intra_op_num_threads of both runtimes' sessions (0: each one's default)."""
    path, feeds = _zoo(name) if name in ZOO else load(name)[:2]
    ort_options = ort.SessionOptions()
    ort_options.intra_op_num_threads = threads
    ort_sess = ort.InferenceSession(str(path), ort_options, providers=["CPUExecutionProvider"])
    runs = {"onnxruntime": lambda: ort_sess.run(None, feeds)}
    nodes = {"onnxruntime": None}
    for label, level in (("ephost_noopt", "ORT_DISABLE_ALL"), ("ephost", "ORT_ENABLE_ALL")):
        sess = _ephost_session(path, level, threads)
        runs[label] = (lambda s: lambda: s.run(None, feeds))(sess)
        nodes[label] = len(sess.node_assignment())
    # Same answers before timing anything.
    want = runs["onnxruntime"]()
    for label in ("ephost_noopt", "ephost"):
        for g, w in zip(runs[label](), want):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)
    p50s = {label: [] for label in runs}
    for _ in range(max(1, repeat)):
        samples = in_rounds(runs, warmup, iters, block)
        for label in runs:
            p50s[label].append(float(np.median(samples[label])))
    row = {"model": name}
    for label in runs:
        row[f"{label}_p50_us"] = float(min(p50s[label]) if stat == "best" else np.median(p50s[label]))
        row[f"{label}_p50s_us"] = p50s[label]
        row[f"{label}_max_over_min"] = max(p50s[label]) / min(p50s[label])
        row[f"{label}_nodes"] = nodes[label]
    for label in ("ephost_noopt", "ephost"):
        row[f"{label}_ratio"] = row[f"{label}_p50_us"] / row["onnxruntime_p50_us"]
    return row


def in_rounds(runs: dict, warmup: int, iters: int, block: int) -> dict[str, np.ndarray]:
    """Per-call latencies (us) of each callable, timed in rounds: each round runs a block of `block`
    back-to-back calls of each callable in turn (warm caches and thread pools within a block), and the
    rounds spread the peers over the same stretch of time, so load on a shared machine hits all of them."""
    clock = time.perf_counter_ns
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(max(1, -(-iters // block))):
        for label, fn in runs.items():
            for _ in range(block):
                t0 = clock()
                fn()
                samples[label].append((clock() - t0) / 1e3)
    return {label: np.array(v) for label, v in samples.items()}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | onnxruntime p50 (us) | ephost, optimizer off: p50 (us) / nodes / ratio | "
             "ephost, default level: p50 (us) / nodes / ratio | max/min of the p50s: onnxruntime, ephost |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['onnxruntime_p50_us']:.0f} | "
                     f"{r['ephost_noopt_p50_us']:.0f} / {r['ephost_noopt_nodes']} / {r['ephost_noopt_ratio']:.2f}x | "
                     f"{r['ephost_p50_us']:.0f} / {r['ephost_nodes']} / {r['ephost_ratio']:.2f}x | "
                     f"{r['onnxruntime_max_over_min']:.2f}, {r['ephost_max_over_min']:.2f} |")
    geo = {k: float(np.exp(np.mean([np.log(r[f"{k}_ratio"]) for r in rows]))) for k in ("ephost_noopt", "ephost")}
    lines.append(f"| geometric mean | | {geo['ephost_noopt']:.2f}x | {geo['ephost']:.2f}x | |")
    return "\n".join(lines)


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes that each keep one core busy until the block ends (then they are killed)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1, help="measure each model N times")
    parser.add_argument("--stat", choices=("median", "best"), default="median",
                        help="over the repeats: the median p50 or each side's best p50")
    parser.add_argument("--models", default="", help="comma-separated fixture names (default: all)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra_op_num_threads of both runtimes (default 0: each one's own default)")
    parser.add_argument("--busy", type=int, default=0,
                        help="other busy processes (one core each) running during the measurement (default: 0)")
    ns = parser.parse_args(argv)
    if ns.busy < 0:
        parser.error(f"--busy must be >= 0; got {ns.busy}")
    names = [m for m in ns.models.split(",") if m] or available_models()
    with busy_processes(ns.busy):
        rows = [bench_model(n, ns.warmup, ns.iters, repeat=ns.repeat, stat=ns.stat, threads=ns.threads) for n in names]
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, onnxruntime {ort.__version__}, "
          f"numpy {np.__version__}, Python {platform.python_version()}, {ns.busy} other busy process(es), "
          f"intra_op_num_threads {ns.threads or 'default'}, load average {load:.1f} at the end")
    print(markdown(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
