"""Serving throughput and latency: the ephost deployment against the same deployment on onnxruntime.

    python -m bench.serve_bench [--model PATH] [--requests 400] [--concurrency 1,4,16]
                                [--configs onnxruntime,ephost,ephost-buckets] [--max-batch-size 16]
                                [--replicas 1] [--binary] [--json out.json]

One run starts a local Ray instance (127.0.0.1 only), then for each configuration deploys the model
(host.serving.ephost_deployment, replacing the previous application) and, at each concurrency, has
that many client threads send `--requests` single-row requests over HTTP in total. It prints requests
per second and client-side p50/p99 latency (ms) as a Markdown table; every answer is checked against
onnxruntime's first. Configurations:

    onnxruntime       the deployment with backend="onnxruntime" (its CPU session), no buckets
    ephost            ephost's CPU EP, no buckets
    ephost-buckets    ephost's CPU EP, batches padded to powers of two
    cuda, cuda-nobuckets   ephost's CUDA EP with and without buckets (a GPU machine)

Without --model the model is the zoo MLP (4 layers, 256 wide, dynamic batch).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import ray
import requests
from ray import serve

from host.cli import zoo
from host.serving import ephost_deployment

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "onnxruntime": {"backend": "onnxruntime", "buckets": False},
    "ephost": {"buckets": False},
    "ephost-buckets": {"buckets": True},
    "cuda": {"providers": ["CUDAExecutionProvider"], "buckets": True},
    "cuda-nobuckets": {"providers": ["CUDAExecutionProvider"], "buckets": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(http, url: str, name: str, x: np.ndarray, binary: bool) -> np.ndarray:
    if binary:
        buffer = io.BytesIO()
        np.savez(buffer, **{name: x})
        r = http.post(url, data=buffer.getvalue(), headers={"Content-Type": "application/x-npz"}, timeout=120)
        r.raise_for_status()
        with np.load(io.BytesIO(r.content)) as archive:
            return archive[archive.files[0]]
    body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = http.post(url, json=body, timeout=120)
    r.raise_for_status()
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def load_test(url: str, name: str, inputs: np.ndarray, clients: int, total: int, binary: bool) -> dict:
    """`clients` threads send `total` requests between them; requests/s and latency percentiles (ms)."""
    latencies, lock = [], threading.Lock()
    per_client = [total // clients + (1 if c < total % clients else 0) for c in range(clients)]

    def client(c: int, count: int):
        with requests.Session() as http:
            for i in range(count):
                x = inputs[(c * 7919 + i) % len(inputs)][None]
                t0 = time.perf_counter()
                _post(http, url, name, x, binary)
                with lock:
                    latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(c, n)) for c, n in enumerate(per_client)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = np.asarray(latencies) * 1e3
    return {"clients": clients, "requests": len(ms), "rps": len(ms) / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def check_answers(url: str, name: str, inputs: np.ndarray, reference, binary: bool) -> None:
    with requests.Session() as http:
        for x in inputs[:8]:
            np.testing.assert_allclose(_post(http, url, name, x[None], binary), reference(x[None]),
                                       rtol=1e-3, atol=1e-4)


def bench_config(label: str, model: Path, args, port: int, inputs: np.ndarray, reference) -> list[dict]:
    app = ephost_deployment(model, name="bench", num_replicas=args.replicas, max_batch_size=args.max_batch_size,
                            batch_wait_timeout_s=args.batch_wait_ms / 1000, **CONFIGS[label])
    serve.run(app, name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v2/models/bench/infer"
    name = onnx.load(str(model), load_external_data=False).graph.input[0].name
    check_answers(url, name, inputs, reference, args.binary)
    load_test(url, name, inputs, 4, min(40, args.requests), args.binary)  # warm-up: plans, buckets, connections
    rows = []
    for clients in args.concurrency:
        result = load_test(url, name, inputs, clients, args.requests, args.binary)
        rows.append({"config": label, **result})
        print(f"| {label} | {clients} | {result['rps']:.0f} | {result['p50_ms']:.2f} | {result['p99_ms']:.2f} |",
              flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="ONNX model with a dynamic batch axis (default: zoo MLP)")
    parser.add_argument("--requests", type=int, default=400, help="requests per concurrency level")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--configs", default="onnxruntime,ephost,ephost-buckets")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--batch-wait-ms", type=float, default=2.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--binary", action="store_true", help="send .npz bodies instead of JSON")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {sorted(CONFIGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "mlp.onnx"
            onnx.save(zoo.mlp(layers=4, hidden=256, dynamic_batch=True), model)
        sess = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        feed = sess.get_inputs()[0]
        inputs = np.random.default_rng(0).standard_normal((64, *feed.shape[1:])).astype(np.float32)
        reference = lambda x: sess.run(None, {feed.name: x})[0]  # noqa: E731
        port = _free_port()
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            print(f"model: {args.model or 'zoo mlp 4x256'}, max_batch_size {args.max_batch_size}, "
                  f"{args.replicas} replica(s), {'npz' if args.binary else 'JSON'} bodies, {platform.node()}")
            print("| config | clients | requests/s | p50 ms | p99 ms |\n|---|---|---|---|---|", flush=True)
            rows = [row for label in configs for row in bench_config(label, model, args, port, inputs, reference)]
        finally:
            serve.shutdown()
            ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
