"""Classic ML and quantized models: ephost's CPU EP against onnxruntime's CPU provider.

    python -m bench.ml_models [--rows 10000] [--trees 100] [--iters 20] [--threads 1] [--repeats 5]
    python -m bench.ml_models --profile random_forest_100 [--profile-runs 10000]

Models (built here): a RandomForestClassifier (`--trees` trees, depth 8, ZipMap off), a
GradientBoostingRegressor (`--trees` trees, depth 3), a StandardScaler + LogisticRegression pipeline
(skl2onnx), and the QOperator / QDQ / dynamic quantizations of a small CNN (onnxruntime's
quantizer, tests/host/test_quantized.py's model). For each: median latency of one run at batch 1 and
at `--rows` rows (the CNN at batch 1 only), ephost / onnxruntime (lower is better; 1.0 = parity).
`--threads N` sets intra_op_num_threads on both sessions (0: each one's default); `--repeats R`
times the two sessions R times each, alternating, and reports the median of the R medians (the ratio
is the median of the R per-repeat ratios), which steadies the figures on a loaded machine.
`--profile NAME` instead runs cProfile over `--profile-runs` batch-1 runs of model NAME (ephost only)
and prints the 30 costliest functions by own time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import numpy as np
import onnx
import onnxruntime

import host


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _sklearn_models(trees: int, features: int = 20):
    from skl2onnx import to_onnx
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.RandomState(0)
    x = rng.rand(2000, features).astype(np.float32)
    y = (x[:, 0] + x[:, 1] * 2 + rng.rand(2000) > 2).astype(np.int64)
    rf = RandomForestClassifier(trees, max_depth=8, random_state=0).fit(x, y)
    gb = GradientBoostingRegressor(n_estimators=trees, max_depth=3, random_state=0).fit(x, x[:, 0])
    lr = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y)
    no_zipmap = {"zipmap": False}
    return {
        f"random_forest_{trees}": to_onnx(rf, x[:1], options={id(rf): no_zipmap}),
        f"gradient_boosting_{trees}": to_onnx(gb, x[:1]),
        "scaler_logistic": to_onnx(lr, x[:1], options={id(lr): no_zipmap}),
    }, features


def _quantized_models(tmp: str) -> dict:
    """{name: (model, input shape)}: the CNN and the transformer block of tests/host/test_quantized.py,
    quantized by onnxruntime in the three formats, and the CNN at 64x64 (where the kernels, not the
    per-run cost, take the time)."""
    from tests.host.test_quantized import MODELS, _quantized

    models = {f"{name}_{fmt}": (onnx.load(_quantized(tmp, name, fmt)), MODELS[name][1])
              for name in ("cnn", "transformer") for fmt in ("qop", "qdq", "dynamic")}
    for fmt in ("qop", "qdq"):
        models[f"cnn64_{fmt}"] = (_cnn64(tmp, fmt), (1, 3, 64, 64))
    return models


def _cnn64(tmp: str, fmt: str) -> onnx.ModelProto:
    from onnxruntime import quantization

    from tests.host.test_quantized import _Reader, small_cnn

    model = small_cnn()
    for dim in model.graph.input[0].type.tensor_type.shape.dim[2:]:
        dim.dim_value = 64
    src, out = os.path.join(tmp, "cnn64.onnx"), os.path.join(tmp, f"cnn64_{fmt}.onnx")
    onnx.save(model, src)
    quant_format = quantization.QuantFormat.QDQ if fmt == "qdq" else quantization.QuantFormat.QOperator
    quantization.quantize_static(src, out, _Reader((1, 3, 64, 64)), quant_format=quant_format)
    return onnx.load(out)


def _sessions(model: onnx.ModelProto, threads: int):
    data = model.SerializeToString()
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads = threads
    ref = onnxruntime.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    eso = host.SessionOptions()
    eso.intra_op_num_threads = threads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eph = host.InferenceSession(data, eso)
    return ref, eph


def _compare(name: str, model: onnx.ModelProto, feeds: dict, iters: int, threads: int = 0, repeats: int = 1) -> str:
    ref, eph = _sessions(model, threads)
    t_ref, t_eph, ratios = [], [], []
    for _ in range(repeats):  # alternating, so both see the same spells of load
        t_ref.append(_median_ms(lambda: ref.run(None, feeds), iters))
        t_eph.append(_median_ms(lambda: eph.run(None, feeds), iters))
        ratios.append(t_eph[-1] / t_ref[-1])
    rows = next(iter(feeds.values())).shape[0]
    return (f"| {name} | {rows} | {np.median(t_ref):.3f} | {np.median(t_eph):.3f} | {np.median(ratios):.2f} |")


def _profile(model: onnx.ModelProto, feeds: dict, runs: int, threads: int) -> None:
    import cProfile
    import pstats

    _, eph = _sessions(model, threads)
    eph.run(None, feeds)
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [eph.run(None, feeds) for _ in range(runs)])
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--trees", type=int, default=100)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quant-only", action="store_true", help="only the quantized models")
    parser.add_argument("--threads", type=int, default=0, help="intra_op_num_threads of both sessions (0: default)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating timings per model (median reported)")
    parser.add_argument("--profile", metavar="NAME", help="cProfile ephost's batch-1 runs of one model instead")
    parser.add_argument("--profile-runs", type=int, default=10000)
    args = parser.parse_args()
    lines = ["| model | rows | onnxruntime ms | ephost ms | ratio |", "|---|---|---|---|---|"]
    models, features = ({}, 0) if args.quant_only and not args.profile else _sklearn_models(args.trees)
    rng = np.random.RandomState(1)
    with tempfile.TemporaryDirectory() as tmp:
        cases = {name: (model, (1, features), "X") for name, model in models.items()}
        cases.update({name: (model, shape, "x") for name, (model, shape) in _quantized_models(tmp).items()})
        if args.profile:
            if args.profile not in cases:
                parser.error(f"--profile: unknown model {args.profile!r}; models: {sorted(cases)}")
            model, shape, input_name = cases[args.profile]
            _profile(model, {input_name: rng.rand(*shape).astype(np.float32)}, args.profile_runs, args.threads)
            return
        for name, (model, shape, input_name) in cases.items():
            sklearn = input_name == "X"
            for rows in (1, args.rows) if sklearn else (shape[0],):
                feeds = {input_name: rng.rand(rows, *shape[1:]).astype(np.float32)}
                iters = args.iters if sklearn else args.iters * 10
                lines.append(_compare(name, model, feeds, iters, args.threads, args.repeats))
    print("\n".join(lines))
    print(f"\n(onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs, threads {args.threads or 'default'}, "
          f"repeats {args.repeats})")


if __name__ == "__main__":
    main()
