"""Half precision on the CUDA EP's per-node kernels (issue 24): checks and a benchmark row.

    python bench/half_gpu.py check [names]    the converted fixtures (tests/models) in fp16 and bf16:
                                              node assignment, accuracy against onnxruntime CPU on the
                                              float32 model, output types, CUDA-graph capture
    python bench/half_gpu.py bert [--precision fp16|bf16] [--batch 8] [--seq 128] [--iters 50]
                                              BERT-base (transformers' default config, random weights),
                                              ephost eager (IOBinding, compiled_plan=0) and replay vs
                                              torch eager and torch CUDA graphs, same weights and precision

The ephost model is the float32 TorchScript export (opset 17) converted by `ephost convert`'s
`convert_precision`; PyTorch runs `model.half()` / `model.to(torch.bfloat16)` of the same module.
Compiled plans are float32 only, so ephost runs node by node (compiled_plan=0).
"""

from __future__ import annotations

import argparse
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
KERNELS = {"compiled_plan": "0", "use_tf32": "0"}
FIXTURES = ["bert_torchscript", "bert_dynamo", "gpt2_dynamo", "gpt2_torchscript", "llama_dynamo", "vit_dynamo",
            "mobilenetv3_dynamo"]


def _dtype(precision: str):
    import ml_dtypes

    return np.dtype(np.float16) if precision == "fp16" else np.dtype(ml_dtypes.bfloat16)


def _env():
    import build
    import host

    plugin = build.build_python_plugin("cuda", max(build.PYTHON_PLUGINS["cuda"].versions))
    env = host.Environment()
    env.register_plugin("cuda", str(plugin))
    return env


_timed = median_us  # bench/timing.py


def _bind(cp, session, feeds: dict, outputs: list):
    """An IOBinding over device copies of feeds and zeroed output buffers (by pointer: CuPy's
    bfloat16 arrays carry no typestr of their own)."""
    binding = session.io_binding()
    ins = {k: cp.asarray(v) for k, v in feeds.items()}
    outs = [cp.zeros(o.shape, o.dtype) for o in outputs]
    for k, arr in ins.items():
        binding.bind_input(k, device_type="cuda", device_id=0, element_type=arr.dtype, shape=arr.shape,
                           buffer_ptr=arr.data.ptr)
    for meta, arr in zip(session.get_outputs(), outs):
        binding.bind_output(meta.name, device_type="cuda", device_id=0, element_type=arr.dtype, shape=arr.shape,
                            buffer_ptr=arr.data.ptr)
    cp.cuda.Device().synchronize()
    return binding, ins, outs


def _relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def check_fixture(name: str, precision: str, env) -> dict:
    import cupy as cp
    import onnx
    import onnxruntime as ort

    from host.precision import convert_precision
    from host.runtime.session import InferenceSession
    from tests.models import load

    dtype = _dtype(precision)
    path, feeds, _ = load(name)
    model = convert_precision(onnx.load(str(path)), precision).SerializeToString()
    feeds = {k: v.astype(dtype) if v.dtype == np.float32 else v for k, v in feeds.items()}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {k: v.astype(np.float32) if v.dtype == dtype else v for k, v in feeds.items()})
    res: dict = {"model": name, "precision": precision}
    session = InferenceSession(model, providers=[(CUDA, KERNELS)], env=env)
    got = session.run(None, feeds)
    assignment = session.node_assignment()
    res["nodes"] = len(assignment)
    res["off_cuda"] = sorted(f"{k} ({v})" for k, v in assignment.items() if v != CUDA)
    res["output_types"] = [f"{g.dtype}" for g in got]
    res["rel_err_vs_ort_f32"] = [round(_relative(g, w), 5) for g, w in zip(got, ref)]
    graph = InferenceSession(model, providers=[(CUDA, {**KERNELS, "enable_cuda_graph": "1"})], env=env)
    binding, _, outs = _bind(cp, graph, feeds, got)
    graph.run_with_iobinding(binding)
    graph.run_with_iobinding(binding)
    res["captured"] = graph.fallbacks["graph_captured"]
    res["replay_rel_vs_eager"] = [round(_relative(cp.asnumpy(o).astype(np.float32), g.astype(np.float32)), 6)
                                  for o, g in zip(outs, got)]
    graph.close()
    session.close()
    return res


def _torch_graph(torch, model, args):
    """A replay of a torch.cuda.CUDAGraph of model(*args), made as bench/dynamic_gpu.py makes it
    (transformers' mask constants from pinned memory); raises where capture is still refused."""
    from bench.dynamic_gpu import torch_graph

    replay = torch_graph(torch, model, args)
    if replay is None:
        raise RuntimeError("torch CUDA graph capture refused (printed above)")
    return replay


def bert_base(torch, seed: int = 0):
    """BERT-base (hidden 768, 12 layers, 12 heads) with random weights, returning last_hidden_state."""
    from transformers import BertConfig, BertModel

    from tests.models import export

    torch.manual_seed(seed)
    return export._wrap(torch, export._from_config(BertModel, BertConfig()), 2)


