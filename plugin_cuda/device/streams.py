"""Streams and launch geometry: what every launch of the plugin (per-node kernels and compiled
plans) shares.

`stream_scope(ptr)` makes a raw stream CuPy's current stream without owning it; `grid_1d` and
`row_threads` are the launch shapes of the grid-stride and one-block-per-row kernels; `arg_ptr`
packs a device address as a kernel argument.
"""

from __future__ import annotations

import warnings

import numpy as np

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy (or a broken CUDA install) means zero devices, not a crash
    cupy = None

__all__ = ["NoScope", "StreamRef", "arg_ptr", "grid_1d", "row_threads", "stream_scope"]


class StreamRef:
    """A raw stream pointer speaking the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


class NoScope:
    """A context manager that does nothing (the stream is already current, or none is asked for)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def stream_scope(ptr: int):
    """A context making the stream `ptr` CuPy's current stream (a no-op when it already is).

    The wrapper does not own the stream: leaving the scope or collecting it destroys nothing.
    """
    if cupy.cuda.get_current_stream().ptr == ptr:
        return NoScope()
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy >= 14
    if from_external is not None:
        try:
            return from_external(StreamRef(ptr))
        except (TypeError, ValueError):
            pass
    with warnings.catch_warnings():  # ExternalStream is deprecated from CuPy 14 on
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr)


def arg_ptr(ptr: int):
    """A device address (0 for an absent tensor) as a CuPy kernel argument."""
    return np.uint64(ptr)


def row_threads(n: int) -> int:
    """Threads per block for a row of n elements: ~4 elements a thread, a multiple of 32, <= 1024."""
    t = 32
    while t < 1024 and t * 4 < n:
        t *= 2
    return t


def grid_1d(total: int, threads: int = 256) -> int:
    """Blocks of a grid-stride kernel over `total` elements (at most 65535: the kernels loop)."""
    return max(1, min((total + threads - 1) // threads, 65535))
