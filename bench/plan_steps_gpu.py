"""Where a compiled plan's GPU time goes, step by step, beside PyTorch's kernels on the same module (issues 23, 25).

    python -m bench.plan_steps_gpu [--rows bert_b8,bert@3x50,...] [--precision fp32|fp16|bf16] [--tf32 0|1]
                                   [--reps 20] [--json FILE]

Each row is exported and converted as bench/half_goals.py does (same architectures and sizes), run on the
CUDA EP through IOBinding a few times, then every compiled plan of the session is replayed step by step
on its own stream with a CUDA event between consecutive steps (`--reps` times): each step's device time,
its kind (gemm, flash_attention, ew, layernorm, cudnn_conv, ...) and name. The events cost the GPU
nothing measurable but keep the host from running ahead, so the sum is the plan's device time, not its
eager latency; a step shorter than the host's launch interval (the float16 GEMMs, a cuDNN call's host
work) reads as that interval. Kernel times without any host part: torch.profiler's CUDA kernel records
(CUPTI) over `--reps` eager runs of the ephost session, and over as many eager forward passes of the same
module in the same precision, grouped by kernel name. Prints per row: ephost's steps grouped by kind (and
the ten longest steps), then ephost's and PyTorch's longest kernels.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.half_goals import ROWS, _torch_arg, export_arch, half_dtype, make_feeds  # noqa: E402

CUDA = "CUDAExecutionProvider"


def _bind(session, cp, feeds: dict):
    """IOBinding with device inputs and outputs the EP allocates (kept on the device)."""
    binding = session.io_binding()
    keep = {}
    for name, arr in feeds.items():
        bits = arr.view(np.uint16) if arr.dtype.itemsize == 2 and arr.dtype.kind not in "iu" else arr
        keep[name] = cp.asarray(bits)
        binding.bind_input(name, device_type="cuda", device_id=0, element_type=arr.dtype, shape=arr.shape,
                           buffer_ptr=keep[name].data.ptr)
    for out in session.get_outputs():
        binding.bind_output(out.name, device_type="cuda", device_id=0)
    return binding, keep


def plans() -> list:
    """Every compiled plan alive in this process."""
    from plugin_cuda.plan.plan import Plan

    return [obj for obj in gc.get_objects() if isinstance(obj, Plan)]


def plan_instances(before: set) -> list:
    """(plan, instance) of every compiled plan made since `before` (ids of the plans alive then) that has an
    eager launch sequence: an earlier row's plans may still be alive (the plugin's caches)."""
    return [(p, inst) for p in plans() if id(p) not in before
            for inst in list(p._instances.values()) if getattr(inst, "eager_seq", None)]


def time_steps(cp, inst, reps: int) -> list[dict]:
    """Each eager step's device time (µs, median over `reps`), in launch order."""
    seq = inst.eager_seq
    steps = inst._variant_of[id(seq)].steps
    stream = cp.cuda.ExternalStream(inst.stream_ptr)
    launch = inst.cu.cuLaunchKernel
    events = [cp.cuda.Event() for _ in range(len(seq) + 1)]
    samples = [[] for _ in seq]
    for _ in range(reps):
        events[0].record(stream)
        for i, item in enumerate(seq):
            if item.__class__ is tuple:
                code = launch(*item)
                if code:
                    raise RuntimeError(f"cuLaunchKernel failed ({code}) at step {i}")
            else:
                item()
            events[i + 1].record(stream)
        events[-1].synchronize()
        for i in range(len(seq)):
            samples[i].append(cp.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e3)
    return [{"index": i, "kind": str(getattr(s, "kind", "?")), "name": str(getattr(s, "name", "?")),
             "us": float(np.median(t))} for i, (s, t) in enumerate(zip(steps, samples))]


def profiled_kernels(torch, one_pass, reps: int) -> list[dict]:
    """The CUDA kernels (CUPTI, through torch.profiler) of `reps` calls of one_pass(): (name, µs per pass),
    longest first. Device times of the kernels themselves, whoever launched them: no host time in them."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        one_pass()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            one_pass()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            rows.append({"name": event.key[:90], "us": total / reps, "calls": event.count // reps})
    return sorted(rows, key=lambda r: -r["us"])


def torch_kernels(torch, module, feeds: dict, dtype, reps: int) -> list[dict]:
    """PyTorch's CUDA kernels over `reps` eager forward passes of the module."""
    args = [_torch_arg(torch, v, dtype) for v in feeds.values()]

    def one_pass():
        with torch.inference_mode():
            module(*args)
    return profiled_kernels(torch, one_pass, reps)


