"""OrtValue: onnxruntime's tensor handle, over a NumPy array (host) or a DeviceTensor (GPU).

Host values wrap the NumPy array itself (no copy). GPU values made here are CuPy arrays (the host
already needs CuPy to hand device memory to DLPack); GPU values that a session produced are read
back through the session's EP data transfer, so they need no CuPy.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

import abi
from abi.dtypes import NUMPY_TO_ONNX, dtype_type_name, to_numpy, to_onnx
from host.errors import InvalidArgument
from host.runtime.tensor import DeviceTensor, as_device_tensor

_DEVICE_TYPES = {"cpu": abi.DEVICE_CPU, "cuda": abi.DEVICE_GPU, "gpu": abi.DEVICE_GPU}


def type_string(dtype) -> str:
    """onnxruntime's type text for a NumPy dtype: tensor(float), tensor(double), tensor(string), ..."""
    dt = np.dtype(dtype)
    return dtype_type_name(dt) if dt in NUMPY_TO_ONNX else f"tensor({dt.name})"


def _device(device_type, device_id) -> int:
    if not isinstance(device_type, str) or device_type.lower() not in _DEVICE_TYPES:
        raise InvalidArgument(f"device_type must be 'cpu' or 'cuda'; got {device_type!r}")
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise InvalidArgument(f"device_id must be an integer >= 0; got {device_id!r}")
    return _DEVICE_TYPES[device_type.lower()]


def _numpy_dtype(element_type) -> np.dtype:
    """A NumPy dtype from a NumPy type/dtype or an ONNX TensorProto element type (int)."""
    try:
        if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
            return np.dtype(to_numpy(int(element_type)))
        dtype = np.dtype(element_type)
        to_onnx(dtype)  # rejects dtypes ONNX has no element type for
        return dtype
    except (TypeError, ValueError, KeyError):
        raise InvalidArgument(f"element_type must be a NumPy dtype or an ONNX element type with a NumPy "
                              f"equivalent; got {element_type!r}") from None


def _cupy(what: str):
    try:
        import cupy
    except ImportError as exc:
        raise InvalidArgument(f"{what} on 'cuda' needs the 'cupy' package, which cannot be imported ({exc}); "
                              "use device_type='cpu' or install cupy") from exc
    return cupy


def _on_gpu(make, device_id: int, what: str) -> DeviceTensor:
    cupy = _cupy(what)
    with cupy.cuda.Device(device_id):
        return as_device_tensor(make(cupy))


