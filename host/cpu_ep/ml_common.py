"""What the ai.onnx.ml classifiers and regressors share: post transforms and class labels."""

from __future__ import annotations

import numpy as np

POST_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")


def logistic(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_zero(x: np.ndarray) -> np.ndarray:
    """Softmax where zeros stay zeros (onnxruntime's SOFTMAX_ZERO); a row of zeros gives 0.5s."""
    zero = np.abs(x) <= 1e-7
    e = np.where(zero, 0.0, np.exp(x - x.max(axis=-1, keepdims=True)))
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total == 0, 0.5, e / np.where(total == 0, 1, total))


def probit(x: np.ndarray) -> np.ndarray:
    from scipy.special import erfinv  # only for probit outputs: scipy stays unimported otherwise

    return np.sqrt(2.0) * erfinv(2 * x - 1)


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
