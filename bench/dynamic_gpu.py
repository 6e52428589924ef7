"""Dynamic-axes exports on the CUDA EP against PyTorch, shapes in turn (issue 23's goals table).

A transformers model at the issue's goal size (random weights, seed 0; tests/models/make_hf_dynamic.py
GOAL: BERT-base, GPT-2 small, a Llama-style decoder with hidden 1024, 8 layers and GQA, ViT-B/16)
exported with dynamic batch and sequence (ViT: batch) by the TorchScript exporter at opset 17 (or, for
`gpt2_dynamo`, the dynamo exporter at opset 18), one ephost session with the CUDA EP, IOBinding (inputs
in device memory), float32 with TF32 off on both sides; the shapes run in turn. Per shape: the first
run's wall time (new shape) and its NVRTC compiles, the median of the timed runs against PyTorch eager
on the same weights, and with `--graph` the replay of the session's CUDA graph for that shape
(`enable_cuda_graph=1`: one graph per input-shape signature) against a torch.cuda.CUDAGraph of the module
at the same shape. Outputs are checked against onnxruntime's CPU session on the export.

    python bench/dynamic_gpu.py [--model bert|gpt2|gpt2_dynamo|llama|vit] [--graph] [--layers N]
                                [--iters 30] [--shapes 1x16,8x128,3x50,8x128,1x16] [--churn N]
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.timing import median_us  # noqa: E402 - after the repository root is on sys.path

MODELS = ("bert", "gpt2", "gpt2_dynamo", "llama", "vit")
TEXT_SHAPES = "1x16,8x128,3x50,8x128,1x16"
IMAGE_SHAPES = "1,8,3,8,1"


def export_model(torch, name: str, layers: int | None, path: Path):
    """Export `name` at its goal size into `path`; returns (torch module, input names, size dict)."""
    from tests.models import make_hf_dynamic as hf

    arch = name.split("_")[0]
    size = dict(hf.GOAL[arch])
    if layers:
        size["layers"] = layers
    model = hf.make_model(torch, arch, size)
    if name.endswith("_dynamo"):
        wrapped, names, _ = hf._export_dynamo(torch, model, path, size["vocab"])
    else:
        wrapped, names, _ = hf._export_ts(torch, model, arch, path, size.get("vocab", 0), size.get("image", 32))
    return wrapped, names, size


def export_bert(torch, layers: int, path: Path):
    """BERT-base with `layers` layers, exported with dynamic batch and sequence (kept for scripts)."""
    return export_model(torch, "bert", layers, path)[0]


def make_feeds(name: str, names: list[str], size: dict, shape: str, rng) -> dict:
    if name == "vit":
        b, image = int(shape), size.get("image", 32)
        return {"pixel_values": rng.standard_normal((b, 3, image, image)).astype(np.float32)}
    b, s = (int(v) for v in shape.split("x"))
    feeds = {"input_ids": rng.integers(0, size["vocab"], (b, s)).astype(np.int64),
             "attention_mask": np.ones((b, s), np.int64)}
    return {k: feeds[k] for k in names}


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() (bench/timing.py)."""
    return median_us(fn, iters) / 1e3


def _pinned_constants(torch):
    """transformers' masks call torch.tensor(value, device=cuda) in forward, a copy from pageable
    memory that capture refuses; made from pinned memory the copy is captured. The pinned blocks
    are kept (`keep`) for as long as the graph lives, so its replays read the same constants."""
    original, keep = torch.tensor, []

    def tensor(data, *args, device=None, **kwargs):
        if device is None or torch.device(device).type != "cuda":
            return original(data, *args, device=device, **kwargs)
        host = original(data, *args, **kwargs).pin_memory()
        keep.append(host)
        return host.to(device, non_blocking=True)
    return original, tensor, keep


