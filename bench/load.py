"""Load: one session (or several) run from threads that come and go, checked for errors and for one
result per input.

    python -m bench.load [--ep cpu|cuda|example] [--model transformer|mlp|cnn[,...]] [--seq 64]
                         [--cycles 20] [--rounds 1,2,4,8,16] [--runs 60] [--iobinding]
                         [--option KEY=VALUE ...] [--sessions 1] [--json out.json]

Each cycle runs rounds of 1, 2, 4, 8 and 16 threads (`--rounds`); every thread makes `--runs` calls
on the same session(s), cycling through a few fixed inputs, then ends, so the next round's threads
find what the last round's left behind (streams, cuBLAS handles, plans' per-stream state, graphs).
Every output is compared bit for bit with the first result the session gave for that input: a
session must answer one input with one result on every run and every thread. Per round: runs/s,
p50 and p99 latency of one call, errors, differing results; and device memory in use before and
after (CUDA), which must come back to its plateau.

`--sessions N` runs N sessions of different sizes side by side (each thread picks one per call);
`--model transformer,mlp,cnn` a session of each model (of each size), so several models share a GPU.
With `--ep example` the example plugin (tests/plugins, built by `python build.py`) takes the nodes
it claims, so the CPU side has a plugin with per-thread streams too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from host.cli import zoo
from host.runtime.session import InferenceSession

EPS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "example": "ExampleEP"}
INPUTS_PER_SESSION = 3


@dataclass
class Target:
    """A session with its inputs and the first answer it gave for each."""

    session: InferenceSession
    feeds: list[dict]
    expected: list[list[np.ndarray]] = field(default_factory=list)


@dataclass
class RoundStats:
    threads: int
    runs: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    differing: int = 0

    def row(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        return {"threads": self.threads, "runs": self.runs, "runs_per_s": self.runs / max(self.seconds, 1e-9),
                "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                "errors": len(self.errors), "differing": self.differing,
                "first_error": self.errors[0] if self.errors else None}


def make_model(kind: str, seq: int, size: int = 0):
    """The zoo model `kind`; `size` varies it between side-by-side sessions."""
    if kind == "transformer":
        return zoo.transformer_block(seq=seq, hidden=128 + 64 * size, heads=4, ffn=256 + 128 * size)
    if kind == "mlp":
        return zoo.mlp(layers=4 + size, hidden=256)
    if kind == "cnn":
        return zoo.cnn()
    raise SystemExit(f"unknown --model {kind!r}; allowed: transformer, mlp, cnn")


def random_feeds(session: InferenceSession, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {a.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in a.shape]).astype(np.float32)
            for a in session.get_inputs()}


def prepare(session: InferenceSession, seed: int = 0) -> Target:
    """A Target whose expected answers are the session's first results (main thread, plain run)."""
    feeds = [random_feeds(session, seed + k) for k in range(INPUTS_PER_SESSION)]
    target = Target(session, feeds)
    target.expected = [session.run(None, f) for f in feeds]
    return target


class Caller:
    """One thread's way to call a session: plain run(), or its own IOBinding over device buffers,
    fixed for the thread's life (a CUDA graph replays bound buffers): each call copies its input
    into the bound buffers first."""

    def __init__(self, target: Target, iobinding: bool):
        self.target = target
        self.binding = _bind(target.session, target.feeds[0]) if iobinding else None

    def __call__(self, k: int) -> list[np.ndarray]:
        feeds = self.target.feeds[k]
        if self.binding is None:
            return self.target.session.run(None, feeds)
        binding, inputs, outputs = self.binding
        for arg, buf in zip(self.target.session.get_inputs(), inputs):
            if hasattr(buf, "set"):
                buf.set(feeds[arg.name])
            else:
                buf[...] = feeds[arg.name]
        self.target.session.run_with_iobinding(binding)
        return [o.get() if hasattr(o, "get") else np.array(o) for o in outputs]


def _bind(session: InferenceSession, feeds: dict):
    """An IOBinding with inputs and outputs in device memory (CuPy) where CuPy works, else host."""
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no GPU: bind host arrays
        cp = None
    binding = session.io_binding()
    ref = session.run(None, feeds)
    inputs = []
    for arg in session.get_inputs():
        value = cp.asarray(feeds[arg.name]) if cp is not None else feeds[arg.name].copy()
        binding.bind_input(arg.name, value)
        inputs.append(value)  # kept alive with the binding; each call copies its input in
    outs = []
    for arg, r in zip(session.get_outputs(), ref):
        out = cp.empty(r.shape, r.dtype) if cp is not None else np.empty(r.shape, r.dtype)
        binding.bind_output(arg.name, out)
        outs.append(out)
    if cp is not None:
        cp.cuda.get_current_stream().synchronize()
    return binding, inputs, outs


