"""Issue 24's and 25's goals tables: float16, bfloat16 and float32 models on the CUDA EP against PyTorch in the
same run.

    python bench/half_goals.py [--rows bert_b1,bert_b8,gpt2,llama,vit,resnet50] [--precision fp16 bf16 fp32 tf32]
                               [--iters 30] [--budget 540] [--no-compile] [--json FILE]

`fp32` is float32 with TF32 off on both sides (`use_tf32=0`; torch's matmul and cuDNN TF32 flags off), `tf32`
float32 with TF32 on on both sides (ephost's default `use_tf32=1`); neither is converted.

Each architecture is exported once in float32 (TorchScript, opset 17, dynamic axes: bench/dynamic_gpu.py's
export at the goal sizes; ResNet-50 from torchvision) and converted by `ephost convert`'s
`convert_precision`; PyTorch runs the same module in the same precision (`model.to(dtype)`). Per row:

- coverage: nodes on the CUDA EP, compiled partitions, nodes left to the CPU EP, whether the graph was captured;
- eager: ephost through IOBinding (inputs on the device) against PyTorch eager;
- replay: ephost with enable_cuda_graph=1 against a torch.cuda.CUDAGraph and against torch.compile
  (default mode, dynamic=False) of the same module at the same shape;
- accuracy: max |ephost - PyTorch| / max |PyTorch| (both in the half type), eager and replay; and each
  run against the float32 module on the same inputs (`torch_vs_fp32`, `eager_vs_fp32`).
`EPHOST_BENCH_PROFILE=1` adds where the host spends the eager runs (cProfile, cumulative).

Times are medians of `--iters` calls (bench/timing.py) in microseconds. torch.compile costs tens of
seconds per shape: rows stop compiling once `--budget` seconds have passed (the cell says so).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.timing import median_us  # noqa: E402 - after the repository root is on sys.path

CUDA = "CUDAExecutionProvider"
# row -> (architecture, batch, sequence); vision rows have no sequence
ROWS = {"bert_b1": ("bert", 1, 128), "bert_b8": ("bert", 8, 128), "gpt2": ("gpt2", 4, 128),
        "llama": ("llama", 4, 128), "vit": ("vit", 8, None), "resnet50": ("resnet50", 8, None)}
PRECISIONS = ("fp16", "bf16")
FLOAT32 = ("fp32", "tf32")  # float32 with TF32 off / on, both sides


def half_dtype(precision: str) -> np.dtype:
    import ml_dtypes

    if precision in FLOAT32:
        return np.dtype(np.float32)
    return np.dtype(np.float16) if precision == "fp16" else np.dtype(ml_dtypes.bfloat16)


def torch_dtype(torch, precision: str):
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def set_torch_tf32(torch, on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def export_arch(torch, arch: str, path: Path):
    """Export `arch` in float32 to `path`; returns (torch module, input names, size dict)."""
    if arch != "resnet50":
        from bench.dynamic_gpu import export_model

        return export_model(torch, arch, None, path)
    import onnx
    import torchvision

    torch.manual_seed(0)
    module = torchvision.models.resnet50(weights=None).eval()
    torch.onnx.export(module, (torch.randn(8, 3, 224, 224),), str(path), dynamo=False, opset_version=17,
                      do_constant_folding=True, input_names=["pixel_values"], output_names=["last_hidden_state"],
                      dynamic_axes={"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}})
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, 10)
    onnx.save(proto, str(path))
    return module, ["pixel_values"], {"image": 224}


def make_feeds(arch: str, names: list, size: dict, batch: int, seq, dtype, rng) -> dict:
    """Inputs of one row: token ids (and an all-ones mask) or images in the half type."""
    if seq is None:
        image = size.get("image", 224)
        return {names[0]: rng.standard_normal((batch, 3, image, image)).astype(np.float32).astype(dtype)}
    feeds = {"input_ids": rng.integers(0, size["vocab"], (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, seq), np.int64)}
    return {k: feeds[k] for k in names}


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def _device_array(cp, arr: np.ndarray):
    """A device copy of `arr`; half types travel as their 16-bit patterns (CuPy has no bfloat16)."""
    if arr.dtype.itemsize == 2 and arr.dtype.kind not in "iu":
        return cp.asarray(arr.view(np.uint16))
    return cp.asarray(arr)


def bind(session, cp, feeds: dict, out_shape: tuple, dtype):
    """An IOBinding: inputs and one output buffer in device memory, bound by pointer with their ONNX types."""
    binding = session.io_binding()
    keep = {k: _device_array(cp, v) for k, v in feeds.items()}
    for k, v in feeds.items():
        binding.bind_input(k, device_type="cuda", device_id=0, element_type=v.dtype, shape=v.shape,
                           buffer_ptr=keep[k].data.ptr)
    out = cp.zeros(out_shape, cp.uint16 if dtype.itemsize == 2 else cp.float32)
    name = session.get_outputs()[0].name
    binding.bind_output(name, device_type="cuda", device_id=0, element_type=dtype, shape=out_shape,
                        buffer_ptr=out.data.ptr)
    cp.cuda.Device().synchronize()
    return binding, keep, out


def coverage(session) -> dict:
    from bench.dynamic_gpu import describe

    assignment = session.node_assignment()
    on_cuda = sum(1 for v in assignment.values() if v == CUDA)
    off = sorted(f"{k} ({v})" for k, v in assignment.items() if v != CUDA)
    return {"nodes": len(assignment), "on_cuda": on_cuda, "off_cuda": off[:8], "plan": describe(session)}


def ephost_cells(model: bytes, feeds: dict, ref: np.ndarray, dtype, iters: int, env,
                 exact: np.ndarray | None = None, tf32: bool = False) -> dict:
    """Eager and replay times, accuracy against PyTorch (and, given `exact`, against the float32
    module), coverage and capture of one row."""
    import cupy as cp

    from host.runtime.session import InferenceSession

    res: dict = {}
    for mode, extra in (("eager", {}), ("replay", {"enable_cuda_graph": "1"})):
        session = InferenceSession(model, providers=[(CUDA, {"use_tf32": str(int(tf32)), **extra})], env=env)
        binding, _, out = bind(session, cp, feeds, ref.shape, dtype)

        def run(s=session, b=binding):
            s.run_with_iobinding(b)
            cp.cuda.Device().synchronize()
        run()
        got = cp.asnumpy(out).view(dtype).astype(np.float32)
        res[f"{mode}_rel_err"] = round(relative(got, ref), 5)
        if exact is not None:
            res[f"{mode}_vs_fp32"] = round(relative(got, exact), 5)
        res[f"ephost_{mode}_us"] = median_us(run, iters)
        if mode == "eager":
            res.update(_profiled_runs(run, iters))
        if mode == "eager":
            res.update(coverage(session))
        else:
            res["captured"] = bool(session.fallbacks.get("graph_captured"))
        session.close()
    return res


def _profiled_runs(run, iters: int) -> dict:
    """With EPHOST_BENCH_PROFILE=1: where the host spends `iters` eager runs (cProfile's top functions
    by cumulative time; bench/creation_gpu.py's helpers)."""
    from bench.creation_gpu import _profiler, _top

    profiler = _profiler("1")
    if profiler is None:
        return {}
    for _ in range(iters):
        run()
    return {"eager_profile": _top(profiler)}


def _torch_arg(torch, arr: np.ndarray, dtype):
    """A CUDA tensor of a feed; half feeds go through float32 (torch.from_numpy has no bfloat16)."""
    if arr.dtype.kind in "iub":
        return torch.from_numpy(arr).cuda()
    return torch.from_numpy(arr.astype(np.float32)).cuda().to(dtype)


def torch_cells(torch, module, feeds: dict, iters: int, compile_ok: bool) -> tuple[dict, np.ndarray]:
    """PyTorch eager, CUDA graph and torch.compile times of one row, and its output (float32)."""
    from bench.dynamic_gpu import torch_graph

    dtype = next(p.dtype for p in module.parameters())
    args = [_torch_arg(torch, v, dtype) for v in feeds.values()]

    def eager(fn=module):
        with torch.inference_mode():
            fn(*args)
        torch.cuda.synchronize()
    with torch.inference_mode():
        ref = module(*args).float().cpu().numpy()
    res = {"torch_eager_us": median_us(eager, iters)}
    replay = torch_graph(torch, module, args)
    res["torch_graph_us"] = median_us(replay, iters) if replay is not None else None
    if not compile_ok:
        res["torch_compile_us"] = "skipped (budget or --no-compile)"
        return res, ref
    t0 = time.perf_counter()
    try:
        compiled = torch.compile(module, dynamic=False)
        eager(compiled)
        res["torch_compile_s"] = round(time.perf_counter() - t0, 1)
        res["torch_compile_us"] = median_us(lambda: eager(compiled), iters)
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the other figures stand
        res["torch_compile_us"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return res, ref


def float32_output(torch, module, feeds: dict, precision: str) -> np.ndarray:
    """The float32 module's output (TF32 off) on the same (half-rounded) inputs: the reference both runs of
    a row are judged against, to tell PyTorch's own rounding from ephost's."""
    args = [_torch_arg(torch, v, torch.float32) for v in feeds.values()]
    set_torch_tf32(torch, False)
    try:
        with torch.inference_mode():
            return module(*args).float().cpu().numpy()
    finally:
        set_torch_tf32(torch, precision == "tf32")


def ratios(res: dict) -> dict:
    def ratio(ours, theirs):
        return round(res[ours] / res[theirs], 2) if isinstance(res.get(theirs), float) else None
    return {"eager_ratio": ratio("ephost_eager_us", "torch_eager_us"),
            "replay_vs_graph": ratio("ephost_replay_us", "torch_graph_us"),
            "replay_vs_compile": ratio("ephost_replay_us", "torch_compile_us")}


def bench_arch(arch: str, rows: list, precisions: list, args, env, deadline: float) -> list:
    import onnx
    import torch

    from host.precision import convert_precision

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{arch}.onnx"
        t0 = time.perf_counter()
        module, names, size = export_arch(torch, arch, path)
        exported = onnx.load(str(path))
        print(f"# {arch}: exported in {time.perf_counter() - t0:.1f} s", flush=True)
    module = module.to("cuda")
    for precision in precisions:
        dtype = half_dtype(precision)
        set_torch_tf32(torch, precision == "tf32")
        model = (exported if precision in FLOAT32 else convert_precision(exported, precision)).SerializeToString()
        # a copy per precision: converting the float32 module in place would round bf16 from fp16
        tmodule = copy.deepcopy(module).to("cuda", torch_dtype(torch, precision))
        for row in rows:
            _, batch, seq = ROWS[row]
            feeds = make_feeds(arch, names, size, batch, seq, dtype, np.random.default_rng(0))
            res = {"row": row, "precision": precision, "device": torch.cuda.get_device_name()}
            compile_ok = args.compile and time.perf_counter() < deadline
            try:
                cells, ref = torch_cells(torch, tmodule, feeds, args.iters, compile_ok)
                exact = float32_output(torch, module, feeds, precision)
                res.update(cells, torch_vs_fp32=round(relative(ref, exact), 5))
                res.update(ephost_cells(model, feeds, ref, dtype, args.iters, env, exact, precision == "tf32"))
                res.update(ratios(res))
            except Exception as exc:  # noqa: BLE001 - one failure must not hide the other rows
                res["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(res), flush=True)
            results.append(res)
            torch.cuda.empty_cache()
        del tmodule
    return results


def table(results: list) -> str:
    lines = ["| row | precision | on CUDA | plan | captured | eager / torch eager | replay / torch graph | "
             "replay / torch.compile | error (eager, replay) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['precision']} | error: {r['error'][:120]} |||||||")
            continue
        lines.append(f"| {r['row']} | {r['precision']} | {r['on_cuda']}/{r['nodes']} | {r['plan']} | "
                     f"{r['captured']} | {r['eager_ratio']} | {r['replay_vs_graph']} | {r['replay_vs_compile']} | "
                     f"{r['eager_rel_err']:.1e}, {r['replay_rel_err']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS + FLOAT32, default=list(PRECISIONS))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds after which torch.compile is skipped")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; allowed: {', '.join(ROWS)}")
    from bench.half_gpu import _env

    env, deadline, results = _env(), time.perf_counter() + args.budget, []
    for arch in dict.fromkeys(ROWS[r][0] for r in rows):
        results += bench_arch(arch, [r for r in rows if ROWS[r][0] == arch], args.precision, args, env, deadline)
    print(table(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
