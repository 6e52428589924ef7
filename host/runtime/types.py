"""ONNX value types beyond tensors: their names in ONNX words, and the Python values that hold them.

A value's declared type is a `TypeProto`; the host keeps one (`ValueMeta.type`) only for values that
are not plain tensors. What a run holds for each kind, as onnxruntime's Python API hands them out:

    tensor(T)       a NumPy array (or a DeviceTensor on a plugin's device)
    seq(T)          a Python list of the values of T
    optional(T)     None, or a value of T
    map(K, V)       a Python dict (ai.onnx.ml ops; seq(map(...)) is a list of dicts)

Kernels of the CPU EP may return any of these for an output whose declared type is not a tensor;
the host passes such values through untouched (no np.asarray), host/runtime/executor.py.
"""

from __future__ import annotations

import numpy as np
import onnx

from abi.dtypes import elem_name
from host.errors import InvalidArgument, ModelError

# What a graph input or output may be: tensors and the containers the executor carries.
_KINDS = ("tensor_type", "sequence_type", "optional_type", "map_type")


def elem_text(elem_type: int) -> str:
    """An element type in ONNX words: 1 -> 'float', 7 -> 'int64', 16 -> 'bfloat16' (one table: abi.dtypes)."""
    return elem_name(elem_type)


def type_text(tp: onnx.TypeProto | None, elem_type: int = 0) -> str:
    """A TypeProto in ONNX words: 'tensor(float)', 'seq(tensor(int64))', 'optional(seq(tensor(float)))'.
    With no TypeProto, the tensor of `elem_type`."""
    if tp is None:
        return f"tensor({elem_text(elem_type)})" if elem_type else "tensor"
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return type_text(None, tp.tensor_type.elem_type)
    if kind == "sequence_type":
        return f"seq({type_text(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_text(tp.optional_type.elem_type)})"
    if kind == "map_type":
        return f"map({elem_text(tp.map_type.key_type)},{type_text(tp.map_type.value_type)})"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({elem_text(tp.sparse_tensor_type.elem_type)})"
    return kind or "an undefined type"


def is_tensor_type(tp: onnx.TypeProto) -> bool:
    return tp.WhichOneof("value") in ("tensor_type", None)


def check_io_type(name: str, tp: onnx.TypeProto, what: str) -> None:
    """A graph input or output the executor cannot carry is a ModelError naming its type."""
    kind = tp.WhichOneof("value")
    if kind is not None and kind not in _KINDS:
        raise ModelError(f"{what} '{name}' has type {type_text(tp)}; supported: tensor, seq, optional and map "
                         "values")
    if kind in ("sequence_type", "optional_type"):
        inner = tp.sequence_type.elem_type if kind == "sequence_type" else tp.optional_type.elem_type
        check_io_type(name, inner, what)


def value_text(value) -> str:
    """The type of a Python value in ONNX words, for error messages."""
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        try:
            return f"tensor({elem_text(onnx.helper.np_dtype_to_tensor_dtype(value.dtype))})"
        except (KeyError, TypeError, ValueError):
            return f"an array of dtype {value.dtype}"
    if isinstance(value, (list, tuple)):
        return f"seq({value_text(value[0])})" if value else "seq (empty)"
    if isinstance(value, dict):
        return "map"
    dtype = getattr(value, "dtype", None)
    if dtype is not None:  # a device tensor
        return value_text(np.empty(0, dtype))
    return type(value).__name__


def check_feed(name: str, tp: onnx.TypeProto, value):
    """A feed for an input of non-tensor type `tp`, checked and normalised (sequences to lists of
    C-contiguous arrays); InvalidArgument naming both types in ONNX words when it does not fit."""
    try:
        return _normalise(tp, value)
    except _Mismatch:
        raise InvalidArgument(f"input '{name}': expected {type_text(tp)}, got {value_text(value)}") from None


class _Mismatch(Exception):
    pass


def _normalise(tp: onnx.TypeProto, value):
    kind = tp.WhichOneof("value")
    if kind == "optional_type":
        return None if value is None else _normalise(tp.optional_type.elem_type, value)
    if kind == "sequence_type":
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [_normalise(tp.sequence_type.elem_type, v) for v in value]
    if kind == "map_type":
        if not isinstance(value, dict):
            raise _Mismatch
        return dict(value)
    if value is None or isinstance(value, (list, tuple, dict)):
        raise _Mismatch
    arr = np.asarray(value, order="C")
    want = tp.tensor_type.elem_type if kind == "tensor_type" else 0
    if want and onnx.helper.np_dtype_to_tensor_dtype(arr.dtype) != want:
        raise _Mismatch
    return arr


def host_value(value, to_host):
    """A run's value as the caller gets it: arrays in host memory that the caller owns, recursively
    through lists, tuples and dicts; None stays None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_owned(v, to_host) for v in value]
    if isinstance(value, dict):
        return {k: _owned(v, to_host) for k, v in value.items()}
    arr = to_host(value)
    return arr if arr.flags.owndata else arr.copy()


def _owned(value, to_host):
    """Inside a container: always a copy (the element may be a feed's own array)."""
    if value is None or isinstance(value, (list, tuple, dict)):
        return host_value(value, to_host)
    if isinstance(value, np.ndarray):
        return value.copy()
    if hasattr(value, "device_type"):  # a DeviceTensor
        return np.array(to_host(value))
    return value  # a Python number or string (a map's values)


__all__ = ["check_feed", "check_io_type", "elem_text", "host_value", "is_tensor_type", "type_text", "value_text"]
