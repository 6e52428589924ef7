"""Feature preprocessing and label ops of ai.onnx.ml: Scaler, Normalizer, Binarizer, Imputer,
OneHotEncoder, LabelEncoder, CategoryMapper, ArrayFeatureExtractor, FeatureVectorizer, ZipMap,
DictVectorizer.

String tensors are NumPy object arrays of str (as onnxruntime returns them). ZipMap's output is a
list of dicts and DictVectorizer's input a dict: non-tensor values, passed through as Python objects.
"""

from __future__ import annotations

import numpy as np

from host.cpu_ep.base import OpKernel
from host.cpu_ep.ml_common import class_labels
from host.cpu_ep.registry import register

ML = "ai.onnx.ml"


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(1, -1) if x.ndim == 1 else x


def _strings(values) -> np.ndarray:
    return np.array(list(values), dtype=object)


@register("Scaler", domain=ML)
class Scaler(OpKernel):
    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.offset = np.asarray(self.attr("offset", None) or [0.0], dtype=np.float32)
        self.scale = np.asarray(self.attr("scale", None) or [1.0], dtype=np.float32)

    def _run(self, x):
        y = np.subtract(x.astype(np.float32, copy=False), self.offset)  # a new float32 array: scaled in place
        return (np.multiply(y, self.scale, out=y),)


@register("Normalizer", domain=ML)
class Normalizer(OpKernel):
    """Rows divided by their MAX, L1 or L2 norm (rows whose norm is 0 are left as they are)."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.norm = self.attr_str("norm", "MAX", choices=("MAX", "L1", "L2"))

    def _run(self, x):
        x = _rows(x).astype(np.float32)
        if self.norm == "MAX":
            div = x.max(axis=1, keepdims=True)
        elif self.norm == "L1":
            div = np.abs(x).sum(axis=1, keepdims=True)
        else:
            div = np.sqrt((x * x).sum(axis=1, keepdims=True))
        return (np.where(div != 0, x / np.where(div == 0, 1, div), x).astype(np.float32),)


@register("Binarizer", domain=ML)
class Binarizer(OpKernel):
    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.threshold = self.attr_float("threshold", 0.0)

    def _run(self, x):
        return ((x > self.threshold).astype(x.dtype),)


@register("Imputer", domain=ML)
class Imputer(OpKernel):
    """Replaces `replaced_value` (NaN by default for floats) by the per-column imputed value."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        floats = self.attr("imputed_value_floats", None)
        ints = self.attr("imputed_value_int64s", None)
        if floats:
            self.values = np.asarray(floats, dtype=np.float32)
            self.replaced = self.attr_float("replaced_value_float", 0.0)
        elif ints:
            self.values = np.asarray(ints, dtype=np.int64)
            self.replaced = self.attr_int("replaced_value_int64", 0)
        else:
            raise self.bad_attr("imputed_value_floats", None, "imputed_value_floats or imputed_value_int64s")

    def _run(self, x):
        x2 = _rows(x)
        if self.values.size not in (1, x2.shape[1]):
            raise ValueError(f"{self.values.size} imputed values for {x2.shape[1]} columns (allowed: 1 or one per column)")
        hit = np.isnan(x2) if np.isnan(self.replaced) else x2 == self.replaced
        y = np.where(hit, np.broadcast_to(self.values.astype(x.dtype), x2.shape), x2)
        return (y.reshape(x.shape),)


