"""String and text ops on string tensors (NumPy object arrays of Python str, as onnxruntime returns them):
StringNormalizer, StringConcat, StringSplit, RegexFullMatch, and TfIdfVectorizer (int or string tokens)."""

from __future__ import annotations

import re

import numpy as np

from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register
from host.errors import InvalidArgument


def _strings(x: np.ndarray, what: str) -> np.ndarray:
    if x.dtype != object:
        raise InvalidArgument(f"{what} must be a tensor(string) (object array of str); got dtype {x.dtype}")
    return x


def _object_array(values, shape) -> np.ndarray:
    """An object array of `shape` from a flat list (np.array would make a '<U' array, or nest lists)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


def _number_text(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "NaN"
        if v in (float("inf"), float("-inf")):
            return "INF" if v > 0 else "-INF"
        return f"{v:.8g}"
    return str(int(v))  # bool as 1 / 0, as onnxruntime writes it


def to_strings(x: np.ndarray) -> np.ndarray:
    """Cast to tensor(string) as onnxruntime writes numbers: floats with 8 significant digits ('%.8g',
    'NaN', 'INF', '-INF'), integers in decimal, booleans as 1 and 0."""
    if x.dtype == object:
        return x.copy()
    values = x.astype(np.float64) if x.dtype.kind == "f" else x
    return _object_array([_number_text(v) for v in values.reshape(-1).tolist()], x.shape)


@register("StringNormalizer", since=10)
class StringNormalizer(OpKernel):
    """Drops stop words (case-sensitive or not), then lower- or upper-cases what is left. X is [C] or
    [1, C]; when every word is dropped the output is one empty string ([1] or [1, 1]), as onnxruntime does."""

    def __init__(self, node):
        super().__init__(node)
        self.action = self.attr_str("case_change_action", "NONE", ("LOWER", "UPPER", "NONE"))
        self.case_sensitive = self.attr_bool("is_case_sensitive", 0)
        stopwords = self.attr("stopwords", [], "a list of strings")
        words = [w.decode() if isinstance(w, bytes) else str(w) for w in stopwords]
        self.stopwords = set(words) if self.case_sensitive else {w.lower() for w in words}

    def _keep(self, word: str) -> bool:
        return (word if self.case_sensitive else word.lower()) not in self.stopwords

    def _change(self, word: str) -> str:
        return word.lower() if self.action == "LOWER" else word.upper() if self.action == "UPPER" else word

    def _run(self, x):
        _strings(x, "StringNormalizer's input X")
        if not (x.ndim == 1 or (x.ndim == 2 and x.shape[0] == 1)):
            raise InvalidArgument(f"StringNormalizer's input X must have shape [C] or [1, C]; got {list(x.shape)}")
        words = [self._change(w) for w in x.reshape(-1) if self._keep(w)]
        if not words:
            return (_object_array([""], (1,) * x.ndim),)
        return (_object_array(words, (1, len(words)) if x.ndim == 2 else (len(words),)),)


@register("StringConcat", since=20)
class StringConcat(OpKernel):
    """Element-wise X + Y with NumPy broadcasting."""

    def _run(self, x, y):
        _strings(x, "StringConcat's input X")
        _strings(y, "StringConcat's input Y")
        out = np.add(x, y, dtype=object)
        return (out if isinstance(out, np.ndarray) else _object_array([out], ()),)


@register("StringSplit", since=20)
class StringSplit(OpKernel):
    """Splits each string at `delimiter` (unset or empty: runs of spaces) at most
    `maxsplit` times. Y: X's shape plus one axis as long as the longest split, padded with ""; Z: the
    number of pieces of each string."""

    def __init__(self, node):
        super().__init__(node)
        delimiter = self.attr("delimiter", "", "a string")
        self.delimiter = (delimiter.decode() if isinstance(delimiter, bytes) else delimiter) or None
        self.maxsplit = self.attr_int("maxsplit", -1)

    def _split(self, text: str) -> list[str]:
        """onnxruntime's rules: the empty string has no pieces; without a delimiter, runs of spaces
        (not tabs or newlines) separate pieces and leading or trailing ones make none."""
        if not text:
            return []
        if self.delimiter is not None:
            return text.split(self.delimiter, self.maxsplit)
        pieces = re.split(" +", text.lstrip(" "), maxsplit=max(self.maxsplit, 0))
        return pieces[:-1] if pieces and pieces[-1] == "" else pieces

    def _run(self, x):
        _strings(x, "StringSplit's input X")
        pieces = [self._split(s) for s in x.reshape(-1)]
        width = max((len(p) for p in pieces), default=0)
        flat = [w for p in pieces for w in (*p, *([""] * (width - len(p))))]
        y = _object_array(flat, (*x.shape, width))
        z = np.array([len(p) for p in pieces], dtype=np.int64).reshape(x.shape)
        return y, z


@register("RegexFullMatch", since=20)
class RegexFullMatch(OpKernel):
    """Whether each string matches `pattern` entirely (RE2 syntax; Python's re agrees on the common
    subset: classes, repetition, alternation, anchors)."""

    def __init__(self, node):
        super().__init__(node)
        pattern = self.attr_str("pattern")
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise self.bad_attr("pattern", pattern, f"a regular expression ({exc})") from None

    def _run(self, x):
        _strings(x, "RegexFullMatch's input X")
        match = self.regex.fullmatch
        flat = np.fromiter((match(s) is not None for s in x.reshape(-1)), dtype=np.bool_, count=x.size)
        return (flat.reshape(x.shape),)


@register("TfIdfVectorizer", since=9)
class TfIdfVectorizer(OpKernel):
    """Counts the pool's n-grams (min_gram_length..max_gram_length tokens, the tokens of an n-gram
    max_skip_count or fewer positions apart) in each row of int or string tokens; TF gives the counts,
    IDF the weight of each n-gram present, TFIDF counts times weights. Output: float32 [rows,] size."""

    def __init__(self, node):
        super().__init__(node)
        self.min_n = self.attr_int("min_gram_length", lo=1)
        self.max_n = self.attr_int("max_gram_length", lo=self.min_n)
        self.max_skip = self.attr_int("max_skip_count", lo=0)
        self.mode = self.attr_str("mode", choices=("TF", "IDF", "TFIDF"))
        counts = self.attr_ints("ngram_counts")
        indexes = self.attr_ints("ngram_indexes", lo=0)
        pool = self.node.attrs.get("pool_int64s")
        if pool is None:
            strings = self.attr("pool_strings", allowed="pool_int64s or pool_strings")
            pool = [s.decode() if isinstance(s, bytes) else s for s in strings]
        self.table = self._table(list(pool), counts, indexes)
        self.size = max(indexes, default=-1) + 1
        weights = self.attr("weights", None)
        self.weights = None if weights is None else np.asarray(weights, np.float32)

    def _table(self, pool: list, counts: list[int], indexes: list[int]) -> dict[tuple, int]:
        """n-gram (a tuple of tokens) -> output position; the pool holds 1-grams from counts[0], 2-grams
        from counts[1], ..., and indexes gives the position of each n-gram in pool order."""
        bounds = [*counts, len(pool)]
        table, j = {}, 0
        for n in range(1, len(counts) + 1):
            segment = pool[bounds[n - 1]:bounds[n]]
            for start in range(0, len(segment), n):
                if j >= len(indexes):
                    raise self.bad_attr("ngram_indexes", indexes, "one index per n-gram of the pool")
                table[tuple(segment[start:start + n])] = indexes[j]
                j += 1
        return table

    def _count_row(self, tokens: list, out: np.ndarray) -> None:
        length = len(tokens)
        for start in range(length):
            for n in range(self.min_n, self.max_n + 1):
                for skip in range(self.max_skip + 1 if n > 1 else 1):
                    last = start + (skip + 1) * (n - 1)
                    if last >= length:
                        break
                    index = self.table.get(tuple(tokens[start:last + 1:skip + 1]))
                    if index is not None:
                        out[index] += 1

    def _run(self, x):
        if x.ndim not in (1, 2):
            raise InvalidArgument(f"TfIdfVectorizer's input must be [C] or [N, C]; got shape {list(x.shape)}")
        rows = x.reshape(-1, x.shape[-1]) if x.ndim == 2 else x.reshape(1, -1)
        out = np.zeros((rows.shape[0], self.size), np.float32)
        for row, counts in zip(rows.tolist(), out):
            self._count_row(row, counts)
        weights = self.weights if self.weights is not None else np.ones(self.size, np.float32)
        if self.mode == "IDF":
            out = np.minimum(out, 1) * weights
        elif self.mode == "TFIDF":
            out = out * weights
        return (out if x.ndim == 2 else out.reshape(-1),)
