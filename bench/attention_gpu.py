"""Attention on the GPU: the fused flash kernel vs the two-GEMM path vs torch's SDPA.

    python bench/attention_gpu.py [--batch 8] [--heads 12] [--seqs 128 512 2048] [--head 64] [--causal]

Per dtype (float32, float16, bfloat16) and sequence length (Sq = Skv): the median time over CUDA events
of the plugin's fused kernels (kernels/flash_attention.py: the SIMT one, the tensor-core one, TF32 for
float32), its two-GEMM path (kernels/attention.py;
float32 with TF32 on, ephost's default, and off) and torch.nn.functional.scaled_dot_product_attention
(torch's own choice of backend; torch's TF32 setting as it is, off by default), in ms and in TFLOP/s
(4 B H Sq Skv D flops, halved under --causal). The same inputs for all three.
"""

from __future__ import annotations

import argparse

import numpy as np


def _time_ms(fn, record, iters: int) -> float:
    """Median per-call time of `fn` over `iters` calls in 5 batches, with events from `record()`."""
    fn()
    samples = []
    for _ in range(5):
        start, end = record()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(elapsed(start, end) / iters)
    return float(np.median(samples))


def elapsed(start, end) -> float:
    import cupy

    if isinstance(start, cupy.cuda.Event):
        return cupy.cuda.get_elapsed_time(start, end)
    return start.elapsed_time(end)


def bench_one(cp, torch, dtype, batch, heads, seq, head, causal, iters):
    from abi.dtypes import BFLOAT16_DTYPE
    from plugin_cuda.device.cublas import CublasHandle
    from plugin_cuda.kernels import flash_attention as flash
    from plugin_cuda.kernels.attention import attention_plan, launch_attention

    np_dtype = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16_DTYPE}[dtype]
    shape = (batch, heads, seq, head)
    tq, tk, tv = (torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
    ty = torch.empty_like(tq)
    plan = attention_plan(shape, shape, shape, None, None, None, None, int(causal), None, 0.0, np_dtype)
    ptrs = [t.data_ptr() for t in (tq, tk, tv)]
    y = ty.data_ptr()
    cp_events = lambda: (cp.cuda.Event(), cp.cuda.Event())  # noqa: E731 - CuPy's current stream is the null one
    torch_events = lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # noqa: E731
    rows = {}
    rows["flash SIMT"] = _time_ms(lambda: flash.launch_flash(plan, *ptrs, 0, y, False), cp_events, iters)
    ref = ty.clone()  # the exact kernel's result: the others are compared with it
    if flash.tensor_cores(plan, tf32=True):  # float32: TF32, the plugin's default (use_tf32=1)
        name = "flash tensor cores" + (" tf32" if dtype == "float32" else "")
        rows[name] = _time_ms(lambda: flash.launch_flash(plan, *ptrs, 0, y, True), cp_events, iters)
        cp.cuda.Device().synchronize()
        rows[name + " (max |diff| vs SIMT)"] = float((ty.float() - ref.float()).abs().max())
    work = cp.empty((plan.workspace_bytes,), np.uint8)
    for tf32 in ((True, False) if dtype == "float32" else (True,)):
        handle = CublasHandle(0, use_tf32=tf32)
        name = "two-GEMM" + (" tf32" if tf32 and dtype == "float32" else "")
        rows[name] = _time_ms(lambda h=handle: launch_attention(h, plan, *ptrs, 0, y, work.data.ptr), cp_events, iters)
        cp.cuda.Device().synchronize()
        err = float((ty.float() - ref.float()).abs().max())
        rows[name + " (max |diff| vs flash)"] = err
        handle.close()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows["torch SDPA"] = _time_ms(lambda: sdpa(tq, tk, tv, is_causal=causal), torch_events, iters)
    err = float((sdpa(tq, tk, tv, is_causal=causal).float() - ref.float()).abs().max())
    rows["torch SDPA (max |diff| vs flash)"] = err
    return rows, 4 * batch * heads * seq * seq * head * (0.5 if causal else 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head", type=int, default=64)
    ap.add_argument("--seqs", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    import cupy as cp
    import torch

    print(f"device: {torch.cuda.get_device_name()}; B={args.batch} H={args.heads} D={args.head} "
          f"causal={args.causal}; torch {torch.__version__}, TF32 matmul in torch: "
          f"{torch.backends.cuda.matmul.allow_tf32}")
    print(f"{'dtype':9} {'S':>5}  {'kernel':34} {'ms':>9} {'TFLOP/s':>8}")
    for dtype in args.dtypes:
        for seq in args.seqs:
            rows, flops = bench_one(cp, torch, dtype, args.batch, args.heads, seq, args.head, args.causal, args.iters)
            for name, value in rows.items():
                if "diff" in name:
                    print(f"{dtype:9} {seq:5}  {name:34} {value:9.2e}")
                else:
                    print(f"{dtype:9} {seq:5}  {name:34} {value:9.3f} {flops / value / 1e9:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