def torch_graph(torch, model, args):
    """A replay function of a torch.cuda.CUDAGraph of model(*args) (static inputs), or None when the
    module refuses capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    original, pinned, keep = _pinned_constants(torch)
    torch.tensor = pinned
    try:
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(3):
                model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            model(*args)
    except RuntimeError as exc:
        print(f"torch CUDA graph refused: {str(exc).splitlines()[0]}")
        return None
    finally:
        torch.tensor = original

    def replay(keep=keep):
        graph.replay()
        torch.cuda.synchronize()
    return replay


def describe(sess) -> str:
    plan = sess.plan
    compiled = sum(1 for n in plan.nodes if n.members)
    absorbed = len(sess.shape_program.nodes) if getattr(sess, "shape_program", None) else 0
    on_cpu = sum(1 for n in plan.nodes if n.ep is None)
    return (f"{len(plan.nodes)} steps, {compiled} compiled partitions, {on_cpu} on the CPU EP, "
            f"{absorbed} nodes in the host's shape program")


def bind(sess, cp, feeds: dict, out_shape=None):
    """Inputs in device memory; the output allocated by the EP, or (for capture) a fixed buffer."""
    binding = sess.io_binding()
    device = {k: cp.asarray(v) for k, v in feeds.items()}
    for k, v in device.items():
        binding.bind_input(k, v)
    if out_shape is None:
        binding.bind_output("last_hidden_state")
    else:
        device["last_hidden_state"] = cp.empty(out_shape, cp.float32)
        binding.bind_output("last_hidden_state", device["last_hidden_state"])
    return binding, device


def run_shape(ctx, shape: str) -> str:
    """One table row: first run, eager ephost vs torch, replay vs torch graph (with --graph)."""
    args, cp, torch, nvrtc = ctx["args"], ctx["cp"], ctx["torch"], ctx["nvrtc"]
    feeds = make_feeds(args.model, ctx["names"], ctx["size"], shape, ctx["rng"])
    binding, keep = bind(ctx["sess"], cp, feeds)

    def run(binding=binding):
        ctx["sess"].run_with_iobinding(binding)
        cp.cuda.Device().synchronize()
    cp.cuda.Device().synchronize()
    t, compiles = time.perf_counter(), nvrtc.stats["compiles"]
    profiled(run, ctx, shape)
    first, compiles = (time.perf_counter() - t) * 1e3, nvrtc.stats["compiles"] - compiles
    if args.dump_compiles and compiles:
        dump_compiles(nvrtc, compiles, Path(args.dump_compiles), shape)
    ours = timed(run, args.iters)
    if args.profile_steady:
        steady_profile(run, args.profile_steady, shape)
    got = binding.copy_outputs_to_cpu()[0]
    t_args = [torch.from_numpy(feeds[k]).cuda() for k in ctx["names"]]

    def torch_run():
        with torch.inference_mode():
            ctx["model"](*t_args)
        torch.cuda.synchronize()
    torch_run()
    theirs = timed(torch_run, args.iters)
    ref = ctx["ort"].run(None, feeds)[0]
    row = f"| {shape} | {first:.1f} | {compiles} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |"
    outputs = [got]
    if ctx["graph_sess"] is not None:
        cells, replayed = replay_cells(ctx, feeds, t_args, got.shape)
        row += cells
        outputs.append(replayed)
    errs = [float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)) for out in outputs]
    return row + " " + " / ".join(f"{e:.1e}" for e in errs) + " |"


def dump_compiles(nvrtc, count: int, folder: Path, shape: str) -> None:
    """Write the sources of the last `count` NVRTC compiles (a new shape's first run) to `folder`, and
    print their kernel names: diffing them against an earlier shape's shows the literal that differs."""
    folder.mkdir(parents=True, exist_ok=True)
    for digest, source in list(nvrtc.recent)[-count:]:
        (folder / f"{shape}-{digest[:12]}.cu").write_text(source)
        names = re.findall(r"__global__\s+void\s+(\w+)", source)
        print(f"  compiled at {shape}: {digest[:12]} ({len(source)} chars): {', '.join(names[:6])}")


def profiled(run, ctx, shape: str) -> None:
    """run(), under cProfile for a new shape after the session's first one when --profile-first."""
    seen = ctx.setdefault("profiled", set())
    if not ctx["args"].profile_first or not seen or shape in seen:
        seen.add(shape)
        run()
        return
    import cProfile
    import io
    import pstats

    seen.add(shape)
    collections = _gc_timer()
    profile = cProfile.Profile()
    profile.runcall(run)
    gc.callbacks.remove(collections)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
    print(f"first run at {shape}:\n" + "\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    threads = sorted(t.name for t in threading.enumerate())
    print(f"  garbage collections in it: {collections.count} ({collections.full} of generation 2), "
          f"{collections.seconds * 1e3:.1f} ms; threads: {threads}")


def steady_profile(run, runs: int, shape: str) -> None:
    """Where the host spends `runs` eager runs at a shape it has run before (cProfile, by own time)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.runcall(lambda: [run() for _ in range(runs)])
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    print(f"{runs} eager runs at {shape}, by own time:\n"
          + "\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


def _gc_timer():
    """A gc callback that counts collections and their time (a pause cProfile charges to whatever runs)."""
    def callback(phase, info):
        if phase == "start":
            callback.started = time.perf_counter()
            return
        callback.count += 1
        callback.full += info["generation"] == 2
        callback.seconds += time.perf_counter() - callback.started

    callback.count, callback.full, callback.seconds, callback.started = 0, 0, 0.0, 0.0
    gc.callbacks.append(callback)
    return callback


def replay_cells(ctx, feeds: dict, t_args, out_shape) -> tuple[str, np.ndarray]:
    """The replay cells of a row (ephost graph, torch graph, ratio) and the replayed output."""
    cp, torch, sess = ctx["cp"], ctx["torch"], ctx["graph_sess"]
    key = tuple(v.shape for v in feeds.values())
    if key in ctx["bindings"]:  # a shape seen before: new data into the buffers its graph reads
        binding, keep = ctx["bindings"][key]
        for k, v in feeds.items():
            keep[k].set(v)
    else:
        binding, keep = ctx["bindings"][key] = bind(sess, cp, feeds, out_shape)

    def replay(binding=binding):
        sess.run_with_iobinding(binding)
        cp.cuda.Device().synchronize()
    replay()  # captures this shape's graph
    ours = timed(replay, ctx["args"].iters)
    replayed = cp.asnumpy(keep["last_hidden_state"])
    theirs_fn = torch_graph(torch, ctx["model"], t_args)
    if theirs_fn is None:
        return f" {ours:.2f} | - | - |", replayed
    theirs = timed(theirs_fn, ctx["args"].iters)
    return f" {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |", replayed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="bert")
    p.add_argument("--layers", type=int, default=None, help="override the goal size's layer count")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--shapes", default=None, help=f"default {TEXT_SHAPES} (ViT: batches {IMAGE_SHAPES})")
    p.add_argument("--graph", action="store_true", help="also replay a CUDA graph per shape against torch's")
    p.add_argument("--option", action="append", default=[], help="CUDA provider option KEY=VALUE (repeatable)")
    p.add_argument("--profile-steady", type=int, default=0, metavar="N",
                   help="also print where the host spends N eager runs at each shape (cProfile, own time)")
    p.add_argument("--dump-compiles", metavar="DIR",
                   help="write each source NVRTC compiles in a shape's first run to DIR, named by shape")
    p.add_argument("--profile-first", action="store_true",
                   help="print where the host spends the first run at each new shape (cProfile, top 25)")
    p.add_argument("--churn", type=int, default=0, metavar="N",
                   help="after the table, N runs over N/5 distinct random shapes: device memory and errors")
    args = p.parse_args(argv)
    import cupy as cp
    import onnxruntime as ort
    import torch

    from host.errors import GraphCaptureError
    from host.runtime.session import InferenceSession
    from plugin_cuda.device import nvrtc

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = Path(tempfile.mkdtemp()) / f"{args.model}_dynamic.onnx"
    model, names, size = export_model(torch, args.model, args.layers, path)
    model = model.cuda()
    options = {"use_tf32": "0", **dict(o.split("=", 1) for o in args.option)}
    t0 = time.perf_counter()
    sess = InferenceSession(str(path), providers=[("CUDAExecutionProvider", options)])
    print(f"{args.model}: session {time.perf_counter() - t0:.1f} s; plan: {describe(sess)}")
    graph_sess = None
    if args.graph:
        try:
            graph_sess = InferenceSession(str(path), providers=[("CUDAExecutionProvider",
                                                                 {**options, "enable_cuda_graph": "1"})])
        except GraphCaptureError as exc:  # the eager rows still run; say why replay has none
            print(f"no CUDA graph: {str(exc)[:400]}")
            args.graph = False
    ctx = dict(args=args, cp=cp, torch=torch, nvrtc=nvrtc, sess=sess, graph_sess=graph_sess, model=model,
               names=names, size=size, rng=np.random.default_rng(0), bindings={},
               ort=ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    head = "| shape | first run ms | NVRTC compiles in it | ephost eager ms | torch eager ms | ratio |"
    if args.graph:
        head += " ephost replay ms | torch graph ms | ratio |"
    print(head + " max rel diff vs onnxruntime (eager and replay) |")
    print("|---" * (head.count("|") - 1 + 1) + "|")
    for shape in (args.shapes or (IMAGE_SHAPES if args.model == "vit" else TEXT_SHAPES)).split(","):
        print(run_shape(ctx, shape), flush=True)
    if args.churn:
        churn(sess, cp, args, names, size)
    sess.close()
    if graph_sess is not None:
        graph_sess.close()
    return 0


def churn(sess, cp, args, names: list[str], size: dict) -> None:
    """`runs` runs over runs // 5 distinct shapes, in a random order: the plan caches stay bounded, so
    device memory returns to a plateau; prints memory in use every 20% of the runs."""
    runs = args.churn
    rng = np.random.default_rng(1)
    if args.model == "vit":
        shapes = [str(b) for b in range(1, 33)][:max(1, runs // 5)]
    else:
        pairs = {(int(b), int(s)) for b, s in zip(rng.integers(1, 9, 4 * runs), rng.integers(4, 129, 4 * runs))}
        shapes = [f"{b}x{s}" for b, s in pairs][:max(1, runs // 5)]
    order = [shapes[i % len(shapes)] for i in rng.permutation(runs)]
    errors, marks = 0, []
    t0 = time.perf_counter()
    for k, shape in enumerate(order):
        try:
            sess.run(None, make_feeds(args.model, names, size, shape, rng))
        except Exception as exc:  # noqa: BLE001 - counted and shown once
            errors += 1
            if errors == 1:
                print(f"first error at run {k} shape {shape}: {type(exc).__name__}: {exc}")
        if (k + 1) % max(1, runs // 5) == 0:
            free, total = cp.cuda.runtime.memGetInfo()
            marks.append(f"{(total - free) >> 20} MiB")
    print(f"churn: {runs} runs over {len(shapes)} shapes in {time.perf_counter() - t0:.1f} s, {errors} errors; "
          f"device memory in use after each fifth: {', '.join(marks)} "
          f"(CuPy pool {cp.get_default_memory_pool().used_bytes() >> 20} MiB)")


if __name__ == "__main__":
    raise SystemExit(main())