class OrtValue:
    """A tensor on the host or on a GPU, as onnxruntime's OrtValue; np.asarray and CuPy accept it."""

    __slots__ = ("_value", "_to_host")

    def __init__(self, value, to_host=None):
        if not isinstance(value, (np.ndarray, DeviceTensor)):
            raise InvalidArgument(f"OrtValue wraps a NumPy array or a DeviceTensor; got {type(value).__name__} "
                                  "(make one with OrtValue.ortvalue_from_numpy)")
        self._value = value
        self._to_host = to_host  # the producing session's copy to the host, for device values

    # -- factories (static, as in onnxruntime) ---------------------------------------------------
    @staticmethod
    def ortvalue_from_numpy(numpy_obj, device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """Wrap `numpy_obj` (host, no copy when C-contiguous) or copy it to GPU `device_id`."""
        where = _device(device_type, device_id)
        arr = np.asarray(numpy_obj, order="C")
        _numpy_dtype(arr.dtype)
        if where == abi.DEVICE_CPU:
            return OrtValue(arr)
        return OrtValue(_on_gpu(lambda cp: cp.asarray(arr), device_id, "ortvalue_from_numpy"))

    @staticmethod
    def ortvalue_from_shape_and_type(shape, element_type, device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """An uninitialised tensor of `shape` and `element_type` (NumPy type or ONNX element type)."""
        where = _device(device_type, device_id)
        if not isinstance(shape, (list, tuple)) or any(isinstance(d, bool) or not isinstance(d, (int, np.integer))
                                                       or d < 0 for d in shape):
            raise InvalidArgument(f"shape must be a list of integers >= 0; got {shape!r}")
        dims = tuple(int(d) for d in shape)
        dtype = _numpy_dtype(element_type)
        if where == abi.DEVICE_CPU:
            return OrtValue(np.empty(dims, dtype))
        return OrtValue(_on_gpu(lambda cp: cp.empty(dims, dtype), device_id, "ortvalue_from_shape_and_type"))

    # -- what onnxruntime's OrtValue answers -------------------------------------------------------
    @property
    def value(self):
        """The NumPy array or DeviceTensor underneath."""
        return self._value

    def numpy(self) -> np.ndarray:
        """The tensor as a NumPy array: the array itself for host memory, a host copy for GPU memory."""
        v = self._value
        if isinstance(v, np.ndarray):
            return v
        if self._to_host is not None:
            return np.asarray(self._to_host(v))
        cupy = _cupy("numpy()")
        return cupy.asnumpy(cupy.asarray(v))

    def device_name(self) -> str:
        return "cpu" if isinstance(self._value, np.ndarray) else "cuda"

    def shape(self) -> list[int]:
        return [int(d) for d in self._value.shape]

    def data_type(self) -> str:
        return type_string(self._value.dtype)

    def element_type(self) -> int:
        return to_onnx(self._value.dtype)

    def is_tensor(self) -> bool:
        return True

    def is_tensor_sequence(self) -> bool:
        return False

    def is_sparse_tensor(self) -> bool:
        return False

    def has_value(self) -> bool:
        return True

    def data_ptr(self) -> int:
        v = self._value
        return int(v.ctypes.data) if isinstance(v, np.ndarray) else int(v.ptr)

    def tensor_size_in_bytes(self) -> int:
        return math.prod(self._value.shape) * self._value.dtype.itemsize

    def update_inplace(self, np_arr) -> None:
        """Copy `np_arr` (same shape and dtype) into this tensor's memory."""
        src = np.asarray(np_arr)
        if tuple(src.shape) != tuple(self._value.shape) or src.dtype != self._value.dtype:
            raise InvalidArgument(f"update_inplace: expected shape {self.shape()} and dtype {self._value.dtype}; "
                                  f"got shape {list(src.shape)} and dtype {src.dtype}")
        if isinstance(self._value, np.ndarray):
            np.copyto(self._value, src)
            return
        cupy = _cupy("update_inplace")
        cupy.asarray(self._value).set(np.ascontiguousarray(src))

    # -- interop: NumPy, CuPy/torch (__cuda_array_interface__) and DLPack consumers ---------------
    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    @property
    def __cuda_array_interface__(self) -> dict:
        if isinstance(self._value, np.ndarray):
            raise AttributeError("__cuda_array_interface__ is only defined for GPU memory")
        return self._value.__cuda_array_interface__

    def __dlpack__(self, stream=None, **kwargs):
        return self._value.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return self._value.__dlpack_device__()

    def __repr__(self) -> str:
        return f"OrtValue(shape={self.shape()}, type={self.data_type()}, device={self.device_name()})"


def host_array_at(ptr: int, shape, element_type) -> np.ndarray:
    """A NumPy view of a caller's host buffer at address `ptr` (borrowed: never freed here)."""
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr <= 0:
        raise InvalidArgument(f"host buffer pointer must be a positive int; got {ptr!r}")
    dtype = _numpy_dtype(element_type)
    dims = tuple(int(d) for d in shape)
    nbytes = math.prod(dims) * dtype.itemsize
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype, count=math.prod(dims)).reshape(dims)


def unwrap(value):
    """The array or DeviceTensor inside an OrtValue; other values unchanged."""
    return value._value if isinstance(value, OrtValue) else value


__all__ = ["OrtValue", "host_array_at", "type_string", "unwrap"]
