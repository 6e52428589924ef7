"""Device memory of one CUDA EP: a CuPy pool (default), the stream-ordered pool, or the
caller's external allocator (seed 001). Every device allocation of the session goes through it:
the EP allocator's blocks, kernel temporaries (CuPy allocates them through `malloc`), cuBLAS
workspaces."""

from __future__ import annotations

import threading

import abi
from abi.sdk import PluginError


class ExternalAllocator:
    """The caller's C functions `void* alloc(size_t)`, `void free(void*)`, `void empty_cache(void)`."""

    def __init__(self, ffi, alloc: int, free: int, empty_cache: int):
        self._alloc = ffi.cast("void*(*)(size_t)", alloc)
        self._free = ffi.cast("void(*)(void*)", free)
        self._empty = ffi.cast("void(*)(void)", empty_cache) if empty_cache else None
        self._ffi = ffi

    def malloc(self, size: int, device_id: int) -> int:
        p = self._alloc(size)
        if p == self._ffi.NULL:
            raise PluginError(f"external allocator returned NULL for {size} bytes", abi.EP_OUT_OF_MEMORY)
        return int(self._ffi.cast("uintptr_t", p))

    def free(self, ptr: int, device_id: int) -> None:
        self._free(self._ffi.cast("void*", ptr))

    def empty_cache(self) -> None:
        if self._empty is not None:
            self._empty()


class DeviceMemory:
    """Allocation policy of one EP; `malloc(size)` returns a CuPy MemoryPointer."""

    def __init__(self, cupy, ffi, opts, device_id: int):
        self.cupy = cupy
        self.device_id = device_id
        self.limit = opts.arena_max_mem
        self.external = None
        self.pool = None
        if opts.external_allocator:
            self.external = ExternalAllocator(ffi, opts.gpu_external_alloc, opts.gpu_external_free,
                                              opts.gpu_external_empty_cache)
            self._malloc = cupy.cuda.memory.PythonFunctionAllocator(self.external.malloc, self.external.free).malloc
        else:
            with cupy.cuda.Device(device_id):
                self.pool = cupy.cuda.MemoryAsyncPool() if opts.arena_use_cuda_mempool else cupy.cuda.MemoryPool()
                if self.limit:
                    self.pool.set_limit(size=self.limit)
            self._malloc = self.pool.malloc
        self._lock = threading.Lock()

    @property
    def allocator(self):
        """The function to install as CuPy's allocator while this EP computes."""
        return self._malloc

    def malloc(self, size: int, allocator=None):
        try:
            return (allocator or self._malloc)(size)
        except self.cupy.cuda.memory.OutOfMemoryError as exc:
            used = self.used_bytes()
            limit = f", limit {self.limit} bytes" if self.limit else ""
            raise PluginError(f"CUDA out of memory: requested {size} bytes, {used} bytes in use{limit} ({exc})",
                              abi.EP_OUT_OF_MEMORY) from None

    def used_bytes(self) -> int:
        return int(self.pool.used_bytes()) if self.pool is not None else 0

    def total_bytes(self) -> int:
        return int(self.pool.total_bytes()) if self.pool is not None else 0

    def free_stream_blocks(self, stream) -> None:
        """Return to the device the pool's free blocks kept for `stream` (being released)."""
        if self.pool is None:
            return
        try:
            self.pool.free_all_blocks(stream=stream)
        except TypeError:  # a pool without per-stream arenas
            pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.free_all_blocks()
        if self.external is not None:
            self.external.empty_cache()
