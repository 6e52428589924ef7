"""CUDA benchmark: ephost's CUDA plugin against PyTorch on the same weights, eager and with CUDA graphs.

    python build.py                                   # builds build/lib/libephost_cuda_v<N>.so
    python bench/cuda_bench.py [--iters 1000] [--warmup 50] [--json results.json]

Models: MLP 8 x 256 (batch 1), MLP 8 x 1024 (batch 1), transformer block (hidden 256, 4 heads,
seq 128, batch 1), float32, from host.cli.zoo. The PyTorch side is bench.torch_models, an interpreter
of the same ONNX graph (same initializers). Per model, in one process:

1. correctness: ephost (CuPy-bound IOBinding) vs torch, max abs diff, allclose(rtol 1e-2), TF32 as set;
2. eager: run_with_iobinding (default synchronous) vs torch forward + torch.cuda.synchronize();
3. graph replay: ephost with enable_cuda_graph=1 (first call = warm-up + capture, timed), then
   synchronous replay vs torch.cuda.CUDAGraph replay + stream sync vs the floor (ephost's own captured
   cupy Graph launched raw + stream sync); and the asynchronous call alone
   (disable_synchronize_execution_providers=1);
4. steady-state allocation: the EP pool's total_bytes() and cudaMemGetInfo free bytes around N replays.

Without PyTorch, CUDA or CuPy it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EP_NAME = "CUDAExecutionProvider"
PERCENTILES = (50, 90, 99)
RTOL = ATOL = 1e-2
GOAL_RATIO = 1.05
GOAL_FLOOR_US = 10.0

MODEL_SPECS = {
    "mlp-8x256": ("MLP 8 layers x 256, batch 1", "mlp", dict(layers=8, hidden=256, batch=1)),
    "mlp-8x1024": ("MLP 8 layers x 1024, batch 1", "mlp", dict(layers=8, hidden=1024, batch=1)),
    "transformer-256": ("transformer block h256, 4 heads, seq 128, batch 1", "transformer_block",
                        dict(batch=1, seq=128, hidden=256, heads=4, ffn=1024)),
    "transformer-1024": ("transformer block h1024, 16 heads, seq 128, batch 8", "transformer_block",
                         dict(batch=8, seq=128, hidden=1024, heads=16, ffn=4096)),
}

# Session creation (optimize + compile) in a fresh process: cold with an empty kernel cache
# directory, warm with the one the cold run filled (CuPy's on-disk cache of compiled modules).
_CREATE_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from host.cli import zoo
from host.plugins.environment import Environment
from host.runtime.session import InferenceSession
env = Environment()
env.register_plugin("cuda", sys.argv[2])
model = getattr(zoo, sys.argv[3])(**json.loads(sys.argv[4]))
t0 = time.perf_counter()
sess = InferenceSession(model, providers=[("CUDAExecutionProvider", {})], env=env)
t1 = time.perf_counter()
sess.run(None, zoo.random_inputs(model))
t2 = time.perf_counter()
print(json.dumps({"create_ms": (t1 - t0) * 1e3, "first_run_ms": (t2 - t1) * 1e3}))
"""


def log(msg: str = "") -> None:
    print(msg, flush=True)


def report_error(where: str, exc: BaseException, res: dict | None = None) -> None:
    log(f"ERROR in {where}: {type(exc).__name__}: {exc}")
    traceback.print_exc(file=sys.stdout)
    sys.stdout.flush()
    if res is not None:
        res.setdefault("errors", {})[where] = f"{type(exc).__name__}: {exc}"


# -- prerequisites ------------------------------------------------------------------------------------

