"""Classic ML and quantized models: ephost's CPU EP against onnxruntime's CPU provider.

    python -m bench.ml_models [--rows 10000] [--trees 100] [--iters 20]

Models (built here): a RandomForestClassifier (`--trees` trees, depth 8, ZipMap off), a
GradientBoostingRegressor (`--trees` trees, depth 3), a StandardScaler + LogisticRegression pipeline
(skl2onnx), and the QOperator / QDQ / dynamic quantizations of a small CNN (onnxruntime's
quantizer, tests/host/test_quantized.py's model). For each: median latency of one run at batch 1 and
at `--rows` rows (the CNN at batch 1 only), ephost / onnxruntime (lower is better; 1.0 = parity).
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


def _compare(name: str, model: onnx.ModelProto, feeds: dict, iters: int) -> str:
    data = model.SerializeToString()
    ref = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eph = host.InferenceSession(data)
    t_ref = _median_ms(lambda: ref.run(None, feeds), iters)
    t_eph = _median_ms(lambda: eph.run(None, feeds), iters)
    rows = next(iter(feeds.values())).shape[0]
    return f"| {name} | {rows} | {t_ref:.3f} | {t_eph:.3f} | {t_eph / t_ref:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--trees", type=int, default=100)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quant-only", action="store_true", help="only the quantized models")
    args = parser.parse_args()
    lines = ["| model | rows | onnxruntime ms | ephost ms | ratio |", "|---|---|---|---|---|"]
    models, features = ({}, 0) if args.quant_only else _sklearn_models(args.trees)
    rng = np.random.RandomState(1)
    for name, model in models.items():
        for rows in (1, args.rows):
            feeds = {"X": rng.rand(rows, features).astype(np.float32)}
            lines.append(_compare(name, model, feeds, args.iters))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, shape) in _quantized_models(tmp).items():
            feeds = {"x": rng.rand(*shape).astype(np.float32)}
            lines.append(_compare(name, model, feeds, args.iters * 10))
    print("\n".join(lines))
    print(f"\n(onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
