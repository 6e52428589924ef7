"""Buckets on a session, without Ray: the batches a deployment forms, run with and without padding.

    python -m bench.bucket_bench [--ep cuda] [--batches 200] [--max-batch-size 16] [--hidden 1024]

Draws `--batches` batch sizes uniformly from 1..max_batch_size (what `@serve.batch` hands a busy
replica), and runs them through host.serving's BatchPolicy and one ephost session per configuration:
no buckets (every size is a new shape) and powers of two. Prints, per configuration, the distinct
shapes the session saw, the first pass's wall time (each new shape builds its plan then) and the
second pass's rows/s and per-run p50/p99. `bench/serve_bench.py` measures the whole HTTP path with
Ray; this isolates the session, for machines without Ray (the device machines).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime

from host.cli import zoo
from host.runtime.session import InferenceSession
from host.serving.batching import BatchPolicy, Piece, power_of_two_buckets
from host.serving.signature import Signature


def one_pass(session, policy: BatchPolicy, batches: list[np.ndarray]) -> tuple[float, list[float], int]:
    wall, times, rows = time.perf_counter(), [], 0
    for x in batches:
        (run,) = policy.plan([Piece({"input": x}, len(x))])
        t0 = time.perf_counter()
        out = session.run(None, run.feeds)
        policy.split([Piece({"input": x}, len(x))], run, out)
        times.append(time.perf_counter() - t0)
        rows += len(x)
    return time.perf_counter() - wall, times, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    model = zoo.mlp(layers=args.layers, hidden=args.hidden, dynamic_batch=True)
    data = model.SerializeToString()
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((int(rng.integers(1, args.max_batch_size + 1)), args.hidden)).astype(np.float32)
               for _ in range(args.batches)]
    reference = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    providers = ["CUDAExecutionProvider"] if args.ep == "cuda" else ["CPUExecutionProvider"]
    print(f"zoo mlp {args.layers} x {args.hidden}, {args.batches} batches of 1..{args.max_batch_size} rows, "
          f"EP {providers[0]}, onnx {onnx.__version__}")
    print("| buckets | shapes | first pass s | rows/s (2nd pass) | run p50 ms | run p99 ms |\n|---|---|---|---|---|---|")
    for label, buckets in (("none", ()), ("powers of two", power_of_two_buckets(args.max_batch_size))):
        session = InferenceSession(data, providers=providers)
        policy = BatchPolicy(Signature.from_session(session), args.max_batch_size, buckets)
        for x in batches[:4]:  # same answers as onnxruntime, padded or not
            (run,) = policy.plan([Piece({"input": x}, len(x))])
            (got,) = policy.split([Piece({"input": x}, len(x))], run, session.run(None, run.feeds))[0]
            np.testing.assert_allclose(got, reference.run(None, {"input": x})[0], rtol=1e-3, atol=1e-3)
        shapes = {policy.bucket_for(len(x)) for x in batches}
        cold, _, _ = one_pass(session, policy, batches)
        warm, times, rows = one_pass(session, policy, batches)
        ms = np.asarray(times) * 1e3
        print(f"| {label} | {len(shapes)} | {cold:.2f} | {rows / warm:.0f} | {np.percentile(ms, 50):.3f} | "
              f"{np.percentile(ms, 99):.3f} |", flush=True)
        session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
