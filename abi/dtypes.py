"""ONNX element types <-> NumPy dtypes, shared by the host and plugins."""

from __future__ import annotations

import numpy as np

# ONNX TensorProto.DataType values; bfloat16 and 8-bit floats are not supported.
ONNX_TO_NUMPY: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.uint8), 3: np.dtype(np.int8), 4: np.dtype(np.uint16),
    5: np.dtype(np.int16), 6: np.dtype(np.int32), 7: np.dtype(np.int64), 9: np.dtype(np.bool_),
    10: np.dtype(np.float16), 11: np.dtype(np.float64), 12: np.dtype(np.uint32), 13: np.dtype(np.uint64),
    8: np.dtype(object),  # string tensors: object arrays of str, as onnxruntime returns them
}
NUMPY_TO_ONNX: dict[np.dtype, int] = {v: k for k, v in ONNX_TO_NUMPY.items()}


def to_numpy(elem_type: int) -> np.dtype:
    try:
        return ONNX_TO_NUMPY[elem_type]
    except KeyError:
        raise TypeError(f"ONNX element type {elem_type} is not supported; "
                        f"supported: {sorted(ONNX_TO_NUMPY)}") from None


def to_onnx(dtype) -> int:
    dt = np.dtype(dtype)
    try:
        return NUMPY_TO_ONNX[dt]
    except KeyError:
        raise TypeError(f"dtype {dt} has no ONNX element type here; "
                        f"supported: {[str(d) for d in ONNX_TO_NUMPY.values()]}") from None
