"""ephost's CPU EP against onnxruntime's CPU provider on a dynamic-axes model, shapes in turn.

    python -m bench.dynamic_shapes [--shapes 1x16,8x128,3x50,8x128,1x16] [--iters 50] [--warmup 5]
                                   [--model bert_like | PATH.onnx] [--threads N] [--json out.json]
                                   [--sides ephost,ephost_nodes,ephost_plain,ephost_static]

One session per side for the whole list (as a server sees shapes come and go): ephost with the shape
program (host/runtime/shape_program.py, the default), ephost with it off (session config
session.ephost.shape_cache_signatures=0: shape arithmetic as CPU-EP nodes, as before issue 23), and
onnxruntime; beside them, ephost on a static copy of the model at each shape (its input dims fixed: what
a static export runs), the mark a dynamic export should reach; ephost_plain is ephost without symbolic
shapes (session.ephost.symbolic_shapes=0: Range lengths only, as before they came). `--sides` keeps
some of the ephost sides (BERT-base at 8x128 takes seconds a run on one thread). Per shape: the first run (a new shape signature for the session, or a cached one when the
shape came before) and the p50 of `iters` runs, timed in rounds so load on a shared machine hits every
side (bench.cpu_models.in_rounds). The ratio is ephost p50 / onnxruntime p50 (1.0 = parity). The first
shape's first run of the side that runs first (ephost with the program) also pays the process's one-time
set-up (lazy imports, native kernels), whichever side that is.
`--model bert_like` is tests/models/dynamic.py's encoder (2 layers, hidden 64); a path runs a model
file, the sizes going to its symbolic input dims in order of first appearance; `base:bert_ts` (or another
tests/models/make_hf_dynamic name) the 12-layer, hidden-768 export, made into /tmp/ephost_hf_base with
transformers and torch at the first use.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnx
import onnxruntime as ort

from bench.cpu_models import in_rounds
from host.cli.session_cmds import parse_shapes
from host.cli.zoo import random_inputs
from host.runtime import shape_program, symbolic_shapes
from host.runtime.dims import input_symbols
from host.runtime.model import build_graph
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession

DEFAULT_SHAPES = "1x16,8x128,3x50,8x128,1x16"


BASE_DIR = "/tmp/ephost_hf_base"  # where `--model base:NAME` exports the 12-layer models (not checked in)


def _model(name: str) -> onnx.ModelProto:
    if name == "bert_like":
        from tests.models.dynamic import bert_like

        return bert_like()
    if name.startswith("base:"):
        return onnx.load(_base_export(name.split(":", 1)[1]))
    return onnx.load(name)


def _base_export(name: str) -> str:
    """tests/models/make_hf_dynamic's --size base export `name` (bert_ts, gpt2_ts, ...: BERT-base, GPT-2
    small), made into BASE_DIR with transformers and torch at the first use."""
    import os

    path = os.path.join(BASE_DIR, f"{name}.onnx")
    if not os.path.exists(path):
        from tests.models import make_hf_dynamic

        make_hf_dynamic.main(["--size", "base", "--only", name, "--out", BASE_DIR])
    return path


def _feeds(model: onnx.ModelProto, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    if {i.name for i in model.graph.input} == {"input_ids", "attention_mask"}:
        from tests.models.dynamic import bert_feeds

        return bert_feeds(*sizes.values(), seed=seed)
    return random_inputs(model, seed=seed, sizes=sizes)


SIDES = ("ephost", "ephost_nodes", "ephost_plain", "ephost_static")
# Session config per ephost side: ephost_nodes has no shape program (shape arithmetic as CPU-EP nodes),
# ephost_plain no symbolic shapes (Range lengths only: the inference before they came).
_CONFIG = {"ephost": {}, "ephost_nodes": {shape_program.CACHE_KEY: "0"},
           "ephost_plain": {symbolic_shapes.ENABLE_KEY: "0"}}


def sessions(model: onnx.ModelProto, threads: int, sides=SIDES) -> dict:
    data = model.SerializeToString()
    out = {}
    for label, entries in _CONFIG.items():
        if label not in sides:
            continue
        so = SessionOptions()
        so.intra_op_num_threads = threads
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        out[label] = InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    out["onnxruntime"] = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return out


def static_copy(model: onnx.ModelProto, sizes: dict[str, int]) -> onnx.ModelProto:
    """`model` with its symbolic input dims fixed to `sizes` (what a static export of that shape is)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in out.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]
    return out