@register("OneHotEncoder", domain=ML)
class OneHotEncoder(OpKernel):
    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        ints = self.attr("cats_int64s", None)
        strings = self.attr("cats_strings", None)
        cats = ints if ints else strings
        if not cats:
            raise self.bad_attr("cats_int64s", None, "cats_int64s or cats_strings")
        self.index = {(int(c) if ints else c): i for i, c in enumerate(cats)}
        self.zeros = self.attr_bool("zeros", 1)

    def _run(self, x):
        flat = x.reshape(-1)
        keys = flat.tolist() if x.dtype == object else [int(v) for v in flat]
        cols = np.fromiter((self.index.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        if not self.zeros and (cols < 0).any():
            bad = keys[int(np.flatnonzero(cols < 0)[0])]
            raise ValueError(f"value {bad!r} is not one of the categories (zeros=0 makes it an error)")
        y = np.zeros((len(keys), len(self.index)), dtype=np.float32)
        known = cols >= 0
        y[np.flatnonzero(known), cols[known]] = 1
        return (y.reshape(*x.shape, len(self.index)),)


def _lookup(table: dict, x: np.ndarray, default, out_dtype) -> np.ndarray:
    """Each element of x through `table` (missing keys: default); float NaN keys match NaN."""
    flat = x.reshape(-1).tolist()
    nan_value = table.get("nan", default) if "nan" in table else default
    out = [table.get(k, nan_value if (isinstance(k, float) and k != k) else default) for k in flat]
    arr = _strings(out) if np.dtype(out_dtype).kind == "O" else np.asarray(out, dtype=out_dtype)
    return arr.reshape(x.shape)


@register("LabelEncoder", domain=ML, since=1, until=1)
class LabelEncoderV1(OpKernel):
    """Strings -> their index in classes_strings, int64 -> the string at that index."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.classes = list(self.attr("classes_strings", None) or [])
        self.default_int = self.attr_int("default_int64", -1)
        self.default_str = self.attr_str("default_string", "_Unused")

    def _run(self, x):
        if x.dtype == object:
            return (_lookup({c: i for i, c in enumerate(self.classes)}, x, self.default_int, np.int64),)
        return (_lookup(dict(enumerate(self.classes)), x.astype(np.int64), self.default_str, object),)


def _keys_values(kernel: OpKernel, kind: str):
    """(list, dtype) of keys_* or values_* (opset 2) / *_tensor (opset 4)."""
    for suffix, dtype in (("strings", object), ("int64s", np.int64), ("floats", np.float32)):
        value = kernel.attr(f"{kind}_{suffix}", None)
        if value:
            return list(value), dtype
    tensor = kernel.attr(f"{kind}_tensor", None)
    if tensor is not None:
        tensor = np.asarray(tensor)
        return tensor.reshape(-1).tolist(), (object if tensor.dtype.kind in "OUS" else tensor.dtype)
    raise kernel.bad_attr(f"{kind}_*", None, f"one of {kind}_strings, {kind}_int64s, {kind}_floats, {kind}_tensor")


@register("LabelEncoder", domain=ML, since=2)
class LabelEncoder(OpKernel):
    """keys -> values of any of string / int64 / float (and tensors from opset 4)."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        keys, self.key_dtype = _keys_values(self, "keys")
        values, self.out_dtype = _keys_values(self, "values")
        if len(keys) != len(values):
            raise self.bad_attr("values", f"{len(values)} values", f"as many values as keys ({len(keys)})")
        self.table = {("nan" if isinstance(k, float) and k != k else k): v for k, v in zip(keys, values)}
        self.default = self._default()

    def _default(self):
        tensor = self.attr("default_tensor", None)
        if tensor is not None:
            value = np.asarray(tensor).reshape(-1)[0]
            return value.decode() if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value
        if np.dtype(self.out_dtype).kind == "O":
            return self.attr_str("default_string", "_Unused")
        if np.dtype(self.out_dtype).kind == "i":
            return self.attr_int("default_int64", -1)
        return self.attr_float("default_float", -0.0)

    def _run(self, x):
        return (_lookup(self.table, x, self.default, self.out_dtype),)


@register("CategoryMapper", domain=ML)
class CategoryMapper(OpKernel):
    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        ints = self.attr_ints("cats_int64s", None) or []
        strings = list(self.attr("cats_strings", None) or [])
        if len(ints) != len(strings):
            raise self.bad_attr("cats_strings", f"{len(strings)} strings", f"as many as cats_int64s ({len(ints)})")
        self.to_int = dict(zip(strings, ints))
        self.to_str = dict(zip(ints, strings))
        self.default_int = self.attr_int("default_int64", -1)
        self.default_str = self.attr_str("default_string", "_Unused")

    def _run(self, x):
        if x.dtype == object:
            return (_lookup(self.to_int, x, self.default_int, np.int64),)
        return (_lookup(self.to_str, x.astype(np.int64), self.default_str, object),)


@register("ArrayFeatureExtractor", domain=ML)
class ArrayFeatureExtractor(OpKernel):
    """data[..., indices] over the last axis; a 1-D input gives one row, as in onnxruntime."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def _run(self, data, indices):
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        last = data.shape[-1]
        if index.size and (index.min() < -last or index.max() >= last):
            raise ValueError(f"indices {index.tolist()} out of range for a last axis of {last}")
        out = data[..., index]
        return (out.reshape(1, -1) if data.ndim == 1 else out,)


@register("FeatureVectorizer", domain=ML)
class FeatureVectorizer(OpKernel):
    """Concatenates its inputs as float32 columns, each cut or zero-padded to inputdimensions[i]."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        self.dims = self.attr_ints("inputdimensions", lo=0)

    def _run(self, *inputs):
        if len(inputs) != len(self.dims):
            raise ValueError(f"{len(inputs)} inputs for {len(self.dims)} inputdimensions")
        rows = _rows(inputs[0]).shape[0]
        parts = []
        for x, dim in zip(inputs, self.dims):
            x2 = _rows(x).reshape(rows, -1).astype(np.float32)
            part = np.zeros((rows, dim), dtype=np.float32)
            part[:, : min(dim, x2.shape[1])] = x2[:, :dim]
            parts.append(part)
        return (np.concatenate(parts, axis=1),)


@register("ZipMap", domain=ML)
class ZipMap(OpKernel):
    """(rows, classes) scores -> a list of {label: score} dicts (a sequence of maps)."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        labels = class_labels(self)
        if labels is None:
            raise self.bad_attr("classlabels_int64s", None, "classlabels_int64s or classlabels_strings")
        self.labels = labels.tolist()

    def _run(self, x):
        x2 = _rows(x)
        if x2.shape[1] != len(self.labels):
            raise ValueError(f"{x2.shape[1]} scores per row for {len(self.labels)} class labels")
        return ([dict(zip(self.labels, row)) for row in x2.tolist()],)


@register("DictVectorizer", domain=ML)
class DictVectorizer(OpKernel):
    """A map {key: value} -> a (1, vocabulary) row, 0 for keys the map lacks."""

    uses_blas = False  # element-wise NumPy only (see OpKernel.uses_blas)

    def __init__(self, node):
        super().__init__(node)
        vocab = self.attr("string_vocabulary", None) or self.attr_ints("int64_vocabulary", None)
        if not vocab:
            raise self.bad_attr("string_vocabulary", None, "string_vocabulary or int64_vocabulary")
        self.vocab = list(vocab)

    def _run(self, mapping):
        maps = mapping if isinstance(mapping, list) else [mapping]
        if not all(isinstance(m, dict) for m in maps):
            raise TypeError(f"DictVectorizer takes a map (a dict); got {type(mapping).__name__}")
        values = [[m.get(k, 0) for k in self.vocab] for m in maps]
        return (np.asarray(values, dtype=_map_value_dtype(maps)),)


def _map_value_dtype(maps: list) -> np.dtype:
    """The element type of a map's values: NumPy scalars keep theirs, Python floats are float32
    (map(string, float), skl2onnx's default), ints int64, strings object."""
    sample = next((v for m in maps for v in m.values()), 0.0)
    if isinstance(sample, str):
        return np.dtype(object)
    if isinstance(sample, np.generic):
        return sample.dtype
    return np.dtype(np.int64) if isinstance(sample, int) else np.dtype(np.float32)
