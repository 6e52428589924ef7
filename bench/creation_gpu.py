"""Session creation on the CUDA EP (issue 29): cold, warm, from a saved context model; run 1 vs run 100.

    python bench/creation_gpu.py [bert gpt2 llama vit resnet50] [--budget 280] [--json out.json]

Each model is made with transformers / torchvision (random weights, eval) and exported with
torch.onnx (TorchScript exporter, opset 17; dynamo where that fails), then every measurement runs
in a fresh process (this script's `_measure`), so nothing is warm in memory:

  cold     an empty $EPHOST_CACHE_DIR (optimized models, NVRTC binaries, algorithm choices) and an
           empty $CUPY_CACHE_DIR;
  warm     a second process on the same caches (the plain model);
  save     a third process writing the context model (ep.context_enable=1; its time is creation
           plus writing);
  context  a fourth process on the context model with empty caches again: only the context serves.

Creation is InferenceSession(...) alone (the Environment and plugin load are reported apart as
`env_s`). Each process then runs the model 100 times: `run1_ms` is the first run, `run100_ms` the
hundredth (outputs copied to the host both times). `EPHOST_BENCH_PROFILE=1` adds each creation's
cProfile top functions, `=2` run 1's too (its time then includes cProfile's overhead)
($EPHOST_BENCH_PROFILE_ROWS rows each; $EPHOST_BENCH_PROFILE_CALLERS=name,... adds those functions'
callers). Models are time-boxed: a model whose budget share
is spent skips its remaining modes (the table says so). Prints a markdown table.

ephost's own modules are compiled to bytecode first (compileall), as `pip install` does for an
installed package: on the GPU machine no bytecode was written for the source tree, and its profiles
showed every process compiling ephost's modules from source (0.2 s of each creation).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUDA = "CUDAExecutionProvider"
MODELS = ("bert", "gpt2", "llama", "vit", "resnet50")
MODES = ("cold", "warm", "save", "context")


# -- models ------------------------------------------------------------------------------------------

def _hf(torch, name: str):
    """(module, example args, input names) of a transformers model with random weights."""
    import transformers as tf

    from tests.models import export

    torch.manual_seed(0)
    ids = lambda b, s, v: torch.randint(0, v, (b, s))  # noqa: E731 - four one-line uses
    if name == "bert":
        model = export._from_config(tf.BertModel, tf.BertConfig())
        mask = torch.ones(8, 128, dtype=torch.int64)
        return export._wrap(torch, model, 2), (ids(8, 128, 30522), mask), ["input_ids", "attention_mask"]
    if name == "gpt2":
        model = export._from_config(tf.GPT2Model, tf.GPT2Config(use_cache=False))
        return export._wrap(torch, model, 1), (ids(1, 128, 50257),), ["input_ids"]
    if name == "llama":
        config = tf.LlamaConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                intermediate_size=2816, vocab_size=32000, max_position_embeddings=512, use_cache=False)
        return export._wrap(torch, export._from_config(tf.LlamaModel, config), 1), (ids(1, 128, 32000),), ["input_ids"]
    model = export._from_config(tf.ViTModel, tf.ViTConfig())  # ViT-B/16 at 224
    return export._wrap(torch, model, 1), (torch.randn(8, 3, 224, 224),), ["pixel_values"]


def export_model(name: str, path: Path) -> dict:
    """Export `name` to `path` (IR 10); returns what the table notes about it."""
    import onnx
    import torch

    t0 = time.perf_counter()
    if name == "resnet50":
        import torchvision

        torch.manual_seed(0)
        module, args, names = torchvision.models.resnet50(weights=None).eval(), (torch.randn(8, 3, 224, 224),), ["X"]
    else:
        module, args, names = _hf(torch, name)
    kw = dict(input_names=names, output_names=["out"])
    try:
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, do_constant_folding=True, **kw)
        exporter = "torchscript"
    except Exception as exc:  # noqa: BLE001 - a torch without it: the dynamo exporter
        print(f"  {name}: TorchScript export failed ({type(exc).__name__}); dynamo export", flush=True)
        torch.onnx.export(module, args, str(path), dynamo=True, opset_version=18, external_data=False, **kw)
        exporter = "dynamo"
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, 10)
    onnx.save(proto, str(path))
    return {"exporter": exporter, "export_s": round(time.perf_counter() - t0, 1), "nodes": len(proto.graph.node)}


# -- one measurement (a fresh process) -----------------------------------------------------------------------

def _feeds(session) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in arg.shape]
        if "int64" in arg.type:
            feeds[arg.name] = (np.ones(shape, np.int64) if "mask" in arg.name else
                               rng.integers(0, 1000, shape, dtype=np.int64))
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _profiler(level: str = "1"):
    """A running cProfile when $EPHOST_BENCH_PROFILE is `level` or more: 1 profiles creation, 2 run 1
    as well (whose time then includes cProfile's overhead)."""
    if os.environ.get("EPHOST_BENCH_PROFILE", "0") < level:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _top(profiler, count: int | None = None) -> list[str]:
    """The functions with the most cumulative time, as 'seconds name (file:line)'
    ($EPHOST_BENCH_PROFILE_ROWS of them, 14 by default), then half as many with the most time of their own
    ('self ...')."""
    import pstats

    profiler.disable()
    count = count or int(os.environ.get("EPHOST_BENCH_PROFILE_ROWS", "14"))
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])  # (file, line, name) -> (cc, nc, tt, ct, callers)
    lines = [f"{ct:.3f}s {name} ({Path(file).name}:{line})" for (file, line, name), (_, _, _, ct, _) in rows[:count]]
    own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:count // 2]  # the leaves: time in the function itself
    lines += [f"self {tt:.3f}s {name} ({Path(file).name}:{line})" for (file, line, name), (_, _, tt, _, _) in own]
    return lines + _callers(stats, os.environ.get("EPHOST_BENCH_PROFILE_CALLERS", ""))


