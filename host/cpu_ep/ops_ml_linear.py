"""Linear and kernel models of ai.onnx.ml: LinearClassifier, LinearRegressor, SVMClassifier,
SVMRegressor. One GEMM per model (rows x features by features x classes), scores in float64
(onnxruntime accumulates in float), outputs in float32.

The linear models' GEMM runs on the compiled small GEMM (native ep_gemm, in blocks of rows within
native.gemm_fits) wherever their coefficients fit its panel, as skl2onnx's usually do (features x classes
of a few thousand floats): such a kernel calls no BLAS, so a plan of scalers, linear models and trees
skips the per-run BLAS thread bound (host/runtime/threads.py), which at one row cost as much as the model."""

from __future__ import annotations

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel
from host.cpu_ep.ml_common import POST_TRANSFORMS, class_labels, logistic_in_place, logistic_of_negated, post_transform
from host.cpu_ep.registry import register

ML = "ai.onnx.ml"


def _rows(x: np.ndarray) -> np.ndarray:
    x = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


class _Scores:
    """x @ coef + intercepts in float32 for a linear model's constants: by the compiled GEMM in blocks of
    rows (see the module doc) where the coefficients fit its panel and the library is loaded, else NumPy's
    matmul. Pointers to the constants are taken once."""

    def __init__(self, coef: np.ndarray, intercepts: np.ndarray):
        self.coef, self.intercepts = coef, intercepts
        k, n = coef.shape
        self.compiled = 0 < k * n <= native.GEMM_MAX_PANEL  # with the library: no BLAS at any row count
        self.pointers = (native.ptr(coef), native.ptr(intercepts)) if self.compiled else None

    def uses_blas(self) -> bool:
        return not (self.compiled and native.LIB is not None)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        lib = native.LIB
        if lib is None or not self.compiled or not len(x):
            scores = np.matmul(x.astype(np.float32, copy=False), self.coef)
            scores += self.intercepts
            return scores
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        (rows, k), n = x.shape, self.coef.shape[1]
        y = np.empty((rows, n), dtype=np.float32)
        ptr, null, (cp, ip) = native.ptr, native.NULL, self.pointers
        block = max(1, native.GEMM_MAX_MACS // (k * n))
        if rows <= block:  # one call: the common case (a block is millions of multiply-adds)
            lib.ep_gemm(ptr(x), null, cp, ip, 1, ptr(y), rows, k, n, 0, null, 0.0, 0.0)
            return y
        for r0 in range(0, rows, block):
            r = min(block, rows - r0)
            lib.ep_gemm(ptr(x[r0:r0 + r]), null, cp, ip, 1, ptr(y[r0:r0 + r]), r, k, n, 0, null, 0.0, 0.0)
        return y


# ep_ml_linear's modes (native/kernels_ml.c): what it writes after the GEMM
ML_SCORES, ML_ONE_MINUS, ML_NEGATED, ML_NEGATED_FLIP, ML_SCORES_FLIP = 0, 1, 2, 3, 4
NO_SCALER = (native.NULL, 0, native.NULL, 0)  # ep_ml_linear's offset and scale arguments without a Scaler


class _Compiled:
    """LinearClassifier's run (and a Scaler's before it: ml_chain.py) as one ep_ml_linear call over float32
    rows: the scaling, the compiled GEMM, a binary model's label and score columns, LOGISTIC's negation
    (and, for several columns and int labels, its add, reciprocal and argmax by a second call): the same
    float32 operations as the kernels' NumPy steps. What stays in NumPy: LOGISTIC's exp (NumPy's float32
    exp is not the C library's), the other post transforms, and the rest of the labels."""

    def __init__(self, kernel: LinearClassifier):
        self.k, n = kernel.coef.shape
        logistic = kernel.post == "LOGISTIC"
        if kernel.binary:
            mode = ML_ONE_MINUS if not kernel.negated else ML_NEGATED_FLIP if logistic else ML_NEGATED
        else:
            mode = ML_SCORES_FLIP if logistic else ML_SCORES
        self.mode, self.width = mode, 2 if kernel.binary else n
        self.labels = kernel.labels
        self.int_labels = kernel.labels.dtype == np.int64  # written by the call; strings taken after it
        self.table = native.ptr(kernel.labels) if self.int_labels else native.NULL
        block = max(1, native.GEMM_MAX_MACS // (self.k * n))  # _Scores' row blocks
        self.middle = (*kernel.scores.pointers, n, block, mode, self.table if kernel.binary else native.NULL)
        # LOGISTIC over several columns with int labels: after NumPy's exp, ep_ml_logistic_labels does the
        # rest (the add, the reciprocal, the argmax and the labels: four NumPy calls on a row's few values)
        self.finish = mode == ML_SCORES_FLIP and n > 1 and self.int_labels
        self.kernel = kernel

    def __call__(self, lib, x: np.ndarray, scaler: tuple):
        """(labels, scores) of float32 C-contiguous rows x (k features), or None where the call found no
        scratch memory (the caller's NumPy path then runs)."""
        rows, mode, ptr = x.shape[0], self.mode, native.ptr
        scores = np.empty((rows, self.width), dtype=np.float32)
        if mode == ML_SCORES_FLIP or mode == ML_SCORES:
            out = ptr(scores)
            if lib.ep_ml_linear(ptr(x), rows, self.k, *scaler, *self.middle, out, native.NULL):
                return None
            if not self.finish:
                return self.kernel.transformed(scores, negated=mode == ML_SCORES_FLIP)
            np.exp(scores, scores)
            index = np.empty(rows, dtype=np.int64)
            lib.ep_ml_logistic_labels(out, rows, self.width, self.table, ptr(index))
            return (index, scores)
        index = np.empty(rows, dtype=np.int64)
        if lib.ep_ml_linear(ptr(x), rows, self.k, *scaler, *self.middle, ptr(scores), ptr(index)):
            return None
        labels = index if self.int_labels else self.labels.take(index)
        if mode == ML_NEGATED_FLIP:
            return (labels, logistic_of_negated(scores))
        if mode == ML_NEGATED:  # PROBIT (the only other transform that negates)
            scores = post_transform(self.kernel.post, scores).astype(np.float32)
        return (labels, scores)


def _labels_from_scores(labels: np.ndarray, scores: np.ndarray, binary_threshold: float | None) -> np.ndarray:
    """argmax over classes; a one-column score (binary) picks labels[1] above the threshold."""
    if scores.shape[1] == 1:
        return labels[(scores[:, 0] > binary_threshold).astype(np.int64)]
    return labels[scores.argmax(axis=1)]


@register("LinearClassifier", domain=ML)
class LinearClassifier(OpKernel):
    """scores = x @ coefficients.T + intercepts. With one score column s and two labels (a binary
    logistic regression) the label is labels[1] where s > 0 and the scores follow onnxruntime:
    [-s, s] before a LOGISTIC or PROBIT transform, [1 - s, s] untransformed otherwise (NONE, and
    SOFTMAX / SOFTMAX_ZERO, which onnxruntime does not apply to the made-up column)."""

    def __init__(self, node):
        super().__init__(node)
        self.labels = class_labels(self, "classlabels_ints")
        if self.labels is None:
            raise self.bad_attr("classlabels_ints", None, "classlabels_ints or classlabels_strings")
        self.post = self.attr_str("post_transform", "NONE", choices=POST_TRANSFORMS)
        coef = np.asarray(self.attr("coefficients"), dtype=np.float32)
        intercepts = self.attr("intercepts", None)
        self.n_columns = len(intercepts) if intercepts else max(1, len(coef) // max(1, len(self.labels)))
        self.coef = coef.reshape(self.n_columns, -1).T.copy()
        self.intercepts = np.asarray(intercepts if intercepts else [0.0] * self.n_columns, dtype=np.float32)
        self.binary = self.n_columns == 1 and len(self.labels) == 2
        self.negated = self.binary and self.post in ("LOGISTIC", "PROBIT")
        if self.negated:
            # [-s, s] out of one GEMM: negating the coefficients and the intercept negates each
            # product and sum exactly.
            self.coef = np.concatenate([-self.coef, self.coef], axis=1)
            self.intercepts = np.concatenate([-self.intercepts, self.intercepts])
        self.scores = _Scores(self.coef, self.intercepts)
        self.uses_blas = self.scores.uses_blas()
        self.compiled = _Compiled(self) if self.scores.compiled else None

    def compiled_run(self, x, scaler: tuple = NO_SCALER):
        """_run's results through the one compiled call (_Compiled), or None where it does not serve
        (no library, not float32 rows of the coefficients' width, no rows, no scratch memory).
        `scaler`: a Scaler's offset and scale before the GEMM (ml_chain.py)."""
        lib, compiled = native.LIB, self.compiled
        if (lib is None or compiled is None or type(x) is not np.ndarray or x.dtype != native.F32 or x.ndim != 2
                or x.shape[1] != compiled.k or not x.shape[0] or not x.flags.c_contiguous):
            return None
        return compiled(lib, x, scaler)

    def _run(self, x):
        out = self.compiled_run(x)
        if out is not None:
            return out
        x = _rows(x)
        if x.shape[1] != self.coef.shape[0]:
            raise ValueError(f"x has {x.shape[1]} features; the coefficients expect {self.coef.shape[0]}")
        scores = self.scores(x)
        if self.binary:
            return self._binary(scores)
        return self.transformed(scores)

    def transformed(self, scores: np.ndarray, negated: bool = False):
        """(labels, scores) of a model that is not binary from its GEMM's (rows, columns) output, or from
        that output negated (LOGISTIC only: _Compiled's call did logistic's first step)."""
        # the GEMM's output is this run's own: LOGISTIC goes in place
        if self.post == "LOGISTIC":
            scores = logistic_of_negated(scores) if negated else logistic_in_place(scores)
        else:
            scores = post_transform(self.post, scores)
        if self.n_columns == 1:
            labels = np.where(scores[:, 0] > 0, self.labels[-1], self.labels[0])
        else:
            labels = self.labels.take(scores.argmax(axis=1))
        return (labels, scores.astype(np.float32, copy=False))

    def _binary(self, scores: np.ndarray):
        """(labels, scores) of a binary model from its GEMM's output (see the class doc)."""
        s = scores[:, -1]
        labels = self.labels.take((s > 0).view(np.int8))
        if self.negated and self.post == "LOGISTIC":
            return (labels, logistic_in_place(scores))  # on the GEMM's own output
        if self.negated:
            return (labels, post_transform(self.post, scores).astype(np.float32))
        both = np.empty((len(s), 2), dtype=np.float32)
        both[:, 1] = s
        np.subtract(1, s, out=both[:, 0])
        return (labels, both)


@register("LinearRegressor", domain=ML)
class LinearRegressor(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.targets = self.attr_int("targets", 1, lo=1)
        self.post = self.attr_str("post_transform", "NONE", choices=POST_TRANSFORMS)
        coef = np.asarray(self.attr("coefficients"), dtype=np.float32)
        self.coef = coef.reshape(self.targets, -1).T.copy()
        intercepts = self.attr("intercepts", None)
        self.intercepts = np.asarray(intercepts if intercepts else [0.0] * self.targets, dtype=np.float32)
        self.scores = _Scores(self.coef, self.intercepts)
        self.uses_blas = self.scores.uses_blas()

    def _run(self, x):
        x = _rows(x)
        if x.shape[1] != self.coef.shape[0]:
            raise ValueError(f"x has {x.shape[1]} features; the coefficients expect {self.coef.shape[0]}")
        scores = self.scores(x)  # this run's own float32 array: no copy unless a transform made float64
        return (post_transform(self.post, scores).astype(np.float32, copy=False),)


KERNELS = ("LINEAR", "POLY", "RBF", "SIGMOID")


class _Svm(OpKernel):
    """The kernel function of SVMClassifier/SVMRegressor between rows and support vectors."""

    def __init__(self, node):
        super().__init__(node)
        self.kernel = self.attr_str("kernel_type", "LINEAR", choices=KERNELS)
        params = list(self.attr("kernel_params", None) or [0.0, 0.0, 0.0])
        self.gamma, self.coef0, self.degree = (float(v) for v in (params + [0.0] * 3)[:3])
        self.post = self.attr_str("post_transform", "NONE", choices=POST_TRANSFORMS)

    def kernel_matrix(self, x: np.ndarray, sv: np.ndarray) -> np.ndarray:
        if self.kernel == "RBF":
            d2 = (x * x).sum(1)[:, None] + (sv * sv).sum(1)[None, :] - 2 * x @ sv.T
            return np.exp(-self.gamma * np.maximum(d2, 0))
        dot = x @ sv.T
        if self.kernel == "POLY":
            return (self.gamma * dot + self.coef0) ** self.degree
        if self.kernel == "SIGMOID":
            return np.tanh(self.gamma * dot + self.coef0)
        return dot


@register("SVMRegressor", domain=ML)
class SVMRegressor(_Svm):
    def __init__(self, node):
        super().__init__(node)
        self.n_sv = self.attr_int("n_supports", 0, lo=0)
        coef = np.asarray(self.attr("coefficients"), dtype=np.float64)
        self.rho = float((self.attr("rho", None) or [0.0])[0])
        self.one_class = self.attr_bool("one_class", 0)
        if self.n_sv:
            self.sv = np.asarray(self.attr("support_vectors"), dtype=np.float64).reshape(self.n_sv, -1)
            self.coef = coef
        else:  # a linear model: the coefficients are the weights of the features
            self.sv, self.coef = None, coef

    def _run(self, x):
        x = _rows(x).astype(np.float64)
        if self.sv is None:
            scores = x @ self.coef + self.rho
        else:
            scores = self.kernel_matrix(x, self.sv) @ self.coef + self.rho
        if self.one_class:
            scores = np.where(scores > 0, 1.0, -1.0)
        return (post_transform(self.post, scores[:, None]).astype(np.float32),)


@register("SVMClassifier", domain=ML)
class SVMClassifier(_Svm):
    """One-vs-one votes over support vectors (or a linear model without them); probabilities from
    the pairwise Platt scaling (prob_a/prob_b) are not computed: models with them are refused."""

    def __init__(self, node):
        super().__init__(node)
        self.labels = class_labels(self, "classlabels_ints")
        if self.labels is None:
            raise self.bad_attr("classlabels_ints", None, "classlabels_ints or classlabels_strings")
        if self.attr("prob_a", None):
            raise self.bad_attr("prob_a", "present", "no prob_a/prob_b (probability estimates are not supported)")
        self.vectors_per_class = self.attr_ints("vectors_per_class", None) or []
        self.coef = np.asarray(self.attr("coefficients"), dtype=np.float64)
        self.rho = np.asarray(self.attr("rho", None) or [0.0], dtype=np.float64)
        n_sv = sum(self.vectors_per_class)
        self.sv = (np.asarray(self.attr("support_vectors"), dtype=np.float64).reshape(n_sv, -1) if n_sv else None)

    def _run(self, x):
        x = _rows(x).astype(np.float64)
        n_classes = len(self.labels)
        if self.sv is None:
            coef = self.coef.reshape(-1, x.shape[1])
            scores = x @ coef.T + self.rho[: coef.shape[0]]
            scores = post_transform(self.post, scores)
            labels = _labels_from_scores(self.labels, scores, 0.0)
            return (labels, scores.astype(np.float32))
        k = self.kernel_matrix(x, self.sv)
        starts = np.concatenate([[0], np.cumsum(self.vectors_per_class)])
        coef = self.coef.reshape(n_classes - 1, -1)
        votes = np.zeros((len(x), n_classes))
        decisions = []
        pair = 0
        for i in range(n_classes):  # one-vs-one pairs: a loop over class pairs, vectorized over rows
            for j in range(i + 1, n_classes):
                si, sj = slice(starts[i], starts[i + 1]), slice(starts[j], starts[j + 1])
                d = k[:, si] @ coef[j - 1, si] + k[:, sj] @ coef[i, sj] + self.rho[pair]
                votes[:, i] += d > 0
                votes[:, j] += d <= 0
                decisions.append(d)
                pair += 1
        scores = np.stack(decisions, axis=1)
        labels = self.labels[votes.argmax(axis=1)]
        if n_classes == 2:  # one decision d: labels[0] where d > 0; scores [-d, d] as onnxruntime writes them
            labels = np.where(scores[:, 0] > 0, self.labels[0], self.labels[1])
            scores = np.concatenate([-scores, scores], axis=1)
        return (labels, post_transform(self.post, scores).astype(np.float32))
