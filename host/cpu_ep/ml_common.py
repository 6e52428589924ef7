"""What the ai.onnx.ml classifiers and regressors share: post transforms and class labels."""

from __future__ import annotations

import numpy as np

POST_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")


def logistic(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def logistic_in_place(x: np.ndarray) -> np.ndarray:
    """logistic(x) written over x (a float array the caller owns): the same operations in x's type, without
    the three temporaries (a one-row model's run is a few microseconds)."""
    return logistic_of_negated(np.negative(x, out=x))


def logistic_of_negated(x: np.ndarray) -> np.ndarray:
    """logistic_in_place's steps after its negation, over x = -scores (native ep_ml_linear writes the
    scores negated: NumPy's float32 exp, which C's expf does not match, is left to do)."""
    np.exp(x, out=x)
    x += 1
    return np.reciprocal(x, out=x)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_zero(x: np.ndarray) -> np.ndarray:
    """onnxruntime's SOFTMAX_ZERO: values within 1e-7 of zero are not exponentiated but scaled by
    exp(-max) and left out of the sum, so they stay (near) zero; a row of such values is divided by
    a zero sum (NaN, or +-inf for a tiny nonzero value), as in onnxruntime."""
    top = x.max(axis=-1, keepdims=True)
    zero = np.abs(x) <= 1e-7
    e = np.where(zero, x * np.exp(-top), np.exp(x - top))
    with np.errstate(invalid="ignore", divide="ignore"):
        return e / np.where(zero, 0, e).sum(axis=-1, keepdims=True)


def probit(x: np.ndarray) -> np.ndarray:
    """sqrt(2) * erfinv(2x - 1) as onnxruntime computes it (every ai.onnx.ml PROBIT): in float32,
    through Winitzki's closed-form approximation of erfinv (a = 0.147), which differs from the exact
    value by up to about 2e-3 in the tails; a value that rounds to 0 or 1 in float32 gives -inf or inf."""
    y = 2 * np.asarray(x, dtype=np.float32) - np.float32(1)
    log = np.log((1 - y) * (1 + y))
    v = _PROBIT_TWO_OVER_PI_A + np.float32(0.5) * log
    root = np.sqrt(-v + np.sqrt(v * v - _PROBIT_ONE_OVER_A * log))
    return np.float32(np.sqrt(2)) * np.copysign(root, np.where(y < 0, np.float32(-1), np.float32(1)))


_PROBIT_TWO_OVER_PI_A = np.float32(2) / (np.float32(np.pi) * np.float32(0.147))
_PROBIT_ONE_OVER_A = np.float32(1) / np.float32(0.147)


def post_transform(name: str, scores: np.ndarray) -> np.ndarray:
    """Applies one of POST_TRANSFORMS to (rows, classes) scores."""
    if name == "NONE":
        return scores
    fn = {"LOGISTIC": logistic, "SOFTMAX": softmax, "SOFTMAX_ZERO": softmax_zero, "PROBIT": probit}[name]
    return fn(scores)


def class_labels(kernel, ints_attr: str = "classlabels_int64s") -> np.ndarray | None:
    """The classifier's labels from `ints_attr` (classlabels_int64s; classlabels_ints for the linear
    and SVM classifiers) or classlabels_strings (as an object array of str, the way onnxruntime
    returns string tensors), None when it has neither."""
    ints = kernel.attr(ints_attr, None)
    strings = kernel.attr("classlabels_strings", None)
    if ints is not None and strings is not None:
        raise kernel.bad_attr("classlabels_strings", strings, f"only one of {ints_attr} / classlabels_strings")
    if strings is not None:
        return np.array(strings, dtype=object)
    if ints is not None:
        return np.asarray(ints, dtype=np.int64)
    return None