def _static_session(model: onnx.ModelProto, sizes: dict[str, int], threads: int, made: dict) -> InferenceSession:
    key = tuple(sizes.values())
    if key not in made:
        so = SessionOptions()
        so.intra_op_num_threads = threads
        made[key] = InferenceSession(static_copy(model, sizes).SerializeToString(), sess_options=so,
                                     providers=["CPUExecutionProvider"])
    return made[key]


def _runner(session, feeds):
    return lambda: session.run(None, feeds)


def bench(model: onnx.ModelProto, shapes: str, iters: int, warmup: int, threads: int, seed: int = 0,
          sides=SIDES) -> list[dict]:
    sess = sessions(model, threads, sides)
    symbols = list(input_symbols(build_graph(model).inputs))
    rows = []
    statics: dict = {}
    for sizes in parse_shapes(shapes, symbols):
        feeds = _feeds(model, sizes, seed)
        runs = {label: _runner(session, feeds) for label, session in sess.items()}
        static = _static_session(model, sizes, threads, statics) if "ephost_static" in sides else None
        row = {"shape": "x".join(map(str, sizes.values()))}
        want = None
        for label, fn in runs.items():
            t0 = time.perf_counter_ns()
            got = fn()[0]
            row[f"{label}_first_ms"] = (time.perf_counter_ns() - t0) / 1e6
            want = got if want is None else want
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)  # same answers before timing
        if static is not None:
            runs["ephost_static"] = _runner(static, feeds)
            np.testing.assert_allclose(runs["ephost_static"]()[0], want, rtol=1e-3, atol=1e-4)
        samples = in_rounds(runs, warmup, iters, block=max(1, min(10, iters)))
        for label in runs:
            row[f"{label}_p50_us"] = float(np.median(samples[label]))
        for label in SIDES:
            if label in runs:
                row[f"{label}_ratio"] = row[f"{label}_p50_us"] / row["onnxruntime_p50_us"]
        row["plan_nodes"] = {k: len(s.plan.nodes) for k, s in sess.items() if k != "onnxruntime"}
        row["shape_evaluations"] = sess["ephost"].shape_program.evaluations
        rows.append(row)
    return rows


_TITLES = {"ephost": "ephost, shape program", "ephost_nodes": "ephost, shapes as nodes",
           "ephost_plain": "ephost, no symbolic shapes", "ephost_static": "ephost, static export of the shape"}


def table(rows: list[dict]) -> str:
    sides = [s for s in ("ephost_nodes", "ephost_plain", "ephost", "ephost_static") if f"{s}_p50_us" in rows[0]]
    firsts = [s for s in ("onnxruntime", "ephost_nodes", "ephost_plain", "ephost") if f"{s}_first_ms" in rows[0]]
    lines = ["| shape | onnxruntime p50 | " + " | ".join(f"{_TITLES[s]} p50 (ratio)" for s in sides)
             + " | first run: " + " / ".join(firsts) + " |",
             "|---|---|" + "---|" * len(sides) + "---|"]
    for r in rows:
        cells = [f"{_us(r[f'{s}_p50_us'])} ({r[f'{s}_ratio']:.2f}x)" for s in sides]
        lines.append(f"| {r['shape']} | {_us(r['onnxruntime_p50_us'])} | " + " | ".join(cells) + " | "
                     + " / ".join(f"{r[f'{s}_first_ms']:.1f}" for s in firsts) + " ms |")
    return "\n".join(lines)


def _us(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 10_000 else f"{us:.0f} us"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert_like")
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--sides", default=",".join(SIDES), help="the ephost sides to time (onnxruntime always)")
    args = p.parse_args(argv)
    sides = tuple(x for x in args.sides.split(",") if x)
    unknown = set(sides) - set(SIDES)
    if unknown:
        p.error(f"--sides takes {', '.join(SIDES)}; got {', '.join(sorted(unknown))}")
    rows = bench(_model(args.model), args.shapes, args.iters, args.warmup, args.threads, sides=sides)
    print(table(rows))
    print(f"plan nodes: {rows[-1]['plan_nodes']}; shape program evaluations: {rows[-1]['shape_evaluations']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
