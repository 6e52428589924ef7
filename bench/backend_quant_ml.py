"""onnx backend node tests of the quantized and ai.onnx.ml ops: how many pass on ephost's CPU EP
and on onnxruntime (CPU), with the reason of each ephost failure.

    python -m bench.backend_quant_ml [-v] [--retarget]
"""

from __future__ import annotations

import re
import sys
import warnings
from collections import Counter

import numpy as np
import onnxruntime
from onnx import TensorProto, numpy_helper
from onnx.backend.test.loader import load_model_tests

from host.runtime.backend import EphostBackend

PATTERN = re.compile(
    r"^test_(quantizelinear|dequantizelinear|dynamicquantizelinear|qlinearconv|qlinearmatmul|matmulinteger"
    r"|convinteger|ai_onnx_ml_.*|tree_ensemble.*|label_encoder.*|binarizer.*|array_feature_extractor.*"
    r"|one_hot_encoder.*|scaler.*|normalizer.*|imputer.*|linear_classifier.*|linear_regressor.*|svm.*"
    r"|zipmap.*|category_mapper.*|dict_vectorizer.*|feature_vectorizer.*)")


def _close(expected, got, rtol=1e-3, atol=1e-7) -> bool:
    expected, got = np.asarray(expected), np.asarray(got)
    if expected.shape != got.shape:
        return False
    if expected.dtype.kind in "OUS" or got.dtype.kind in "OUS":
        return expected.astype(str).tolist() == got.astype(str).tolist()
    if expected.dtype != got.dtype:
        return False
    return np.allclose(expected.astype(np.float64), got.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)


def _retarget(case) -> None:
    """--retarget: a model of an opset newer than ephost's window (7..23) is run at opset 23 (where
    QuantizeLinear/DequantizeLinear have the same attributes; only the type lists grew since)."""
    for imp in case.model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > 23:
            imp.version = 23


def _arrays(values) -> list:
    """A case's inputs or outputs as arrays: onnx keeps the low-bit ones (int4, float8, ...) as TensorProtos."""
    return [numpy_helper.to_array(v) if isinstance(v, TensorProto) else v for v in values]


def _run_ort(case):
    sess = onnxruntime.InferenceSession(case.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, _arrays(case.data_sets[0][0]))))


def _run_ephost(case):
    rep = EphostBackend.prepare(case.model, "CPU")
    return rep.run(_arrays(case.data_sets[0][0]))


def _check(run, case) -> str:
    try:
        outs = run(case)
    except Exception as exc:  # noqa: BLE001 - counted by reason
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
    expected = _arrays(case.data_sets[0][1])
    ok = len(outs) == len(expected) and all(_close(e, g, case.rtol, case.atol) for e, g in zip(expected, outs))
    return "pass" if ok else "mismatch"


def main() -> None:
    verbose = "-v" in sys.argv
    cases = [c for c in load_model_tests(kind="node") if PATTERN.match(c.name) and c.model is not None]
    counts = Counter()
    for case in sorted(cases, key=lambda c: c.name):
        if "--retarget" in sys.argv:
            _retarget(case)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ort_result = _check(_run_ort, case)
            eph_result = _check(_run_ephost, case)
        counts["onnxruntime " + ("pass" if ort_result == "pass" else "fail")] += 1
        counts["ephost " + ("pass" if eph_result == "pass" else "fail")] += 1
        if ort_result == "pass" and eph_result != "pass":
            counts["ephost fails where onnxruntime passes"] += 1
        if verbose or (ort_result == "pass" and eph_result != "pass"):
            print(f"{case.name}: onnxruntime {ort_result}; ephost {eph_result}")
    print(f"{len(cases)} node tests:", dict(sorted(counts.items())))


if __name__ == "__main__":
    main()
