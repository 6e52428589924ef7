"""Buckets on a session, without Ray: the batches a deployment forms, run with and without padding.

    python -m bench.bucket_bench [--ep cuda] [--cuda-graph] [--batches 200] [--max-batch-size 16] [--hidden 1024]

Draws `--batches` batch sizes uniformly from 1..max_batch_size (what `@serve.batch` hands a busy
replica), and runs them through one ephost session per configuration:
- `none`: no padding (every size is a new shape);
- `serving pow2`: host.serving's BatchPolicy pads to powers of two, session.run on the padded feeds;
- `session pow2`: the session's own buckets (`session.ephost.shape_buckets` = batch:pow2); with
  `--cuda-graph` (CUDA EP, `enable_cuda_graph=1`) run() replays each bucket's graph
  (host/runtime/bucket_graphs.py);
- with `--cuda-graph`, also `iobinding, graph per shape`: device buffers per size bound with
  IOBinding, one captured graph per input-shape signature (`session.ephost.graphs_per_id` =
  max_batch_size, so none is evicted).
Prints, per configuration, the distinct shapes the session ran, the first pass's wall time (each new
shape builds its plan, and captures, then) and the second pass's rows/s and per-run p50/p99.
`bench/serve_bench.py` measures the whole HTTP path with Ray; this isolates the session, for
machines without Ray (the device machines).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime

from host.cli import zoo
from host.runtime import buckets as session_buckets
from host.runtime import shape_graphs
from host.runtime.options import SessionOptions
from host.runtime.ortvalue import OrtValue
from host.runtime.session import InferenceSession
from host.serving.batching import BatchPolicy, Piece, power_of_two_buckets
from host.serving.signature import Signature


class Serving:
    """Runs through the serving policy: pad (or not) on the host, session.run, split back."""

    def __init__(self, session, max_batch_size: int, buckets: tuple[int, ...]):
        self.session = session
        self.policy = BatchPolicy(Signature.from_session(session), max_batch_size, buckets)

    def shape(self, rows: int) -> int:
        return self.policy.bucket_for(rows)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        pieces = [Piece({"input": x}, len(x))]
        (run,) = self.policy.plan(pieces)
        return self.policy.split(pieces, run, self.session.run(None, run.feeds))[0][0]


class SessionBuckets:
    """session.run on the real feeds; the session pads (and, capturing, replays a graph per bucket)."""

    def __init__(self, session):
        self.session = session

    def shape(self, rows: int) -> int:
        return session_buckets.Rule(0).size(rows)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"input": x})[0]


class BoundGraphs:
    """IOBinding on device buffers kept per size: one captured graph per input-shape signature."""

    def __init__(self, session):
        self.session = session
        self.by_rows: dict[int, tuple] = {}

    def shape(self, rows: int) -> int:
        return rows

    def __call__(self, x: np.ndarray) -> np.ndarray:
        rows = len(x)
        if rows not in self.by_rows:
            out_shape = [rows, self.session.get_outputs()[0].shape[1]]
            x_dev = OrtValue.ortvalue_from_numpy(x, "cuda")
            y_dev = OrtValue.ortvalue_from_shape_and_type(out_shape, np.float32, "cuda")
            binding = self.session.io_binding()
            binding.bind_ortvalue_input("input", x_dev)
            binding.bind_ortvalue_output(self.session.get_outputs()[0].name, y_dev)
            self.by_rows[rows] = (binding, x_dev, y_dev)
        binding, x_dev, y_dev = self.by_rows[rows]
        x_dev.update_inplace(x)  # new data into the bound buffer: the graph replays on it
        self.session.run_with_iobinding(binding)
        return y_dev.numpy()


def one_pass(runner, batches: list[np.ndarray]) -> tuple[float, list[float], int]:
    wall, times, rows = time.perf_counter(), [], 0
    for x in batches:
        t0 = time.perf_counter()
        runner(x)
        times.append(time.perf_counter() - t0)
        rows += len(x)
    return time.perf_counter() - wall, times, rows


def configurations(args, data: bytes, providers: list):
    """(label, runner) per configuration, each on its own session."""
    max_b = args.max_batch_size

    def session(**config):
        so = SessionOptions()
        for k, v in config.items():
            so.add_session_config_entry(k, v)
        return InferenceSession(data, so, providers=providers)

    yield "none", Serving(session(), max_b, ())
    yield "serving pow2", Serving(session(), max_b, power_of_two_buckets(max_b))
    yield "session pow2" + (", graphs" if args.cuda_graph else ""), \
        SessionBuckets(session(**{session_buckets.CONFIG_KEY: "batch:pow2"}))
    if args.cuda_graph:
        yield "iobinding, graph per shape", BoundGraphs(session(**{shape_graphs.CONFIG_KEY: str(max_b)}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cuda-graph", action="store_true", help="CUDA EP with enable_cuda_graph=1")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.cuda_graph and args.ep != "cuda":
        parser.error("--cuda-graph needs --ep cuda")
    model = zoo.mlp(layers=args.layers, hidden=args.hidden, dynamic_batch=True)
    data = model.SerializeToString()
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((int(rng.integers(1, args.max_batch_size + 1)), args.hidden)).astype(np.float32)
               for _ in range(args.batches)]
    reference = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    providers = (["CPUExecutionProvider"] if args.ep == "cpu" else
                 [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})] if args.cuda_graph else ["CUDAExecutionProvider"])
    print(f"zoo mlp {args.layers} x {args.hidden}, {args.batches} batches of 1..{args.max_batch_size} rows, "
          f"EP {providers[0]}, onnx {onnx.__version__}")
    print("| configuration | shapes | first pass s | rows/s (2nd pass) | run p50 ms | run p99 ms | graphs captured |\n"
          "|---|---|---|---|---|---|---|")
    for label, runner in configurations(args, data, providers):
        for x in batches[:4]:  # same answers as onnxruntime, padded or not
            np.testing.assert_allclose(runner(x), reference.run(None, {"input": x})[0], rtol=1e-3, atol=1e-3)
        shapes = {runner.shape(len(x)) for x in batches}
        cold, _, _ = one_pass(runner, batches)
        warm, times, rows = one_pass(runner, batches)
        ms = np.asarray(times) * 1e3
        print(f"| {label} | {len(shapes)} | {cold:.2f} | {rows / warm:.0f} | {np.percentile(ms, 50):.3f} | "
              f"{np.percentile(ms, 99):.3f} | {runner.session.fallbacks['graph_captured']} |", flush=True)
        runner.session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
