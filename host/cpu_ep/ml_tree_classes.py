"""TreeEnsembleClassifier's last step: from the summed leaf weights per class to labels and scores,
by onnxruntime's rules (its TreeAggregatorClassifier and write_scores), which the ONNX
specification leaves open for two labels.

What onnxruntime tracks besides the sums: whether any reached leaf names a class at all (its
`has_score`, per row). With two labels:
- base_values of 2: where class 1 is scored, s1 = base[1] + s0 and s0 = -s1 (the class-1 sum and
  base[0] are dropped); elsewhere each class gets its base value.
- base_values of 1 (added to s0) or none: where class 1 is not scored, only s0 is kept and the
  second column is made up from it (below).
- The deciding score is s1 where class 1 is scored, else s0 where class 0 is, else 0.
- Binary case (every weight names the same class id): label 1 where that score is > 0.5 (all weights
  >= 0) or > 0 (some negative); a made-up second column is [1 - s, s] (all >= 0) or [-s, s],
  and [logistic(-s), logistic(s)] under LOGISTIC either way.
- Otherwise (weights for both class ids): the label is labels[1] where the deciding score is > 0;
  onnxruntime returns the bare index (0 or 1) for integer labels, which ephost repeats. A made-up
  column is [-s, s] without base values and is left unset with one base value (ephost writes 0).
- PROBIT on a kept single score writes probit(s) and leaves the second column unset (0 here).
- A class that no reached leaf names is written as 0 (before the post transform), base value or not.
With more labels, base values are added to the first classes (and mark them scored), and the label
is the highest among scored classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host.cpu_ep.ml_common import logistic, post_transform


@dataclass
class ClassRules:
    """What the finalization needs of a classifier node. `scored[c]`: True when every leaf names
    class c (so every row scores it), False when no leaf does, None when it depends on the row."""

    labels: np.ndarray
    post: str
    base: np.ndarray | None
    binary_case: bool
    all_positive: bool
    scored: list

    @classmethod
    def of(cls, labels, post, base, class_ids, weights, has_weight, leaf) -> ClassRules:
        named = has_weight[leaf]
        scored = [True if named[:, c].all() else False if not has_weight[:, c].any() else None
                  for c in range(has_weight.shape[1])]
        return cls(labels, post, base, len(labels) == 2 and len(set(class_ids)) == 1,
                   bool((weights >= 0).all()), scored)

    @property
    def row_free(self) -> bool:
        """Whether every class is scored by every row or by none (no per-row flags to work out)."""
        return None not in self.scored

    def base_size(self) -> int:
        return 0 if self.base is None else self.base.size

    def has(self, c: int, has_weight: np.ndarray, leaves: np.ndarray):
        """Whether each row scores class c: a bool for all rows when the model decides it, else (rows,)."""
        if self.scored[c] is not None:
            return self.scored[c]
        return has_weight[:, c].take(leaves).any(axis=1)


def _where(cond, a, b):
    """np.where, or a or b itself when `cond` holds for every row (a Python bool)."""
    if isinstance(cond, bool):
        return a if cond else b
    return np.where(cond, a, b)


def two_labels(rules: ClassRules, sums: np.ndarray, h0, h1):
    """(labels, float32 scores) of a two-label model from (rows, 2) sums and the rows' scored flags."""
    if rules.binary_case and h0 is True and h1 is False and rules.base_size() <= 1:
        return _class0_only(rules, sums[:, 0])
    s0, s1 = sums[:, 0], sums[:, 1]
    base = rules.base
    n_base = 0 if base is None else base.size
    kept = True  # whether the row keeps two scores (else onnxruntime made one up from s0)
    if n_base == 2:
        s1 = _where(h1, base[1] + s0, s1 + base[1])
        s0 = _where(h1, -s1, s0 + base[0])
    elif n_base <= 1:
        if n_base == 1:
            s0 = s0 + base[0]
        kept = h1
    deciding = _where(h1, s1, _where(h0, s0, 0.0))
    if rules.binary_case:
        positive = deciding > 0.5 if rules.all_positive else deciding > 0
        made_up = "one_minus" if rules.all_positive else "negate"
        labels = rules.labels[positive.astype(np.intp)]
    else:
        positive = deciding > 0
        made_up = "negate" if n_base == 0 else "unset"
        indices = positive.astype(np.intp)
        labels = rules.labels[indices] if rules.labels.dtype == object else indices.astype(np.int64)
    # A class no reached leaf names is written as 0 (onnxruntime's ScoreValue reads 0 without has_score).
    zero = np.zeros_like(sums[:, 0])
    s0, s1 = _where(h0, s0, zero), _where(h1, s1, zero)
    both = None if kept is False else post_transform(rules.post, np.stack([s0, s1], axis=1))
    single = None if kept is True else _made_up(rules.post, made_up, np.asarray(s0))
    scores = _where(kept if isinstance(kept, bool) else kept[:, None], both, single)
    return labels, scores.astype(np.float32)


def _class0_only(rules: ClassRules, s: np.ndarray):
    """two_labels for the converters' binary models (skl2onnx's forests and boosting, XGBoost's,
    LightGBM's): every leaf scores class 0, at most one base value, so every row keeps one score s
    and the second column is made up; the same results in the fewest array operations (batch 1)."""
    if rules.base is not None:
        s = s + rules.base[0]
    positive = s > 0.5 if rules.all_positive else s > 0
    labels = rules.labels.take(positive.view(np.int8))
    out = np.empty((s.size, 2), dtype=np.float32)
    if rules.post == "PROBIT":
        out[:, 0], out[:, 1] = post_transform("PROBIT", s), 0
    elif rules.post == "LOGISTIC":
        out[:, 0], out[:, 1] = logistic(-s), logistic(s)
    else:
        out[:, 1] = s
        if rules.all_positive:
            np.subtract(1, s, out=out[:, 0])
        else:
            np.negative(s, out=out[:, 0])
    return labels, out


def _made_up(post: str, how: str, s: np.ndarray) -> np.ndarray:
    """onnxruntime's two columns from one kept score (write_scores with one value)."""
    out = np.zeros((s.size, 2), dtype=s.dtype)
    if post == "PROBIT":
        out[:, 0] = post_transform("PROBIT", s)
    elif post == "LOGISTIC" and how != "unset":
        out[:, 0], out[:, 1] = logistic(-s), logistic(s)
    elif how == "one_minus":
        out[:, 0], out[:, 1] = 1 - s, s
    elif how == "negate":
        out[:, 0], out[:, 1] = -s, s
    else:
        out[:, 0] = s
    return out


def many_labels(rules: ClassRules, sums: np.ndarray, scored: list):
    """(labels, float32 scores) with more than two labels: base values on the first classes, the
    label the highest scored class, then the post transform over all."""
    scores = sums
    if rules.base is not None:
        scores = sums.copy()
        n = min(rules.base.size, scores.shape[1])
        scores[:, :n] += rules.base[:n]
        scored = [True] * n + scored[n:]
    if all(flag is True for flag in scored):
        best = scores.argmax(axis=1)
    else:
        flags = np.stack([np.broadcast_to(f is not False if isinstance(f, bool) else f, (len(scores),))
                          for f in scored], axis=1)
        best = np.where(flags, scores, -np.inf).argmax(axis=1)
    return rules.labels[best], post_transform(rules.post, scores).astype(np.float32)
