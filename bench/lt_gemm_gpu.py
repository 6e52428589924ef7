"""The plans' cuBLASLt epilogue GEMMs against PyTorch's on the same shapes (issue 25, GEMM-bound layers).

    python -m bench.lt_gemm_gpu [--rows 1024 --shapes 768x768,768x3072,3072x768] [--candidates 8]
                                [--precision fp32 fp32-tf32 fp16] [--iters 50] [--json FILE]

For each (precision, K x N) at M = `--rows` (BERT-base at batch 8, seq 128 by default: its projections and
both FFN GEMMs), out = A (M, K) @ W (K, N) + bias through:
- `lt ws=0`: plugin_cuda.device.cublaslt.EpilogueGemm with no workspace (the plans before 2026-11-29);
- `lt ws=32M #i`: the same with the stream's 32 MiB cuBLAS workspace, cuBLASLt heuristic answer i (the plans
  take answer 0);
- `torch addmm` (cuBLASLt with bias, or cuBLAS and a bias kernel, PyTorch's choice) and `torch mm` (no bias).
Device time per call from CUDA events around `--iters` back-to-back calls; achieved TFLOP/s and the fraction
of the device's dense peak for the precision (H100/H200 SXM: 67 float32, 495 TF32, 989 float16 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# dense peaks of the H100 / H200 SXM (the same chip), TFLOP/s
PEAKS = {"fp32": 67.0, "fp32-tf32": 495.0, "fp16": 989.0}


def _events_us(cp, fn, iters: int) -> float:
    """Device microseconds per call of fn() over `iters` calls on the current stream (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / iters


def lt_rows(cp, m: int, k: int, n: int, precision: str, candidates: int, iters: int) -> list[dict]:
    """The EpilogueGemm variants' times (and their agreement with a CuPy reference)."""
    import numpy as np

    from plugin_cuda.device import cublas, cublaslt

    dtype = np.float16 if precision == "fp16" else np.float32
    data_type, compute = cublas.gemm_types(np.dtype(dtype), precision == "fp32-tf32")
    rng = cp.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(dtype)
    w = (rng.standard_normal((k, n), dtype=np.float32) / k ** 0.5).astype(dtype)
    bias = rng.standard_normal((n,), dtype=np.float32).astype(dtype)
    out = cp.empty((m, n), dtype)
    want = a.astype(np.float32) @ w.astype(np.float32) + bias.astype(np.float32)
    stream = cp.cuda.get_current_stream().ptr
    workspace = cp.empty((cublas.WORKSPACE_BYTES,), np.uint8)
    rows = []
    for ws in (0, cublas.WORKSPACE_BYTES):
        gemm = cublaslt.EpilogueGemm(cp.cuda.Device().id, m, n, k, 1.0, bias.data.ptr, "bias", compute,
                                     "bench", data_type, ws)
        found = gemm.heuristics(candidates if ws else 1)
        for i, (algo, needs, waves) in enumerate(found):
            gemm.algo = algo
            ws_ptr = workspace.data.ptr if ws else 0

            def call(gemm=gemm, ws_ptr=ws_ptr):
                gemm(a.data.ptr, w.data.ptr, out.data.ptr, stream, ws_ptr)

            us = _events_us(cp, call, iters)
            err = float(cp.abs(out.astype(np.float32) - want).max() / cp.abs(want).max())
            rows.append({"path": f"lt ws={'32M' if ws else 0} #{i}", "us": us, "needs_bytes": needs,
                         "waves": round(waves, 2), "rel_err": err})
        gemm.close()
    return rows


def torch_rows(m: int, k: int, n: int, precision: str, iters: int) -> list[dict]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = precision == "fp32-tf32"
    dtype = torch.float16 if precision == "fp16" else torch.float32
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(k, n, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    rows = []
    for name, fn in (("torch addmm", lambda: torch.addmm(bias, a, w)), ("torch mm", lambda: torch.mm(a, w))):
        for _ in range(3):
            fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        rows.append({"path": name, "us": start.elapsed_time(stop) * 1e3 / iters})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024, help="M: batch x sequence")
    ap.add_argument("--shapes", default="768x768,768x2304,768x3072,3072x768", help="K x N, comma-separated")
    ap.add_argument("--precision", nargs="+", default=["fp32", "fp32-tf32", "fp16"], choices=sorted(PEAKS))
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import cupy as cp

    results = []
    for precision in args.precision:
        print(f"\n### {precision}, M = {args.rows}\n")
        print("| K x N | path | us | TFLOP/s | of peak | workspace used | waves | rel. error |")
        print("|---|---|---|---|---|---|---|---|")
        for shape in args.shapes.split(","):
            k, n = (int(x) for x in shape.split("x"))
            flops = 2.0 * args.rows * k * n
            rows = lt_rows(cp, args.rows, k, n, precision, args.candidates, args.iters)
            rows += torch_rows(args.rows, k, n, precision, args.iters)
            for r in rows:
                tflops = flops / r["us"] / 1e6
                r.update(precision=precision, m=args.rows, k=k, n=n, tflops=round(tflops, 1),
                         of_peak=round(tflops / PEAKS[precision], 3))
                print(f"| {k}x{n} | {r['path']} | {r['us']:.1f} | {tflops:.1f} | {r['of_peak']:.0%} | "
                      f"{r.get('needs_bytes', '')} | {r.get('waves', '')} | "
                      f"{'' if 'rel_err' not in r else format(r['rel_err'], '.1e')} |")
            results += rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
