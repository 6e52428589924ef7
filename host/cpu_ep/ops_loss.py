"""Training losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 12+).

Both pick, per sample and spatial position, the (log-)probability of the target class:
loss[n, d...] = -x[n, target[n, d...], d...] * weight[target[n, d...]], where a target equal to
`ignore_index` contributes 0 to the loss and 0 to the weights. `reduction`: 'none' keeps that
tensor, 'sum' adds it up, 'mean' divides the sum by the sum of the weights taken (the number of
targets not ignored when there is no weight input). Half types compute in float32.
"""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel, compute_dtype
from host.cpu_ep.registry import register

REDUCTIONS = ("none", "sum", "mean")


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


class _Loss(OpKernel):
    def __init__(self, node):
        super().__init__(node)
        self.reduction = self.attr_str("reduction", "mean", REDUCTIONS)
        ignore = self.attr("ignore_index", None)
        self.ignore_index = None if ignore is None else self.attr_int("ignore_index")

    def _check(self, x: np.ndarray, target: np.ndarray) -> None:
        if x.ndim < 2:
            raise ValueError(f"input must have shape (N, C, d1, ...), got shape {x.shape}")
        if target.shape != (x.shape[0], *x.shape[2:]):
            raise ValueError(f"target must have shape {(x.shape[0], *x.shape[2:])} (input {x.shape} without "
                             f"its class axis), got {target.shape}")

    def _nll(self, logp: np.ndarray, target: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        """The reduced loss from log-probabilities (N, C, d...) in the compute dtype."""
        target = target.astype(np.int64, copy=False)
        valid = np.ones(target.shape, bool) if self.ignore_index is None else target != self.ignore_index
        classes = logp.shape[1]
        bad = valid & ((target < 0) | (target >= classes))
        if bad.any():
            raise ValueError(f"target value {int(target[bad][0])} is out of range: classes are 0..{classes - 1}"
                             + ("" if self.ignore_index is None else f" (ignore_index {self.ignore_index})"))
        safe = np.where(valid, target, 0)
        picked = np.take_along_axis(logp, safe[:, None, ...], axis=1)[:, 0]
        w = (np.ones_like(picked) if weight is None else weight.astype(logp.dtype)[safe])
        w = np.where(valid, w, 0).astype(logp.dtype)
        loss = -picked * w
        if self.reduction == "none":
            return loss
        if self.reduction == "sum":
            return np.sum(loss)
        return np.sum(loss) / np.sum(w)


@register("NegativeLogLikelihoodLoss", since=12)
class NegativeLogLikelihoodLoss(_Loss):
    """x holds log-probabilities already (N, C, d1, ...)."""

    def _run(self, x, target, weight=None):
        self._check(x, target)
        ct = compute_dtype(x.dtype)
        return (np.asarray(self._nll(x.astype(ct, copy=False), target, weight)).astype(x.dtype),)


@register("SoftmaxCrossEntropyLoss", since=12)
class SoftmaxCrossEntropyLoss(_Loss):
    """log_softmax over the class axis (1), then the NLL loss; the optional second output is log_prob."""

    def _run(self, scores, labels, weight=None):
        self._check(scores, labels)
        logp = _log_softmax(scores.astype(compute_dtype(scores.dtype), copy=False), axis=1)
        loss = np.asarray(self._nll(logp, labels, weight)).astype(scores.dtype)
        return (loss, logp.astype(scores.dtype)) if self.n_outputs > 1 else (loss,)