def _callers(stats, names: str, depth: int = 4) -> list[str]:
    """For each function named in `names` (comma-separated, $EPHOST_BENCH_PROFILE_CALLERS), who calls it, by
    the time spent under them, `depth` callers up (the four heaviest at each step): what a hot leaf (cffi's
    type parser, NVRTC) is called for."""
    lines = []

    def walk(key, level):
        callers = stats.stats[key][4]
        for ckey, c in sorted(callers.items(), key=lambda kv: -kv[1][3])[:4]:
            f, ln, n = ckey
            lines.append(f"{'  ' * level}{c[3]:.3f}s {c[1]} calls from {n} ({Path(f).name}:{ln})")
            if level < depth and ckey in stats.stats:
                walk(ckey, level + 1)

    for want in filter(None, names.split(",")):
        for key, (_, nc, _, ct, _) in list(stats.stats.items()):
            if key[2] == want:
                lines.append(f"{ct:.3f}s in {nc} calls of {want} ({Path(key[0]).name}:{key[1]}):")
                walk(key, 1)
    return lines


def measure(model: str, plugin: str, save: str | None) -> dict:
    t0 = time.perf_counter()
    import host
    from host.runtime.options import SessionOptions
    from host.runtime.session import InferenceSession

    env = host.Environment()
    env.register_plugin("cuda", plugin)
    out = {"env_s": time.perf_counter() - t0}
    so = SessionOptions()
    if save:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", save)
    profiler = _profiler()
    t1 = time.perf_counter()
    session = InferenceSession(model, so, providers=[(CUDA, {})], env=env)
    out["create_s"] = time.perf_counter() - t1
    if profiler is not None:
        out["profile"] = _top(profiler)
    from plugin_cuda.device import algo_cache, nvrtc

    out.update(nvrtc={k: v for k, v in nvrtc.stats.items() if k != "compile_seconds"},
               nvrtc_s=nvrtc.stats["compile_seconds"], algo=dict(algo_cache.stats),
               loaded=session.fallbacks["context_loaded"], recompiled=session.fallbacks["context_recompiled"])
    feeds = _feeds(session)
    made = _compiled_so_far()
    out["cupy_at_creation"] = made["cupy"]  # CuPy kernels compiled by the creation (its cache starts empty)
    runs = []
    for i in range(100):
        profiler = _profiler("2") if i == 0 else None  # run 1's lazy work (EPHOST_BENCH_PROFILE=2)
        t = time.perf_counter()
        session.run(None, feeds)
        runs.append((time.perf_counter() - t) * 1e3)
        if profiler is not None:
            out["run1_profile"] = _top(profiler)
    out.update(run1_ms=runs[0], run2_ms=runs[1], run100_ms=runs[-1], median_ms=float(np.median(runs[50:])))
    out["run_compiles"] = {k: v - made[k] for k, v in _compiled_so_far().items()}  # lazy work in the 100 runs
    session.close()
    env.close()
    return out


def _compiled_so_far() -> dict:
    """NVRTC compiles of the plugin's plans, and the kernels CuPy compiled into its disk cache ($CUPY_CACHE_DIR,
    empty when the process started): counted before and after the runs, their difference is what the runs
    compiled (issue 29: nothing)."""
    from plugin_cuda.device import nvrtc

    cupy_dir = Path(os.environ.get("CUPY_CACHE_DIR", ""))
    cupy = sum(1 for _ in cupy_dir.glob("*.cubin")) if cupy_dir.is_dir() else 0
    return {"nvrtc": nvrtc.stats["compiles"], "cupy": cupy}


