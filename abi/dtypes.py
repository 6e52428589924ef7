"""ONNX element types <-> NumPy dtypes, shared by the host and plugins."""

from __future__ import annotations

import ml_dtypes
import numpy as np

STRING = 8  # TensorProto.STRING: NumPy object arrays of Python str, as onnxruntime returns them

FLOAT16, BFLOAT16 = 10, 16
# NumPy has no bfloat16: ml_dtypes' (the one onnx's numpy_helper uses) is a 2-byte dtype of kind 'V'.
BFLOAT16_DTYPE = np.dtype(ml_dtypes.bfloat16)

# The 8-bit float and 4-bit integer types of onnx (17..22): ml_dtypes' scalar types, the ones onnx's
# numpy_helper.to_array returns (it unpacks int4/uint4, stored two per byte, to one value per element).
# They are storage types: quantization kernels and Cast read and write them, arithmetic does not.
LOW_BIT_TYPES: dict[int, np.dtype] = {
    17: np.dtype(ml_dtypes.float8_e4m3fn), 18: np.dtype(ml_dtypes.float8_e4m3fnuz),
    19: np.dtype(ml_dtypes.float8_e5m2), 20: np.dtype(ml_dtypes.float8_e5m2fnuz),
    21: np.dtype(ml_dtypes.uint4), 22: np.dtype(ml_dtypes.int4),
}
# float4e2m1 (23), float8e8m0 (24), uint2 (25), int2 (26): in ml_dtypes 0.5 and later.
LOW_BIT_TYPES.update({t: np.dtype(getattr(ml_dtypes, name)) for t, name in (
    (23, "float4_e2m1fn"), (24, "float8_e8m0fnu"), (25, "uint2"), (26, "int2")) if hasattr(ml_dtypes, name)})

# ONNX TensorProto.DataType values (complex types are not supported).
ONNX_TO_NUMPY: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.uint8), 3: np.dtype(np.int8), 4: np.dtype(np.uint16),
    5: np.dtype(np.int16), 6: np.dtype(np.int32), 7: np.dtype(np.int64), STRING: np.dtype(object),
    9: np.dtype(np.bool_), FLOAT16: np.dtype(np.float16), 11: np.dtype(np.float64), 12: np.dtype(np.uint32),
    13: np.dtype(np.uint64), BFLOAT16: BFLOAT16_DTYPE, **LOW_BIT_TYPES,
}
# The half-precision element types: stored in 2 bytes, computed in float32 where NumPy has no kernel.
HALF_TYPES = frozenset({FLOAT16, BFLOAT16})
NUMPY_TO_ONNX: dict[np.dtype, int] = {v: k for k, v in ONNX_TO_NUMPY.items()}

# TensorProto.DataType names, for messages: 16 -> "tensor(bfloat16)" (onnx's own type strings).
_ONNX_NAMES = {
    0: "undefined", 1: "float", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    8: "string", 9: "bool", 10: "float16", 11: "double", 12: "uint32", 13: "uint64", 14: "complex64",
    15: "complex128", 16: "bfloat16", 17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2",
    20: "float8e5m2fnuz", 21: "uint4", 22: "int4", 23: "float4e2m1", 24: "float8e8m0", 25: "uint2", 26: "int2",
}


def elem_name(elem_type: int) -> str:
    """An element type in ONNX words: 1 -> 'float', 7 -> 'int64', 16 -> 'bfloat16'."""
    name = _ONNX_NAMES.get(int(elem_type))
    return name if name is not None else f"unknown element type {int(elem_type)}"


def type_name(elem_type: int) -> str:
    """The ONNX type string of an element type: 1 -> 'tensor(float)', 8 -> 'tensor(string)'."""
    return f"tensor({elem_name(elem_type)})"


def dtype_type_name(dtype) -> str:
    """The ONNX type string of a NumPy dtype ('tensor(double)'), or 'numpy <dtype>' where ONNX has none."""
    dt = np.dtype(dtype)
    et = NUMPY_TO_ONNX.get(dt)
    return type_name(et) if et is not None else f"numpy {dt}"


def supported_names() -> str:
    """The element types of ONNX_TO_NUMPY in ONNX words, for 'supported: ...' messages."""
    return ", ".join(type_name(t) for t in sorted(ONNX_TO_NUMPY))


HALF_DTYPES = frozenset({np.dtype(np.float16), BFLOAT16_DTYPE})


def is_half(dtype) -> bool:
    """True for float16 and bfloat16 dtypes."""
    return np.dtype(dtype) in HALF_DTYPES


def to_numpy(elem_type: int) -> np.dtype:
    try:
        return ONNX_TO_NUMPY[elem_type]
    except KeyError:
        raise TypeError(f"ONNX element type {type_name(elem_type)} is not supported; "
                        f"supported: {supported_names()}") from None


def to_onnx(dtype) -> int:
    dt = np.dtype(dtype)
    if dt.kind in "US":  # NumPy fixed-width text: an ONNX string tensor
        return STRING
    try:
        return NUMPY_TO_ONNX[dt]
    except KeyError:
        raise TypeError(f"dtype {dt} has no ONNX element type here; "
                        f"supported: {[str(d) for d in ONNX_TO_NUMPY.values()]}") from None