def check_prerequisites():
    """(torch, cupy) or (None, reason)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means no PyTorch
        return None, f"PyTorch is not importable ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return None, f"PyTorch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)"
    except Exception as exc:  # noqa: BLE001
        return None, f"PyTorch cannot query CUDA ({type(exc).__name__}: {exc})"
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001
        return None, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return None, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "CuPy sees no CUDA device (getDeviceCount() == 0)"
    return (torch, cupy), ""


def plugin_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    import abi

    return ROOT / "build" / "lib" / f"libephost_cuda_v{abi.ABI_VERSION}.so"


def ensure_plugin(path: Path, explicit: bool) -> bool:
    if path.is_file():
        return True
    if explicit:
        log(f"cuda_bench: plugin library {path} does not exist")
        return False
    log(f"cuda_bench: {path} is missing; building it: {sys.executable} build.py --plugin cuda")
    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "--plugin", "cuda"], cwd=ROOT)
    if proc.returncode != 0 or not path.is_file():
        log(f"cuda_bench: building the CUDA plugin failed (exit {proc.returncode}); run `python build.py` "
            "from the repository root and try again")
        return False
    return True


# -- timing ------------------------------------------------------------------------------------------------

def stats_us(samples_ns: np.ndarray) -> dict:
    s = samples_ns.astype(np.float64) / 1e3
    out = {f"p{p}_us": float(np.percentile(s, p)) for p in PERCENTILES}
    out.update(mean_us=float(s.mean()), std_us=float(s.std()), min_us=float(s.min()), max_us=float(s.max()),
               iters=int(s.size))
    return out


def time_calls(fn, iters: int, warmup: int, after=None) -> dict:
    """Time `fn()` alone, `iters` times after `warmup` calls; `after()` runs outside the timed region.

    The garbage collector is off during the loop (as timeit does), for both sides alike.
    """
    clock = time.perf_counter_ns
    for _ in range(warmup):
        fn()
        if after is not None:
            after()
    samples = np.empty(iters, np.int64)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if after is None:
            for i in range(iters):
                t0 = clock()
                fn()
                samples[i] = clock() - t0
        else:
            for i in range(iters):
                t0 = clock()
                fn()
                samples[i] = clock() - t0
                after()
    finally:
        if was_enabled:
            gc.enable()
    return stats_us(samples)


# -- ephost internals reached for the floor and the pool ---------------------------------------------------

def cuda_ep_objects() -> dict[int, object]:
    """Every live CudaEp object of every loaded CUDA plugin runtime, by id."""
    from abi import sdk

    found = {}
    for name, rt in sdk.runtimes().items():
        if not name.startswith("_ephost_cuda"):
            continue
        for obj in list(rt._objects.values()):
            if type(obj).__name__ == "CudaEp":
                found[id(obj)] = obj
    return found


def new_cuda_ep(before: dict[int, object]):
    """The CudaEp created since `before` was taken (the session's), or None."""
    new = [o for k, o in cuda_ep_objects().items() if k not in before]
    return new[-1] if new else None


def captured_graph(ep, gid: int = 0):
    """ephost's Captured record (graph, state.stream) for graph id `gid` on this thread, or None."""
    if ep is None:
        return None
    tls = getattr(ep.graphs._tls, "v", None)
    return None if tls is None else tls.graphs.get(gid)


# -- comparisons -----------------------------------------------------------------------------------------

def compare(a: np.ndarray, b: np.ndarray) -> dict:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        return {"shape_mismatch": [list(a.shape), list(b.shape)], "allclose": False,
                "max_abs_diff": float("nan"), "max_rel_diff": float("nan")}
    diff = np.abs(a - b)
    rel = diff / np.maximum(np.abs(b), 1e-6)
    return {"max_abs_diff": float(diff.max()) if diff.size else 0.0,
            "max_rel_diff": float(rel.max()) if rel.size else 0.0,
            "allclose": bool(np.allclose(a, b, rtol=RTOL, atol=ATOL)),
            "max_abs_ref": float(np.abs(b).max()) if b.size else 0.0}


def fmt_cmp(c: dict | None) -> str:
    if not c:
        return "n/a"
    if "shape_mismatch" in c:
        return f"shape {c['shape_mismatch'][0]} vs {c['shape_mismatch'][1]}"
    return f"{c['max_abs_diff']:.2e}" + ("" if c["allclose"] else " (NOT close)")


# -- one model ---------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, torch, cupy, env):
        self.args = args
        self.torch = torch
        self.cp = cupy
        self.env = env
        self.tf32 = "1" if args.tf32 else "0"

    def sync(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    def session(self, model, **options):
        from host.runtime.session import InferenceSession

        opts = {"use_tf32": self.tf32, **{k: str(v) for k, v in options.items()}}
        before = cuda_ep_objects()
        sess = InferenceSession(model, providers=[(EP_NAME, opts)], env=self.env)
        ep = new_cuda_ep(before)
        assignment = sess.node_assignment()
        off_ep = sorted(n for n, e in assignment.items() if e != EP_NAME)
        return sess, ep, {"options": opts, "nodes": len(assignment), "nodes_not_on_cuda_ep": off_ep}

    def bind(self, sess, feeds: dict, out_specs: dict):
        cp = self.cp
        ins = {k: cp.asarray(v) for k, v in feeds.items()}
        outs = {k: cp.empty(shape, dtype) for k, (shape, dtype) in out_specs.items()}
        b = sess.io_binding()
        for k, v in ins.items():
            b.bind_input(k, v)
        for k, v in outs.items():
            b.bind_output(k, v)
        self.sync()  # CuPy filled the inputs on the legacy stream; the EP computes on its own streams
        return b, ins, outs

    def run_model(self, key: str) -> dict:
        from bench.torch_models import torch_module_from_onnx
        from host.cli import zoo

        torch, cp = self.torch, self.cp
        title, builder, kwargs = MODEL_SPECS[key]
        res: dict = {"model": key, "description": title, "builder": f"zoo.{builder}({kwargs})"}
        log(f"\n=== {key}: {title} ===")
        model = getattr(zoo, builder)(**kwargs)
        feeds = zoo.random_inputs(model, seed=0)
        feeds2 = zoo.random_inputs(model, seed=1)
        res["onnx_nodes"] = len(model.graph.node)

        # -- PyTorch module on the same weights -----------------------------------------------------
        tm = torch_module_from_onnx(model, device="cuda")
        x_t = [torch.from_numpy(np.ascontiguousarray(feeds[n])).cuda() for n in tm.input_names]
        with torch.inference_mode():
            y = tm(*x_t)
        outs_t = list(y) if isinstance(y, tuple) else [y]
        torch.cuda.synchronize()
        torch_ref = {n: t.detach().cpu().numpy() for n, t in zip(tm.output_names, outs_t)}
        out_specs = {n: (tuple(a.shape), a.dtype) for n, a in torch_ref.items()}
        first_out = tm.output_names[0]
        with torch.inference_mode():
            y2 = tm(*[torch.from_numpy(np.ascontiguousarray(feeds2[n])).cuda() for n in tm.input_names])
        y2 = list(y2) if isinstance(y2, tuple) else [y2]
        torch_ref2 = {n: t.detach().cpu().numpy() for n, t in zip(tm.output_names, y2)}
        fp64_ref = None
        try:
            tm64 = torch_module_from_onnx(model, device="cuda", dtype=torch.float64)
            with torch.inference_mode():
                r = tm64(*[torch.from_numpy(np.ascontiguousarray(feeds[n])).cuda().double() for n in tm.input_names])
            r = list(r) if isinstance(r, tuple) else [r]
            fp64_ref = {n: t.cpu().numpy() for n, t in zip(tm.output_names, r)}
            del tm64
        except Exception as exc:  # noqa: BLE001 - the fp64 reference is a diagnostic only
            report_error(f"{key}/fp64-reference", exc, res)

        corr: dict = {"tf32_ephost": self.tf32 == "1",
                      "tf32_torch": bool(torch.backends.cuda.matmul.allow_tf32),
                      "torch_float32_matmul_precision": torch.get_float32_matmul_precision()}
        res["correctness"] = corr
        if fp64_ref is not None:
            corr["torch_vs_fp64"] = compare(torch_ref[first_out], fp64_ref[first_out])

        # -- 1. eager ----------------------------------------------------------------------------------
        eager_sess = None
        try:
            eager_sess, eager_ep, info = self.session(model)
            res["eager_session"] = info
            if info["nodes_not_on_cuda_ep"]:
                log(f"WARNING: {len(info['nodes_not_on_cuda_ep'])} node(s) not on {EP_NAME}: "
                    f"{info['nodes_not_on_cuda_ep'][:10]}")
            binding, _, e_out = self.bind(eager_sess, feeds, out_specs)
            eager_sess.run_with_iobinding(binding)
            self.sync()
            names = binding.output_names()
            got = binding.copy_outputs_to_cpu()[names.index(first_out)]
            in_buffer = cp.asnumpy(e_out[first_out])
            corr["eager_output_in_bound_buffer"] = bool(np.array_equal(in_buffer, got))
            if not corr["eager_output_in_bound_buffer"]:
                log(f"WARNING: {key}: the eager output was not written into the bound CuPy buffer")
            corr["ephost_vs_torch"] = compare(got, torch_ref[first_out])
            if fp64_ref is not None:
                corr["ephost_vs_fp64"] = compare(got, fp64_ref[first_out])
            log(f"correctness (TF32 ephost={corr['tf32_ephost']}, torch={corr['tf32_torch']}): "
                f"max |ephost - torch| = {corr['ephost_vs_torch']['max_abs_diff']:.3e} "
                f"(allclose rtol={RTOL}, atol={ATOL}: {corr['ephost_vs_torch']['allclose']})"
                + (f"; vs fp64: ephost {corr['ephost_vs_fp64']['max_abs_diff']:.3e}, "
                   f"torch {corr['torch_vs_fp64']['max_abs_diff']:.3e}" if fp64_ref is not None else ""))
            res["eager"] = self.bench_eager(key, eager_sess, eager_ep, binding, tm, x_t, res)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next section
            report_error(f"{key}/eager", exc, res)
        finally:
            if eager_sess is not None:
                try:
                    eager_sess.close()
                except Exception as exc:  # noqa: BLE001
                    report_error(f"{key}/eager-close", exc, res)

        # -- 1b. compiled plans: before (per-node kernels) / after (plan) / auto-graph, creation time -----
        try:
            res["plan"] = self.bench_plan(key, model, feeds, out_specs, first_out, torch_ref, res)
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/plan", exc, res)

        # -- 2. + 3. graphs and allocation -----------------------------------------------------------
        try:
            res["graph"] = self.bench_graph(key, model, feeds, feeds2, out_specs, first_out, torch_ref,
                                            torch_ref2, tm, x_t, res)
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/graph", exc, res)
        return res

    def bench_eager(self, key, sess, ep, binding, tm, x_t, res) -> dict:
        torch, args = self.torch, self.args
        out: dict = {}
        # Does run_with_iobinding return with the GPU done? (a stream still busy right after return says no)
        streams = [s.stream for s in ep.streams.values()] if ep is not None else []
        busy = 0
        for _ in range(20):
            sess.run_with_iobinding(binding)
            busy += sum(not s.done for s in streams)
        self.sync()
        out["sync_check"] = ("unknown (EP object not found)" if ep is None or not streams
                             else "returns with its streams idle" if busy == 0
                             else f"returned {busy} time(s) in 20 with an EP stream still busy")
        if busy:
            log(f"WARNING: {key}: ephost eager run_with_iobinding returned with work still queued; "
                "the ratio uses the 'call + cudaDeviceSynchronize' timing")
        try:
            out["ephost"] = time_calls(lambda: sess.run_with_iobinding(binding), args.iters, args.warmup)
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/eager/ephost", exc, res)
        try:
            rt = self.cp.cuda.runtime

            def call_and_sync():
                sess.run_with_iobinding(binding)
                rt.deviceSynchronize()
            out["ephost_plus_device_sync"] = time_calls(call_and_sync, args.iters, args.warmup)
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/eager/ephost+sync", exc, res)
        try:
            sync = torch.cuda.synchronize

            def torch_eager():
                tm(*x_t)
                sync()
            with torch.inference_mode():
                out["torch"] = time_calls(torch_eager, args.iters, args.warmup)
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/eager/torch", exc, res)
        mine = out.get("ephost_plus_device_sync" if busy else "ephost")
        if mine and out.get("torch"):
            out["ratio_p50"] = mine["p50_us"] / out["torch"]["p50_us"]
            out["ratio_basis"] = "ephost call + device sync" if busy else "ephost call"
        self._log_stats("eager ephost", out.get("ephost"))
        self._log_stats("eager ephost + device sync", out.get("ephost_plus_device_sync"))
        self._log_stats("eager torch", out.get("torch"))
        if "ratio_p50" in out:
            log(f"eager ephost/torch at p50: {out['ratio_p50']:.2f}x ({out['ratio_basis']})")
        return out

    def plan_counts(self, ep) -> dict:
        fns = ep.__dict__.get("plan_functions", []) if ep is not None else []
        return {"partitions": len(fns), "plan_nodes": sum(f.plan.num_nodes for f in fns),
                "kernels": sum(f.plan.num_kernels for f in fns), "cublas": sum(f.plan.num_cublas for f in fns),
                "arena_bytes": sum(f.plan.arena_bytes for f in fns),
                "build_ms": sum(f.plan.build_seconds for f in fns) * 1e3}

    def timed_session(self, key, model, feeds, out_specs, first_out, torch_ref, res, label, **options) -> dict:
        """One session with `options`: correctness vs torch, eager timing, node/kernel counts."""
        t0 = time.perf_counter()
        sess, ep, info = self.session(model, **options)
        out: dict = {"create_ms": (time.perf_counter() - t0) * 1e3, "nodes": info["nodes"],
                     "nodes_not_on_cuda_ep": len(info["nodes_not_on_cuda_ep"])}
        try:
            out.update(self.plan_counts(ep))
            binding, _, outs = self.bind(sess, feeds, out_specs)
            sess.run_with_iobinding(binding)
            self.sync()
            out["vs_torch"] = compare(self.cp.asnumpy(outs[first_out]), torch_ref[first_out])
            out["eager"] = time_calls(lambda: sess.run_with_iobinding(binding), self.args.iters, self.args.warmup)
            out["vs_torch_after_timing"] = compare(self.cp.asnumpy(outs[first_out]), torch_ref[first_out])
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/plan/{label}", exc, res)
        finally:
            sess.close()
        self._log_stats(f"{label} eager", out.get("eager"))
        log(f"  {label}: {out.get('partitions', 0)} partition(s), {out.get('plan_nodes', 0)} nodes -> "
            f"{out.get('kernels', 0)} kernels + {out.get('cublas', 0)} cuBLAS; session created in "
            f"{out['create_ms']:.0f} ms; vs torch {fmt_cmp(out.get('vs_torch'))}")
        return out

    def creation_times(self, key) -> dict:
        import tempfile

        _, builder, kwargs = MODEL_SPECS[key]
        out: dict = {}
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, CUPY_CACHE_DIR=cache)
            for label in ("cold", "warm"):
                proc = subprocess.run([sys.executable, "-c", _CREATE_SCRIPT, str(ROOT), str(plugin_path(self.args.plugin)),
                                       builder, json.dumps(kwargs)], env=env, capture_output=True, text=True,
                                      timeout=300)
                if proc.returncode != 0:
                    out[label] = {"error": proc.stderr[-2000:]}
                    continue
                out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        log(f"  session creation (optimize + compile), fresh process: cold {out.get('cold')}, warm {out.get('warm')}")
        return out

    def bench_plan(self, key, model, feeds, out_specs, first_out, torch_ref, res) -> dict:
        out: dict = {}
        torch_eager = res.get("eager", {}).get("torch")
        for label, opts in (("per_node", {"compiled_plan": 0}), ("plan", {}), ("plan_auto_graph", {"plan_auto_graph": 1})):
            out[label] = self.timed_session(key, model, feeds, out_specs, first_out, torch_ref, res, label, **opts)
            mine = out[label].get("eager")
            if mine and torch_eager:
                out[label]["ratio_to_torch_p50"] = mine["p50_us"] / torch_eager["p50_us"]
                log(f"  {label} / torch eager at p50: {out[label]['ratio_to_torch_p50']:.2f}x")
        try:
            out["creation"] = self.creation_times(key)
        except Exception as exc:  # noqa: BLE001
            report_error(f"{key}/plan/creation", exc, res)
        return out

    def torch_graph(self, tm, x_t):
        """(graph, static inputs, static outputs) by the standard recipe."""
        torch = self.torch
        static_x = [x.clone() for x in x_t]
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    tm(*static_x)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_y = tm(*static_x)
        torch.cuda.synchronize()
        static_y = list(static_y) if isinstance(static_y, tuple) else [static_y]
        return g, static_x, static_y

    def bench_graph(self, key, model, feeds, feeds2, out_specs, first_out, torch_ref, torch_ref2, tm, x_t,
                    res) -> dict:
        from host.runtime.session import RunOptions

        torch, cp, args = self.torch, self.cp, self.args
        out: dict = {}
        corr = res["correctness"]
        sess, ep, info = self.session(model, enable_cuda_graph=1,
                                      min_num_runs_before_cuda_graph_capture=args.min_runs)
        try:
            out["session"] = info
            binding, g_in, g_out = self.bind(sess, feeds, out_specs)
            ro_sync = RunOptions()
            ro_async = RunOptions()
            ro_async.add_run_config_entry("disable_synchronize_execution_providers", "1")

            # warm-up + capture: the first run_with_iobinding
            self.sync()
            t0 = time.perf_counter_ns()
            sess.run_with_iobinding(binding, ro_sync)
            self.sync()
            out["warmup_capture_ms"] = (time.perf_counter_ns() - t0) / 1e6
            out["internal_runs_before_capture"] = args.min_runs + 1
            cap = captured_graph(ep, 0)
            out["captured"] = bool(sess.fallbacks.get("graph_captured", 0)) and cap is not None
            log(f"graph: warm-up + capture {out['warmup_capture_ms']:.1f} ms "
                f"(min_num_runs_before_cuda_graph_capture={args.min_runs}); captured: {out['captured']}")
            if not out["captured"]:
                log(f"WARNING: {key}: no CUDA graph was captured (fallbacks: {dict(sess.fallbacks)}, "
                    f"EP object found: {ep is not None}); replay numbers below are eager runs")
            corr["graph_capture_run_vs_torch"] = compare(cp.asnumpy(g_out[first_out]), torch_ref[first_out])

            # replay with new data copied into the bound input: the graph must read it
            sess.run_with_iobinding(binding, ro_sync)
            corr["graph_replay_vs_torch"] = compare(cp.asnumpy(g_out[first_out]), torch_ref[first_out])
            for k, v in feeds2.items():
                g_in[k][...] = cp.asarray(v)
            self.sync()
            sess.run_with_iobinding(binding, ro_sync)
            corr["graph_replay_new_input_vs_torch"] = compare(cp.asnumpy(g_out[first_out]), torch_ref2[first_out])
            log(f"graph correctness: capture run {fmt_cmp(corr['graph_capture_run_vs_torch'])}, "
                f"replay {fmt_cmp(corr['graph_replay_vs_torch'])}, "
                f"replay after new input {fmt_cmp(corr['graph_replay_new_input_vs_torch'])}")

            # steady replay, synchronous
            try:
                out["ephost_replay"] = time_calls(lambda: sess.run_with_iobinding(binding, ro_sync),
                                                  args.iters, args.warmup)
            except Exception as exc:  # noqa: BLE001
                report_error(f"{key}/graph/ephost-replay", exc, res)

            # the floor: ephost's own cupy Graph, launched raw on its stream
            if cap is not None:
                try:
                    graph, stream = cap.graph, cap.state.stream

                    def raw():
                        graph.launch(stream)
                        stream.synchronize()
                    out["raw_cupy_graph"] = time_calls(raw, args.iters, args.warmup)
                    out["raw_cupy_graph_launch_call"] = time_calls(lambda: graph.launch(stream), args.iters,
                                                                   args.warmup, after=stream.synchronize)
                except Exception as exc:  # noqa: BLE001
                    report_error(f"{key}/graph/raw-floor", exc, res)

            # asynchronous replay: the call alone, synchronised outside the timed region
            try:
                after = cap.state.stream.synchronize if cap is not None else self.sync
                out["ephost_replay_async_call"] = time_calls(lambda: sess.run_with_iobinding(binding, ro_async),
                                                             args.iters, args.warmup, after=after)
                self.sync()
                sess.run_with_iobinding(binding, ro_async)
                self.sync()
                corr["graph_async_replay_vs_torch"] = compare(cp.asnumpy(g_out[first_out]),
                                                              torch_ref2[first_out])
            except Exception as exc:  # noqa: BLE001
                report_error(f"{key}/graph/ephost-async", exc, res)

            # torch.cuda.CUDAGraph
            try:
                g, static_x, static_y = self.torch_graph(tm, x_t)
                cur = torch.cuda.current_stream()
                g.replay()
                cur.synchronize()
                corr["torch_graph_vs_torch_eager"] = compare(static_y[0].cpu().numpy(), torch_ref[first_out])

                def torch_replay():
                    g.replay()
                    cur.synchronize()
                out["torch_graph"] = time_calls(torch_replay, args.iters, args.warmup)
                out["torch_graph_replay_call"] = time_calls(g.replay, args.iters, args.warmup, after=cur.synchronize)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                report_error(f"{key}/graph/torch-graph", exc, res)

            mine, theirs, floor = out.get("ephost_replay"), out.get("torch_graph"), out.get("raw_cupy_graph")
            if mine and theirs:
                out["ratio_to_torch_p50"] = mine["p50_us"] / theirs["p50_us"]
                out["ratio_goal_met"] = out["ratio_to_torch_p50"] <= GOAL_RATIO
            if mine and floor:
                out["over_floor_p50_us"] = mine["p50_us"] - floor["p50_us"]
                out["floor_goal_met"] = out["over_floor_p50_us"] <= GOAL_FLOOR_US
            for label, k in (("replay ephost (sync)", "ephost_replay"), ("replay torch CUDAGraph", "torch_graph"),
                             ("replay raw cupy Graph", "raw_cupy_graph"),
                             ("async ephost call", "ephost_replay_async_call"),
                             ("async torch g.replay() call", "torch_graph_replay_call"),
                             ("async raw graph.launch() call", "raw_cupy_graph_launch_call")):
                self._log_stats(label, out.get(k))
            if "ratio_to_torch_p50" in out:
                log(f"replay ephost/torch at p50: {out['ratio_to_torch_p50']:.3f}x (goal <= {GOAL_RATIO})")
            if "over_floor_p50_us" in out:
                log(f"replay ephost - raw floor at p50: {out['over_floor_p50_us']:+.1f} us (goal <= {GOAL_FLOOR_US})")

            # steady-state allocation
            try:
                out["allocation"] = self.allocation(sess, ep, binding, ro_sync)
            except Exception as exc:  # noqa: BLE001
                report_error(f"{key}/allocation", exc, res)
            out["fallbacks"] = dict(sess.fallbacks)
            if ep is not None:
                out["ep_stats"] = {k: v for k, v in ep.stats.items() if isinstance(v, (int, float))}
        finally:
            try:
                sess.close()
            except Exception as exc:  # noqa: BLE001
                report_error(f"{key}/graph-close", exc, res)
        return out

    def allocation(self, sess, ep, binding, ro) -> dict:
        cp, n = self.cp, self.args.replays
        self.sync()
        a: dict = {"replays": n}
        a["pool_total_before"] = ep.memory.total_bytes() if ep is not None else None
        a["pool_used_before"] = ep.memory.used_bytes() if ep is not None else None
        a["free_before"], a["device_total"] = (int(v) for v in cp.cuda.runtime.memGetInfo())
        for _ in range(n):
            sess.run_with_iobinding(binding, ro)
        self.sync()
        a["free_after"] = int(cp.cuda.runtime.memGetInfo()[0])
        a["pool_total_after"] = ep.memory.total_bytes() if ep is not None else None
        a["pool_used_after"] = ep.memory.used_bytes() if ep is not None else None
        a["pool_equal"] = a["pool_total_before"] == a["pool_total_after"] if ep is not None else None
        a["free_equal"] = a["free_before"] == a["free_after"]
        log(f"allocation over {n} replays: EP pool total_bytes {a['pool_total_before']} -> {a['pool_total_after']} "
            f"(used {a['pool_used_before']} -> {a['pool_used_after']}); cudaMemGetInfo free "
            f"{a['free_before']} -> {a['free_after']} (equal: pool {a['pool_equal']}, free {a['free_equal']})")
        return a

    @staticmethod
    def _log_stats(label: str, s: dict | None) -> None:
        if s:
            log(f"  {label:32s} p50 {s['p50_us']:9.1f} us  p90 {s['p90_us']:9.1f} us  p99 {s['p99_us']:9.1f} us"
                f"  (mean {s['mean_us']:.1f}, min {s['min_us']:.1f})")


# -- Markdown ----------------------------------------------------------------------------------------------

def _p(s: dict | None, p: int) -> str:
    return f"{s[f'p{p}_us']:.1f}" if s else "n/a"


def _ok(flag) -> str:
    return "" if flag is None else (" ✓" if flag else " ✗")


def markdown(results: dict, meta: dict) -> str:
    models = results["models"]
    lines = [f"Device: {meta.get('gpu')}; torch {meta.get('torch')}, CuPy {meta.get('cupy')}, "
             f"Python {meta.get('python')}; TF32: ephost {'on' if meta.get('tf32') else 'off'}, "
             f"torch {'on' if meta.get('torch_allow_tf32') else 'off'}; "
             f"{meta.get('iters')} timed iterations after {meta.get('warmup')} warm-up; times in µs.", ""]

    lines += ["#### Correctness (max abs diff, float32 output)", "",
              "| model | TF32 ephost/torch | ephost vs torch | ephost vs fp64 | torch vs fp64 | graph replay vs torch "
              "| replay after new input | async replay |",
              "|---|---|---|---|---|---|---|---|"]
    for k, r in models.items():
        c = r.get("correctness", {})
        lines.append(f"| {k} | {'on' if c.get('tf32_ephost') else 'off'}/{'on' if c.get('tf32_torch') else 'off'} | {fmt_cmp(c.get('ephost_vs_torch'))} | "
                     f"{fmt_cmp(c.get('ephost_vs_fp64'))} | {fmt_cmp(c.get('torch_vs_fp64'))} | "
                     f"{fmt_cmp(c.get('graph_replay_vs_torch'))} | {fmt_cmp(c.get('graph_replay_new_input_vs_torch'))} | "
                     f"{fmt_cmp(c.get('graph_async_replay_vs_torch'))} |")

    lines += ["", "#### Eager: `run_with_iobinding` (synchronous) vs PyTorch eager + `torch.cuda.synchronize()`", "",
              "| model | ephost p50 | ephost p90 | ephost p99 | ephost + device sync p50 | torch p50 | torch p90 "
              "| torch p99 | ephost/torch (p50) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, r in models.items():
        e = r.get("eager", {})
        mine = e.get("ephost")
        ratio = f"{e['ratio_p50']:.2f}x" if "ratio_p50" in e else "n/a"
        if e.get("ratio_basis", "").endswith("sync"):
            ratio += " (call + device sync: the call returned early)"
        lines.append(f"| {k} | {_p(mine, 50)} | {_p(mine, 90)} | {_p(mine, 99)} | "
                     f"{_p(e.get('ephost_plus_device_sync'), 50)} | {_p(e.get('torch'), 50)} | "
                     f"{_p(e.get('torch'), 90)} | {_p(e.get('torch'), 99)} | {ratio} |")

    lines += ["", f"#### CUDA graph replay (synchronous); goals: ≤ {GOAL_RATIO}x torch, ≤ {GOAL_FLOOR_US:g} µs over "
              "the raw floor", "",
              "| model | runner | p50 | p90 | p99 | vs torch (p50) | over raw floor (p50, µs) |",
              "|---|---|---|---|---|---|---|"]
    for k, r in models.items():
        g = r.get("graph", {})
        ratio = f"{g['ratio_to_torch_p50']:.3f}x{_ok(g.get('ratio_goal_met'))}" if "ratio_to_torch_p50" in g else "n/a"
        floor = (f"{g['over_floor_p50_us']:+.1f}{_ok(g.get('floor_goal_met'))}" if "over_floor_p50_us" in g
                 else "n/a")
        rows = (("ephost `run_with_iobinding`", g.get("ephost_replay"), ratio, floor),
                ("torch `CUDAGraph.replay` + sync", g.get("torch_graph"), "1.000x", ""),
                ("raw cupy `Graph.launch` + sync (floor)", g.get("raw_cupy_graph"), "", "0"))
        for label, s, ra, fl in rows:
            lines.append(f"| {k} | {label} | {_p(s, 50)} | {_p(s, 90)} | {_p(s, 99)} | {ra} | {fl} |")

    lines += ["", "#### CUDA graph: warm-up + capture, and the asynchronous call alone "
              "(`disable_synchronize_execution_providers=1`)", "",
              "| model | warm-up + capture (ms) | ephost async call p50 | p90 | p99 | torch `g.replay()` p50 "
              "| raw `graph.launch()` p50 |",
              "|---|---|---|---|---|---|---|"]
    for k, r in models.items():
        g = r.get("graph", {})
        a = g.get("ephost_replay_async_call")
        cap = f"{g['warmup_capture_ms']:.1f}" if "warmup_capture_ms" in g else "n/a"
        if g and not g.get("captured", True):
            cap += " (NOT captured)"
        lines.append(f"| {k} | {cap} | {_p(a, 50)} | {_p(a, 90)} | {_p(a, 99)} | "
                     f"{_p(g.get('torch_graph_replay_call'), 50)} | {_p(g.get('raw_cupy_graph_launch_call'), 50)} |")

    lines += ["", "#### Compiled plans (ABI v6): eager `run_with_iobinding`, before (per-node kernels, "
              "`compiled_plan=0`) and after (plan; plan + `plan_auto_graph=1`), vs PyTorch eager", "",
              "| model | nodes | plan: kernels + cuBLAS | per-node p50 | plan p50 | plan p90 | plan p99 | auto-graph p50 "
              "| torch eager p50 | per-node/torch | plan/torch | auto-graph/torch | create cold ms | create warm ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in models.items():
        pl = r.get("plan", {})
        before, after, auto = pl.get("per_node", {}), pl.get("plan", {}), pl.get("plan_auto_graph", {})
        torch_e = r.get("eager", {}).get("torch")
        cre = pl.get("creation", {})

        def ratio(d):
            return f"{d['ratio_to_torch_p50']:.2f}x" if "ratio_to_torch_p50" in d else "n/a"

        def ms(d):
            return f"{d['create_ms']:.0f}" if isinstance(d, dict) and "create_ms" in d else "n/a"
        lines.append(f"| {k} | {after.get('nodes', 'n/a')} | {after.get('kernels', 0)} + {after.get('cublas', 0)} | "
                     f"{_p(before.get('eager'), 50)} | {_p(after.get('eager'), 50)} | {_p(after.get('eager'), 90)} | "
                     f"{_p(after.get('eager'), 99)} | {_p(auto.get('eager'), 50)} | {_p(torch_e, 50)} | "
                     f"{ratio(before)} | {ratio(after)} | {ratio(auto)} | {ms(cre.get('cold'))} | {ms(cre.get('warm'))} |")

    lines += ["", "#### Steady-state allocation around the replays (bytes)", "",
              "| model | replays | EP pool before | EP pool after | device free before | device free after | equal |",
              "|---|---|---|---|---|---|---|"]
    for k, r in models.items():
        a = r.get("graph", {}).get("allocation")
        if not a:
            lines.append(f"| {k} | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        equal = a["pool_equal"] is not False and a["free_equal"]
        pool_note = "" if a["pool_equal"] is not None else " (pool n/a)"
        lines.append(f"| {k} | {a['replays']} | {a['pool_total_before']} | {a['pool_total_after']} | "
                     f"{a['free_before']} | {a['free_after']} | {'yes' if equal else 'NO'}{pool_note} |")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------------

def environment_info(torch, cupy) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cupy": cupy.__version__}
    try:
        info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        info["gpu"] = "unknown"
    for key, fn in (("cuda_runtime", cupy.cuda.runtime.runtimeGetVersion),
                    ("cuda_driver", cupy.cuda.runtime.driverGetVersion)):
        try:
            info[key] = int(fn())
        except Exception:  # noqa: BLE001
            info[key] = None
    info["torch_cuda"] = getattr(torch.version, "cuda", None)
    return info


def set_torch_tf32(torch, on: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def write_json(path: str, data: dict) -> None:
    def default(o):
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, (set, tuple)):
            return list(o)
        return str(o)

    Path(path).write_text(json.dumps(data, indent=2, default=default), encoding="utf-8")
    log(f"wrote {path}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=1000, help="timed iterations per measurement (default 1000)")
    p.add_argument("--warmup", type=int, default=50, help="untimed warm-up iterations (default 50)")
    p.add_argument("--replays", type=int, default=1000, help="replays of the allocation check (default 1000)")
    p.add_argument("--json", metavar="OUT", help="write every number to this JSON file")
    p.add_argument("--models", default=",".join(MODEL_SPECS),
                   help=f"comma-separated subset of {', '.join(MODEL_SPECS)}")
    p.add_argument("--tf32", type=int, choices=(0, 1), default=1,
                   help="TF32 matmuls on both sides: ephost use_tf32 and torch allow_tf32 (default 1)")
    p.add_argument("--min-runs", type=int, default=2, dest="min_runs",
                   help="min_num_runs_before_cuda_graph_capture for the graph session (default 2)")
    p.add_argument("--plugin", help="path of the CUDA plugin library (default build/lib/libephost_cuda_v<N>.so)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.replays < 1 or args.min_runs < 0:
        p.error("--iters and --replays must be >= 1, --warmup and --min-runs >= 0")
    args.model_keys = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.model_keys if m not in MODEL_SPECS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODEL_SPECS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        sys.stdout.reconfigure(errors="replace")  # µs and ✓ on a non-UTF-8 terminal
    except Exception:  # noqa: BLE001
        pass
    args = parse_args(argv)
    mods, reason = check_prerequisites()
    if mods is None:
        log(f"cuda_bench: SKIPPED: {reason}; the CUDA benchmark needs PyTorch with CUDA, CuPy and a GPU")
        if args.json:
            write_json(args.json, {"skipped": reason})
        return 0
    torch, cupy = mods
    path = plugin_path(args.plugin)
    if not ensure_plugin(path, explicit=bool(args.plugin)):
        return 1

    from host.plugins.environment import Environment

    set_torch_tf32(torch, bool(args.tf32))
    meta = environment_info(torch, cupy)
    meta.update(iters=args.iters, warmup=args.warmup, replays=args.replays, tf32=bool(args.tf32),
                min_runs_before_capture=args.min_runs, plugin=str(path), gc_disabled_while_timing=True,
                rtol=RTOL, atol=ATOL, torch_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
                torch_float32_matmul_precision=torch.get_float32_matmul_precision())
    log(f"cuda_bench: {meta['gpu']}; torch {meta['torch']} (CUDA {meta['torch_cuda']}), CuPy {meta['cupy']} "
        f"(runtime {meta['cuda_runtime']}, driver {meta['cuda_driver']}), Python {meta['python']}")
    log(f"TF32: ephost use_tf32={int(args.tf32)}; torch allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
        f"float32_matmul_precision={torch.get_float32_matmul_precision()!r}; "
        f"iters {args.iters}, warm-up {args.warmup}")

    env = Environment()
    try:
        env.register_plugin("cuda", path)
    except Exception as exc:  # noqa: BLE001
        report_error("register_plugin", exc)
        return 1
    devices = [d for d in env.ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        log(f"cuda_bench: the CUDA plugin {path} lists no device although PyTorch sees one; check the plugin's "
            "warning above (CuPy / driver) and run the GPU tests")
        return 1

    results: dict = {"meta": meta, "models": {}}
    bench = Bench(args, torch, cupy, env)
    for key in args.model_keys:
        try:
            results["models"][key] = bench.run_model(key)
        except Exception as exc:  # noqa: BLE001 - the next model still runs
            results["models"][key] = {"model": key}
            report_error(key, exc, results["models"][key])
        gc.collect()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass

    md = markdown(results, meta)
    results["markdown"] = md
    log("\n" + "=" * 100 + "\n")
    log(md)
    errors = {k: r.get("errors") for k, r in results["models"].items() if r.get("errors")}
    if errors:
        log(f"\n{sum(len(e) for e in errors.values())} error(s): " + "; ".join(
            f"{k}/{w}" for k, e in errors.items() for w in e))
    if args.json:
        write_json(args.json, results)
    try:
        env.close()
    except Exception as exc:  # noqa: BLE001
        log(f"note: closing the environment: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