def _child(model: Path, plugin: str, cache: Path, save: Path | None, timeout: float) -> dict:
    env = dict(os.environ, EPHOST_CACHE_DIR=str(cache), CUPY_CACHE_DIR=str(cache / "cupy"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_measure", str(model), plugin]
    if save is not None:
        cmd.append(str(save))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout, 5))
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def bench_model(name: str, plugin: str, work: Path, budget: float, modes=MODES) -> dict:
    start = time.perf_counter()
    path = work / f"{name}.onnx"
    res = {"model": name, **export_model(name, path)}
    ctx = work / f"{name}_ctx.onnx"
    caches = {"cold": work / f"{name}-cache", "warm": work / f"{name}-cache", "save": work / f"{name}-cache",
              "context": work / f"{name}-cache-ctx"}
    for mode in MODES:
        if mode not in modes:
            res[mode] = {"error": "not asked for (--modes)"}
            continue
        left = budget - (time.perf_counter() - start)
        if left <= 5:
            res[mode] = {"error": "skipped: the model's time budget is spent"}
            continue
        model = ctx if mode == "context" else path
        try:
            res[mode] = _child(model, plugin, caches[mode], ctx if mode == "save" else None, left)
        except subprocess.TimeoutExpired:
            res[mode] = {"error": f"timed out ({left:.0f} s left of the budget)"}
        profile = res[mode].pop("profile", None)
        run1 = res[mode].pop("run1_profile", None)
        print(f"  {name} {mode}: {json.dumps(res[mode])}", flush=True)
        for line in profile or ():
            print(f"    {line}", flush=True)
        for line in run1 or ():
            print(f"    run 1: {line}", flush=True)
    if ctx.is_file():
        res["context_mb"] = round(sum(p.stat().st_size for p in work.glob(f"{name}_ctx*")) / 1e6, 1)
        res["model_mb"] = round(path.stat().st_size / 1e6, 1)
    return res


# -- report --------------------------------------------------------------------------------------------------

def _cell(row: dict, key: str, fmt: str) -> str:
    if "error" in row:
        return "—"
    return format(row[key], fmt)


def _run_compiles(row: dict) -> str:
    done = row.get("run_compiles")
    return "—" if not done else f"{row['cupy_at_creation']} / {done['nvrtc']} / {done['cupy']}"


def table(results: list[dict]) -> str:
    head = ("| model | cold s | warm s | save s | from context s | context / model MB | NVRTC compiles "
            "cold/warm/ctx | searches cold/warm/ctx | ctx run 1 ms | ctx run 100 ms | cold run 1 ms | cold run 100 ms | "
            "ctx: CuPy compiles at creation / NVRTC, CuPy compiles in 100 runs |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        c, w, s, x = (r.get(m, {"error": "missing"}) for m in MODES)
        compiles = "/".join(str(m.get("nvrtc", {}).get("compiles", "—")) for m in (c, w, x))
        searches = "/".join(str(m.get("algo", {}).get("searches", "—")) for m in (c, w, x))
        lines.append(f"| {r['model']} | {_cell(c, 'create_s', '.2f')} | {_cell(w, 'create_s', '.2f')} | "
                     f"{_cell(s, 'create_s', '.2f')} | {_cell(x, 'create_s', '.2f')} | "
                     f"{r.get('context_mb', '—')} / {r.get('model_mb', '—')} | {compiles} | {searches} | "
                     f"{_cell(x, 'run1_ms', '.1f')} | {_cell(x, 'run100_ms', '.1f')} | "
                     f"{_cell(c, 'run1_ms', '.1f')} | {_cell(c, 'run100_ms', '.1f')} | {_run_compiles(x)} |")
    errors = [f"- {r['model']} {m}: {r[m]['error']}" for r in results for m in MODES if "error" in r.get(m, {})]
    return "\n".join(lines + errors)


def _compile_bytecode() -> None:
    """Bytecode for ephost's packages (what an installed package has); quiet, best effort."""
    import compileall

    for package in ("abi", "host", "plugin_cuda"):
        compileall.compile_dir(str(ROOT / package), quiet=2, workers=0)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_measure":
        save = sys.argv[4] if len(sys.argv) > 4 else None
        print(json.dumps(measure(sys.argv[2], sys.argv[3], save)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # no default list with `choices`: Python 3.12's argparse checks a nargs="*" default as one value
    parser.add_argument("models", nargs="*", choices=MODELS, help=f"default: all of {', '.join(MODELS)}")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for all models together")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the measurements to make (context needs save before it)")
    args = parser.parse_args(argv)
    args.models = args.models or list(MODELS)
    _compile_bytecode()
    import build

    plugin = str(build.build_python_plugin("cuda", max(build.PYTHON_PLUGINS["cuda"].versions)))
    import torch

    print(f"session creation on {torch.cuda.get_device_name()}, fresh process per measurement", flush=True)
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.models):
            share = (args.budget - (time.perf_counter() - start)) / (len(args.models) - i)
            try:
                results.append(bench_model(name, plugin, Path(tmp), share, args.modes))
            except Exception as exc:  # noqa: BLE001 - an export failing: the next model still runs
                results.append({"model": name, **{m: {"error": f"{type(exc).__name__}: {exc}"[:200]} for m in MODES}})
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
