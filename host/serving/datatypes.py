"""KServe v2 / Triton tensor datatypes <-> NumPy dtypes, and ONNX type strings -> NumPy.

One table serves the JSON protocol (the `datatype` field), the model metadata endpoint and the
model signature, so a name and its dtype cannot disagree between the three.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from host.errors import InvalidArgument

# The KServe v2 datatype names (https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/)
# and the NumPy dtype each one decodes to. BYTES holds strings: NumPy object arrays, as onnxruntime
# takes string tensors.
KSERVE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(object),
}
NUMPY_TO_KSERVE: dict[np.dtype, str] = {v: k for k, v in KSERVE_TO_NUMPY.items()}

# onnxruntime's NodeArg.type strings ("tensor(float)") that are not NumPy dtype names; ephost's
# NodeArg writes the same strings, so one parser reads the metadata of both backends.
_ONNX_TYPE_NAMES = {"float": "float32", "double": "float64", "string": "object", "bfloat16": "bfloat16"}


def to_numpy(datatype: str) -> np.dtype:
    """The NumPy dtype of a KServe datatype name; InvalidArgument for a name the protocol lacks."""
    try:
        return KSERVE_TO_NUMPY[datatype]
    except (KeyError, TypeError):
        raise InvalidArgument(f"datatype {datatype!r} is not a KServe v2 datatype; "
                              f"allowed: {sorted(KSERVE_TO_NUMPY)}") from None


def to_kserve(dtype) -> str:
    """The KServe datatype name of a NumPy dtype (strings: BYTES)."""
    dt = np.dtype(dtype)
    if dt.kind in "USO":
        return "BYTES"
    try:
        return NUMPY_TO_KSERVE[dt]
    except KeyError:
        raise InvalidArgument(f"dtype {dt} has no KServe v2 datatype; "
                              f"supported: {[str(d) for d in KSERVE_TO_NUMPY.values()]}") from None


def from_type_string(type_string: str) -> np.dtype:
    """NumPy dtype of a NodeArg type string such as 'tensor(float)' or 'tensor(int64)'."""
    inner = type_string.removeprefix("tensor(").removesuffix(")")
    name = _ONNX_TYPE_NAMES.get(inner, inner)
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise InvalidArgument(f"model value type {type_string!r} cannot be served: no NumPy dtype for it; "
                              f"served: tensors of {sorted(KSERVE_TO_NUMPY)}") from None
