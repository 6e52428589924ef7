"""Memory the host hands around: allocations from EP allocators and device tensors.

Host-memory values are always NumPy arrays (the CPU EP consumes them directly); memory that
lives on a device is a DeviceTensor. Borrowed memory (a caller's bound buffer) has no owner
and is never freed by the host.
"""

from __future__ import annotations

import math

import numpy as np

import abi
from abi.dtypes import BFLOAT16_DTYPE, to_numpy, to_onnx
from host.errors import InvalidArgument, OutOfMemoryError
from host.plugins.hostapi import STATUSES, ffi

MAX_TENSOR_BYTES = 1 << 62  # beyond any real device; keeps shape arithmetic inside int64


def check_output_dims(dims: tuple, dtype: np.dtype, what: str) -> None:
    """Dims a plugin asked for: each an integer >= 0, and the byte count inside int64 (checked
    before anything is allocated)."""
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{what}: dims {list(dims)} have a negative dimension; dims must be >= 0")
    count = math.prod(dims)
    if count * dtype.itemsize > MAX_TENSOR_BYTES:
        raise InvalidArgument(f"{what}: dims {list(dims)} hold {count} elements of {dtype.itemsize} bytes, beyond "
                              f"the {MAX_TENSOR_BYTES} bytes a tensor may have")


_LIVE = (False,)


class Allocation:
    """`size` bytes from an EP allocator; freed by close() or when garbage collected.

    A plain __del__ (guarded, idempotent) instead of weakref.finalize: one is made per kernel
    output, and finalize objects cost several microseconds each."""

    __slots__ = ("ptr", "size", "_allocator", "__weakref__")

    def __init__(self, allocator, size: int, stream=None, owner: str = "EP"):
        self._allocator = None  # set last: __del__ of a failed allocation frees nothing
        out = ffi.new("void**")
        use_stream = stream is not None and allocator.AllocOnStream is not None
        status = (allocator.AllocOnStream(allocator.ptr, size, stream, out) if use_stream
                  else allocator.Alloc(allocator.ptr, size, out))
        if status != ffi.NULL:
            item = STATUSES.get(status) or (abi.EP_FAIL, "unknown")
            STATUSES.release(status)
            if item[0] == abi.EP_OUT_OF_MEMORY:
                raise OutOfMemoryError(f"{owner}: out of memory allocating {size} bytes: {item[1]}", size)
            raise OutOfMemoryError(f"{owner}: allocation of {size} bytes failed: {item[1]}", size)
        if out[0] == ffi.NULL and size:
            raise OutOfMemoryError(f"{owner}: allocator returned NULL for {size} bytes", size)
        self.ptr = int(ffi.cast("uintptr_t", out[0]))
        self.size = size
        self._allocator = allocator

    def close(self) -> None:
        allocator, self._allocator = self._allocator, None
        # An allocator released with its factory (plugin unregistered, interpreter exit) took its
        # memory with it: freeing into it would only make the plugin complain about a stale pointer.
        if allocator is not None and not getattr(allocator, "released", _LIVE)[0]:
            try:
                allocator.Free(allocator.ptr, ffi.cast("void*", self.ptr))
            except Exception:  # noqa: BLE001 - also runs from __del__, which must not raise
                pass

    def __del__(self) -> None:
        self.close()


class HostBuffer:
    """Host memory from an EP allocator exposed to NumPy (np.asarray keeps it alive)."""

    __slots__ = ("allocation", "__array_interface__")

    def __init__(self, allocation: Allocation, shape: tuple, dtype: np.dtype):
        self.allocation = allocation
        self.__array_interface__ = {
            "data": (allocation.ptr, False), "shape": shape, "typestr": dtype.str, "version": 3}


def host_array(allocator, shape: tuple, dtype: np.dtype, stream=None) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    alloc = Allocation(allocator, max(nbytes, 1), stream)
    arr = np.asarray(HostBuffer(alloc, shape, dtype))
    # The array interface spells bfloat16 (ml_dtypes) as raw 2-byte void: view it as the dtype asked for.
    return arr if arr.dtype == dtype else arr.view(dtype)


class DeviceTensor:
    """A tensor in device memory: owned (an Allocation) or borrowed (a caller's pointer)."""

    __slots__ = ("ptr", "shape", "dtype", "device_type", "device_id", "owner", "stream", "__weakref__")

    def __init__(self, ptr: int, shape: tuple, dtype, device_type: int, device_id: int, owner=None, stream=None):
        self.ptr = ptr
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.device_type = device_type
        self.device_id = device_id
        self.owner = owner
        self.stream = stream

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def elem_type(self) -> int:
        return to_onnx(self.dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device_type != abi.DEVICE_GPU:
            raise AttributeError("__cuda_array_interface__ is only defined for GPU memory")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None}

    def __dlpack__(self, stream=None, **kwargs):
        import cupy  # the host needs CuPy only to hand device memory to DLPack consumers

        return cupy.asarray(self).__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return (2, self.device_id)  # kDLCUDA

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype}, device=({self.device_type}, {self.device_id}))"


def tensor_from_pointer(ptr: int, shape, elem_type: int, device_type: int = abi.DEVICE_GPU,
                        device_id: int = 0) -> DeviceTensor:
    """Borrow a caller's device buffer (never freed by ephost)."""
    if not isinstance(ptr, int) or ptr <= 0:
        raise InvalidArgument(f"device buffer pointer must be a positive int; got {ptr!r}")
    return DeviceTensor(ptr, tuple(shape), to_numpy(elem_type), device_type, device_id, owner=None)


def as_device_tensor(obj) -> DeviceTensor | None:
    """A DeviceTensor view of an object exposing __cuda_array_interface__ (CuPy, torch), or None."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    if cai.get("strides") not in (None, ()):
        expected = _contiguous_strides(cai["shape"], np.dtype(cai["typestr"]).itemsize)
        if tuple(cai["strides"]) != expected:
            raise InvalidArgument(f"device buffer must be C-contiguous; got strides {cai['strides']}, "
                                  f"expected {expected}")
    device_id = 0
    dev = getattr(obj, "device", None)
    if dev is not None and hasattr(dev, "id"):
        device_id = int(dev.id)
    elif dev is not None and hasattr(dev, "index") and dev.index is not None:
        device_id = int(dev.index)
    return DeviceTensor(int(cai["data"][0]), tuple(cai["shape"]), _cai_dtype(obj, cai["typestr"]),
                        abi.DEVICE_GPU, device_id, owner=obj)


def _cai_dtype(obj, typestr: str) -> np.dtype:
    """The element type of a __cuda_array_interface__ object. bfloat16 has no typestr of its own (CuPy
    and torch both write '<V2'), so a 2-byte void is bfloat16 when the array's own dtype says so."""
    dtype = np.dtype(typestr)
    if dtype.kind == "V" and dtype.itemsize == 2:
        own = getattr(obj, "dtype", None)
        if (isinstance(own, np.dtype) and own == BFLOAT16_DTYPE) or str(own) == "torch.bfloat16":
            return BFLOAT16_DTYPE
    return dtype


def _contiguous_strides(shape, itemsize: int) -> tuple:
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))