def _kernel_table(title: str, kernels: list[dict]) -> list[str]:
    total = sum(k["us"] for k in kernels) or 1.0
    lines = ["", f"| {title} ({total:.0f} µs a pass) | calls per pass | µs per pass | share |", "|---|---|---|---|"]
    return lines + [f"| {k['name']} | {k['calls']} | {k['us']:.1f} | {k['us'] / total:.0%} |" for k in kernels[:12]]


def by_kind(steps: list[dict]) -> list[tuple[str, int, float]]:
    kinds: dict = defaultdict(lambda: [0, 0.0])
    for s in steps:
        kinds[s["kind"]][0] += 1
        kinds[s["kind"]][1] += s["us"]
    return sorted(((k, n, t) for k, (n, t) in kinds.items()), key=lambda r: -r[2])


def report(row: str, steps: list[dict], kernels: list[dict], ours: list[dict]) -> str:
    total = sum(s["us"] for s in steps) or 1.0
    torch_total = sum(k["us"] for k in kernels) or 1.0
    lines = [f"### {row}: ephost {total:.0f} µs of plan steps, PyTorch {torch_total:.0f} µs of kernels", "",
             "| ephost step kind | steps | µs | share |", "|---|---|---|---|"]
    lines += [f"| {k} | {n} | {t:.1f} | {t / total:.0%} |" for k, n, t in by_kind(steps)]
    lines += ["", "| ephost's longest steps | kind | µs |", "|---|---|---|"]
    lines += [f"| {s['index']}: {s['name'][:60]} | {s['kind']} | {s['us']:.1f} |"
              for s in sorted(steps, key=lambda s: -s["us"])[:10]]
    lines += _kernel_table("ephost's kernels, eager runs", ours)
    lines += _kernel_table("PyTorch's kernels", kernels)
    return "\n".join(lines)


def row_size(row: str) -> tuple:
    """(architecture, batch, sequence) of a row: a name of half_goals.ROWS, or ARCH@BxS (ARCH@B for the
    image models) at another size of the same dynamic-axes export."""
    if "@" not in row:
        return ROWS[row]
    arch, size = row.split("@")
    batch, _, seq = size.partition("x")
    return arch, int(batch), int(seq) if seq else None


def bench_row(row: str, precision: str, tf32: bool, reps: int, torch, env) -> dict:
    import cupy as cp
    import onnx

    from host.precision import convert_precision
    from host.runtime.session import InferenceSession

    arch, batch, seq = row_size(row)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{arch}.onnx"
        module, names, size = export_arch(torch, arch, path)
        exported = onnx.load(str(path))
    dtype = np.dtype(np.float32) if precision == "fp32" else half_dtype(precision)
    model = exported if precision == "fp32" else convert_precision(exported, precision)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    module = copy.deepcopy(module).to("cuda", torch_dtype).eval()
    feeds = make_feeds(arch, names, size, batch, seq, dtype, np.random.default_rng(0))
    before = {id(p) for p in plans()}
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, {"use_tf32": str(int(tf32))})], env=env)
    binding, _keep = _bind(session, cp, feeds)
    for _ in range(3):
        session.run_with_iobinding(binding)
    cp.cuda.Device().synchronize()
    steps = [s for _, inst in plan_instances(before) for s in time_steps(cp, inst, reps)]
    ours = profiled_kernels(torch, lambda: session.run_with_iobinding(binding), reps)
    kernels = torch_kernels(torch, module, feeds, torch_dtype, reps)
    session = None
    gc.collect()
    return {"row": row, "precision": precision, "tf32": tf32, "device": torch.cuda.get_device_name(),
            "steps": steps, "torch_kernels": kernels[:40], "ephost_kernels": ours[:40]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="bert_b8", help=f"comma-separated, of {', '.join(ROWS)}, or ARCH@BxS (bert@3x50)")
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--tf32", type=int, default=0, choices=[0, 1])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    import torch

    import host

    env = host.Environment()
    results = []
    for row in args.rows.split(","):
        res = bench_row(row, args.precision, bool(args.tf32), args.reps, torch, env)
        results.append(res)
        print(report(f"{row} {args.precision} tf32={args.tf32} ({res['device']})", res["steps"],
                     res["torch_kernels"], res["ephost_kernels"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