def run_round(targets: list[Target], threads: int, runs: int, iobinding: bool) -> RoundStats:
    """`threads` new threads, each `runs` calls spread over the targets; they end with the round."""
    stats = RoundStats(threads)
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(t: int) -> None:
        lat, errors, differing = [], [], 0
        try:
            callers = [Caller(target, iobinding) for target in targets]
            start.wait()
            for i in range(runs):
                j = (t + i) % len(targets)
                k = (t + i) % INPUTS_PER_SESSION
                t0 = time.perf_counter()
                got = callers[j](k)
                lat.append(time.perf_counter() - t0)
                if any(not np.array_equal(a, b) for a, b in zip(got, targets[j].expected[k])):
                    differing += 1
        except Exception as exc:  # noqa: BLE001 - counted, reported, the round goes on
            errors.append(f"{type(exc).__name__}: {exc}")
            start.abort()
        with lock:
            stats.latencies.extend(lat)
            stats.errors.extend(errors)
            stats.differing += differing
            stats.runs += len(lat)

    pool = [threading.Thread(target=worker, args=(t,), name=f"load-{threads}-{t}") for t in range(threads)]
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    stats.seconds = time.perf_counter() - t0
    return stats


def device_bytes_in_use() -> int | None:
    """Device memory in use on GPU 0 (cudaMemGetInfo), or None without CuPy/GPU."""
    try:
        import cupy as cp

        free, total = cp.cuda.runtime.memGetInfo()
    except Exception:  # noqa: BLE001 - no GPU
        return None
    return int(total - free)


def run_cycles(targets: list[Target], cycles: int, rounds: list[int], runs: int, iobinding: bool,
               report=None) -> list[dict]:
    """Every cycle runs every round; returns one row per (cycle, round)."""
    rows = []
    for cycle in range(cycles):
        for threads in rounds:
            row = run_round(targets, threads, runs, iobinding).row()
            row.update(cycle=cycle, device_bytes=device_bytes_in_use())
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def _sessions(args) -> list[InferenceSession]:
    options = dict(kv.split("=", 1) for kv in args.option)
    provider = EPS[args.ep]
    providers = [provider] if provider == EPS["cpu"] else [(provider, options), EPS["cpu"]]
    kwargs = {}
    if args.ep == "example":
        from host.plugins.environment import Environment
        from tests.conftest import built_plugin

        env = Environment()
        env.register_plugin("example", built_plugin("example"))
        kwargs["env"] = env
    kinds = args.model.split(",")
    return [InferenceSession(make_model(kind, args.seq, size), providers=providers, **kwargs)
            for size in range(args.sessions) for kind in kinds]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", choices=sorted(EPS), default="cuda")
    p.add_argument("--model", default="transformer",
                   help="zoo model, or several comma-separated (transformer, mlp, cnn): a session of each")
    p.add_argument("--seq", type=int, default=64, help="sequence length of the transformer (default 64)")
    p.add_argument("--cycles", type=int, default=2, help="how many times to run every round (default 2)")
    p.add_argument("--rounds", default="1,2,4,8,16", help="threads per round (default 1,2,4,8,16)")
    p.add_argument("--runs", type=int, default=60, help="calls per thread per round (default 60)")
    p.add_argument("--sessions", type=int, default=1, help="sessions of different sizes side by side")
    p.add_argument("--iobinding", action="store_true", help="run_with_iobinding over device buffers")
    p.add_argument("--option", action="append", default=[], help="provider option KEY=VALUE (repeatable)")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    rounds = [int(r) for r in args.rounds.split(",")]
    before = device_bytes_in_use()
    targets = [prepare(s, seed=10 * i) for i, s in enumerate(_sessions(args))]
    after_setup = device_bytes_in_use()
    print(f"# {args.ep} {args.model} seq={args.seq} sessions={args.sessions} options={args.option} "
          f"iobinding={args.iobinding}; device bytes before {before}, after set-up {after_setup}")
    print("| cycle | threads | runs | runs/s | p50 ms | p99 ms | errors | differing | device MiB |")
    print("|---|---|---|---|---|---|---|---|---|")

    def report(row):
        mib = "-" if row["device_bytes"] is None else f"{row['device_bytes'] / 2**20:.0f}"
        print(f"| {row['cycle']} | {row['threads']} | {row['runs']} | {row['runs_per_s']:.0f} | {row['p50_ms']:.2f} "
              f"| {row['p99_ms']:.2f} | {row['errors']} | {row['differing']} | {mib} |", flush=True)
        if row["first_error"]:
            print(f"#   first error: {row['first_error']}", flush=True)

    rows = run_cycles(targets, args.cycles, rounds, args.runs, args.iobinding, report)
    errors = sum(r["errors"] for r in rows)
    differing = sum(r["differing"] for r in rows)
    print(f"# total: {sum(r['runs'] for r in rows)} runs, {errors} errors, {differing} differing results")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    for t in targets:
        t.session.close()
    return 1 if errors or differing else 0


if __name__ == "__main__":
    sys.exit(main())
