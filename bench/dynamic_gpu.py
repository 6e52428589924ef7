"""A dynamic-axes export on the CUDA EP against PyTorch eager, shapes in turn (issue 23's table).

BERT-base (12 layers, hidden 768, random weights from transformers) exported by the TorchScript
exporter at opset 17 with dynamic batch and sequence, one ephost session with the CUDA EP, IOBinding
(inputs in device memory, outputs allocated by the EP), float32 with TF32 off on both sides; the shapes
(batch, seq) run in turn. Per shape: the first run's wall time (new shape), then the median of the
timed runs, against PyTorch eager on the same weights; and the session's plan (compiled partitions,
plan nodes, nodes the host's shape program absorbed).

    python bench/dynamic_gpu.py [--layers 12] [--iters 30] [--shapes 1x16,8x128,3x50,8x128,1x16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def export_bert(torch, layers: int, path: Path):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=12, intermediate_size=3072,
                     vocab_size=30522)
    torch.manual_seed(0)
    model = BertModel(cfg).eval()
    ids = torch.ones((2, 8), dtype=torch.int64)
    mask = torch.ones((2, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}

    class Wrapped(torch.nn.Module):  # positional inputs, one tensor out, for the exporter
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    torch.onnx.export(Wrapped(model), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes})
    return model


def timed(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples)) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--shapes", default="1x16,8x128,3x50,8x128,1x16")
    p.add_argument("--option", action="append", default=[], help="CUDA provider option KEY=VALUE (repeatable)")
    p.add_argument("--churn", type=int, default=0, metavar="N",
                   help="after the table, N runs over N/5 distinct random shapes: device memory and errors")
    args = p.parse_args(argv)
    import cupy as cp
    import torch

    from host.runtime.session import InferenceSession

    torch.backends.cuda.matmul.allow_tf32 = False
    path = Path(tempfile.mkdtemp()) / "bert_dynamic.onnx"
    model = export_bert(torch, args.layers, path).cuda()
    import onnxruntime as ort

    ort_sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    options = {"use_tf32": "0", **dict(o.split("=", 1) for o in args.option)}
    sess = InferenceSession(str(path), providers=[("CUDAExecutionProvider", options)])
    from plugin_cuda.device import nvrtc
    create_s = time.perf_counter() - t0
    plan = sess.plan
    compiled = sum(1 for n in plan.nodes if n.members)
    absorbed = len(sess.shape_program.nodes) if hasattr(sess, "shape_program") else 0
    on_cpu = sum(1 for n in plan.nodes if n.ep is None)
    print(f"session {create_s:.1f} s; plan: {len(plan.nodes)} steps, {compiled} compiled partitions, "
          f"{on_cpu} on the CPU EP, {absorbed} nodes in the host's shape program")
    print("| (batch, seq) | first run ms | NVRTC compiles in it | ephost eager ms | torch eager ms | ratio | "
          "max abs diff vs onnxruntime |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        ids = rng.integers(0, 30522, (b, s)).astype(np.int64)
        mask = np.ones((b, s), np.int64)
        binding = sess.io_binding()
        d_ids, d_mask = cp.asarray(ids), cp.asarray(mask)
        binding.bind_input("input_ids", d_ids)
        binding.bind_input("attention_mask", d_mask)
        binding.bind_output("last_hidden_state")

        def run(binding=binding):
            sess.run_with_iobinding(binding)
        cp.cuda.Device().synchronize()
        t, compiles = time.perf_counter(), nvrtc.stats["compiles"]
        run()
        first = (time.perf_counter() - t) * 1e3
        compiles = nvrtc.stats["compiles"] - compiles
        ours = timed(run, args.iters)
        got = binding.copy_outputs_to_cpu()[0]
        t_ids, t_mask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()

        def torch_run(t_ids=t_ids, t_mask=t_mask):
            with torch.inference_mode():
                model(t_ids, attention_mask=t_mask)
            torch.cuda.synchronize()
        torch_run()
        theirs = timed(torch_run, args.iters)
        # The reference is onnxruntime on the export: with this transformers version the TorchScript
        # export itself differs from the torch module (onnxruntime and ephost agree to ~2e-6).
        ref = ort_sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        print(f"| ({b}, {s}) | {first:.1f} | {compiles} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} | "
              f"{float(np.abs(got - ref).max()):.1e} |")
    if args.churn:
        churn(sess, cp, args.churn)
    sess.close()
    return 0


def churn(sess, cp, runs: int) -> None:
    """`runs` runs over runs // 5 distinct (batch, seq) shapes, in a random order: the plan caches
    stay bounded, so device memory returns to a plateau; prints memory in use every 20% of the runs."""
    rng = np.random.default_rng(1)
    shapes = list({(int(b), int(s)) for b, s in zip(rng.integers(1, 9, 4 * runs), rng.integers(4, 129, 4 * runs))})
    shapes = shapes[:max(1, runs // 5)]
    order = [shapes[i % len(shapes)] for i in rng.permutation(runs)]
    pool = cp.get_default_memory_pool()
    errors, marks = 0, []
    t0 = time.perf_counter()
    for k, (b, s) in enumerate(order):
        feeds = {"input_ids": rng.integers(0, 30522, (b, s)).astype(np.int64), "attention_mask": np.ones((b, s), np.int64)}
        try:
            sess.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - counted and shown once
            errors += 1
            if errors == 1:
                print(f"first error at run {k} shape {(b, s)}: {type(exc).__name__}: {exc}")
        if (k + 1) % max(1, runs // 5) == 0:
            free, total = cp.cuda.runtime.memGetInfo()
            marks.append(f"{(total - free) >> 20} MiB")
    print(f"churn: {runs} runs over {len(shapes)} shapes in {time.perf_counter() - t0:.1f} s, {errors} errors; "
          f"device memory in use after each fifth: {', '.join(marks)} (CuPy pool {pool.used_bytes() >> 20} MiB)")


if __name__ == "__main__":
    raise SystemExit(main())