def bench_bert(precision: str, batch: int, seq: int, iters: int, warmup: int, env) -> dict:
    import cupy as cp
    import onnx
    import torch

    from host.precision import convert_precision
    from host.runtime.session import InferenceSession

    dtype = _dtype(precision)
    tdtype = torch.float16 if precision == "fp16" else torch.bfloat16
    model = bert_base(torch).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30522, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - seq // 8:] = 0  # a padded tail: the mask path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bert_base.onnx"
        t0 = time.perf_counter()
        args = (torch.from_numpy(ids), torch.from_numpy(mask))
        names = dict(input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"])
        try:  # the TorchScript exporter (opset 17), as tests/models' *_torchscript fixtures
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, do_constant_folding=True,
                              **names)
            exporter = "torchscript"
        except Exception as exc:  # noqa: BLE001 - a torch without it: the dynamo exporter (opset 18)
            print(f"  TorchScript export failed ({type(exc).__name__}); dynamo export", flush=True)
            torch.onnx.export(model, args, str(path), dynamo=True, opset_version=18, external_data=False, **names)
            exporter = "dynamo"
        exported = onnx.load(str(path))
        half = convert_precision(exported, precision).SerializeToString()
    res: dict = {"model": f"bert-base b{batch} s{seq}", "precision": precision, "exporter": exporter,
                 "export_s": round(time.perf_counter() - t0, 1), "device": torch.cuda.get_device_name()}
    print(f"  exported and converted in {res['export_s']} s", flush=True)
    tmodel = model.to("cuda", tdtype)
    targs = (torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda())
    with torch.inference_mode():
        ref = tmodel(*targs).float().cpu().numpy()

    def torch_eager():
        with torch.inference_mode():
            tmodel(*targs)
        torch.cuda.synchronize()
    res["torch_eager_us"] = _timed(torch_eager, iters, warmup)
    print(f"  torch eager {res['torch_eager_us']:.0f} us", flush=True)
    try:
        res["torch_graph_us"] = _timed(_torch_graph(torch, tmodel, targs), iters, warmup)
    except Exception as exc:  # noqa: BLE001 - transformers modules may refuse capture
        res["torch_graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        torch.cuda.synchronize()
        try:  # the export translated to torch ops, in the same precision (bench/torch_models.py)
            from bench.torch_models import torch_module_from_onnx

            translated = torch_module_from_onnx(exported, device="cuda", dtype=tdtype)
            res["torch_graph_us"] = _timed(_torch_graph(torch, translated, targs), iters, warmup)
            res["torch_graph_source"] = "the export translated to torch ops"
        except Exception as exc2:  # noqa: BLE001 - a diagnostic; the other figures stand
            res["torch_translated_error"] = f"{type(exc2).__name__}: {str(exc2).splitlines()[0][:120]}"
            torch.cuda.synchronize()
    feeds = {"input_ids": ids, "attention_mask": mask}
    template = [np.zeros(ref.shape, dtype)]
    for mode, extra in (("eager", {}), ("replay", {"enable_cuda_graph": "1"})):
        session = InferenceSession(half, providers=[(CUDA, {**KERNELS, **extra})], env=env)
        assignment = session.node_assignment()
        res["nodes"], res["off_cuda"] = len(assignment), sorted(
            f"{k} ({v})" for k, v in assignment.items() if v != CUDA)
        binding, _, outs = _bind(cp, session, feeds, template)
        session.run_with_iobinding(binding)
        res[f"ephost_{mode}_rel_err_vs_torch"] = round(_relative(cp.asnumpy(outs[0]).astype(np.float32), ref), 5)
        res[f"ephost_{mode}_us"] = _timed(lambda s=session, b=binding: s.run_with_iobinding(b), iters, warmup)
        if mode == "replay":
            res["captured"] = session.fallbacks["graph_captured"]
        print(f"  ephost {mode} {res[f'ephost_{mode}_us']:.0f} us (nodes {res['nodes']}, off CUDA "
              f"{len(res['off_cuda'])})", flush=True)
        session.close()
    res["eager_ratio"] = round(res["ephost_eager_us"] / res["torch_eager_us"], 2)
    if "torch_graph_us" in res:
        res["replay_ratio"] = round(res["ephost_replay_us"] / res["torch_graph_us"], 2)
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["check", "bert"])
    parser.add_argument("names", nargs="*", help="check: fixtures of tests/models (default: FIXTURES)")
    parser.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    env = _env()
    if args.what == "check":
        for name in args.names or FIXTURES:
            for precision in ("fp16", "bf16"):
                try:
                    print(json.dumps(check_fixture(name, precision, env)), flush=True)
                except Exception as exc:  # noqa: BLE001 - one failure must not hide the others
                    print(json.dumps({"model": name, "precision": precision,
                                      "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
        return 0
    print(json.dumps(bench_bert(args.precision, args.batch, args.seq, args.iters, args.warmup, env)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
