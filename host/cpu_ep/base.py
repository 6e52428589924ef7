"""Base class of the CPU kernels and the attribute helpers they share.

A kernel is built once per node at session creation; `__init__` reads and checks the
attributes so that `_run` only computes. Kernels never write into their inputs; an output
may be a view of an input (Reshape, Identity...), so callers must not write into outputs
they did not allocate either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from host.errors import EphostError, KernelError, ModelError
from host.runtime.node import NodeInfo

EP_NAME = "CPUExecutionProvider"

_MISSING = object()

# What a kernel may return besides arrays: non-tensor ONNX values as Python objects (ZipMap's
# sequence of maps is a list of dicts, as onnxruntime returns it).
NON_TENSOR = (np.ndarray, list, dict)


class OpKernel:
    """One node's kernel. Subclasses parse attributes in `__init__` and implement `_run`."""

    # Output positions whose declared type is not a tensor (set by the session's planner).
    object_outputs: frozenset[int] = frozenset()
    # True for kernels that take their inputs where they live (control flow: a device value goes
    # into the subgraph as it is); others get host arrays.
    takes_device_values = False
    # False for kernels that never call BLAS (NumPy element-wise and indexing code only): a session
    # whose plan runs nothing else skips bounding the BLAS pools per run (host/runtime/threads.py).
    uses_blas = True

    def __init__(self, node: NodeInfo):
        self.node = node
        self.name = node.name
        self.op_type = node.op_type
        self.opset = node.opset
        self.n_outputs = len(node.outputs)

    # -- running -------------------------------------------------------------------------

    def run(self, *inputs: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """Computes the node's outputs; failures come out as KernelError naming the node."""
        try:
            # inf/nan results are what ONNX asks for (log(0), x/0...): no warnings for them.
            with np.errstate(all="ignore"):
                outputs = self._run(*inputs)
        except EphostError:
            raise
        except Exception as exc:
            raise self.failure(exc) from exc
        # numpy reductions return numpy scalars; callers always get arrays. Outputs declared as
        # sequences, optionals or maps hold lists, None or dicts: those pass through as they are.
        objects = self.object_outputs
        return tuple(o if isinstance(o, np.ndarray) or j in objects or isinstance(o, NON_TENSOR) else np.asarray(o)
                     for j, o in enumerate(outputs))

    def bind_constants(self, constants: dict[int, np.ndarray]) -> None:
        """Told once per plan by the CPU run loop (runner.py) which inputs are initializers:
        input position -> the array every run will pass there (never written to). A kernel may
        derive things from them once (a Conv's weights as a matrix...), but must use what it derived
        only when the argument `is` the bound array: kernels also run outside that loop, and a feed
        may override an initializer. The default keeps nothing."""

    def failure(self, exc: Exception) -> KernelError:
        """The KernelError for an exception raised by `_run`, naming the node."""
        return KernelError(f"node '{self.name}' ({self.op_type}) on {EP_NAME} failed: {exc}", node=self.name, ep=EP_NAME)

    def _run(self, *inputs: np.ndarray | None) -> tuple[np.ndarray, ...]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _run")

    # -- attributes ----------------------------------------------------------------------

    def bad_attr(self, attr: str, value, allowed: str) -> ModelError:
        """The error for an attribute value this kernel cannot accept."""
        got = "nothing (missing)" if value is _MISSING else repr(value)
        return ModelError(
            f"node '{self.name}' ({self.op_type}): attribute '{attr}' is {got}; allowed: {allowed}"
        )

    def attr(self, attr: str, default=_MISSING, allowed: str = "a value"):
        """The raw attribute value; a missing attribute without default is a ModelError."""
        value = self.node.attrs.get(attr, default)
        if value is _MISSING:
            raise self.bad_attr(attr, _MISSING, f"{allowed} (the attribute is required)")
        return value

    def attr_int(self, attr: str, default=_MISSING, lo: int | None = None, hi: int | None = None) -> int:
        value = self.attr(attr, default, "an int")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.bad_attr(attr, value, "an int")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            lo_s = "-inf" if lo is None else lo
            hi_s = "inf" if hi is None else hi
            raise self.bad_attr(attr, value, f"an int in [{lo_s}, {hi_s}]")
        return int(value)

    def attr_float(self, attr: str, default=_MISSING) -> float:
        value = self.attr(attr, default, "a float")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise self.bad_attr(attr, value, "a float")
        return float(value)

    def attr_ints(self, attr: str, default=_MISSING, length: int | None = None,
                  lo: int | None = None) -> list[int] | None:
        value = self.attr(attr, default, "a list of ints")
        if value is None:
            return None
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
        if not ok:
            raise self.bad_attr(attr, value, "a list of ints")
        if length is not None and len(value) != length:
            raise self.bad_attr(attr, value, f"a list of {length} ints")
        if lo is not None and any(v < lo for v in value):
            raise self.bad_attr(attr, value, f"ints >= {lo}")
        return [int(v) for v in value]

    def attr_str(self, attr: str, default=_MISSING, choices: Sequence[str] | None = None) -> str:
        allowed = "a string" if choices is None else "one of " + ", ".join(repr(c) for c in choices)
        value = self.attr(attr, default, allowed)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            raise self.bad_attr(attr, value, allowed)
        return value

    def attr_bool(self, attr: str, default: int = 0) -> bool:
        """ONNX flags are ints restricted to 0 and 1."""
        return bool(self.attr_int(attr, default, lo=0, hi=1))


# -- helpers shared by op modules --------------------------------------------------------


def normalize_axis(axis: int, rank: int) -> int:
    """Maps a possibly negative axis into [0, rank); out of range raises ValueError."""
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def normalize_axes(axes, rank: int) -> tuple[int, ...]:
    """Normalizes a list of axes and rejects duplicates."""
    out = tuple(normalize_axis(int(a), rank) for a in axes)
    if len(set(out)) != len(out):
        raise ValueError(f"axes {list(axes)} repeat an axis (rank {rank})")
    return out


def int_list(arr: np.ndarray | None) -> list[int]:
    """A 0-D or 1-D integer tensor (shape, axes, pads...) as a python list."""
    if arr is None:
        return []
    arr = np.asarray(arr)
    values = arr.reshape(-1).tolist()  # python ints straight from an integer tensor
    return values if arr.dtype.kind in "iu" else [int(v) for v in values]


def scalar(arr: np.ndarray):
    """The single value of a scalar or one-element tensor, as a numpy scalar."""
    arr = np.asarray(arr)
    if arr.size != 1:
        raise ValueError(f"expected a scalar, got a tensor of shape {arr.shape}")
    return arr.reshape(-1)[0]


_COLUMNS: dict[tuple[int, float, np.dtype], np.ndarray] = {}


def constant_column(n: int, value: float, dtype) -> np.ndarray:
    """A read-only (n, 1) column filled with `value`, made once per (n, value, dtype) and shared: a
    matrix product with it sums (value 1) or averages (value 1/n) the rows of a 2-D array in one BLAS
    call, about half the cost of NumPy's reductions along a short last axis."""
    key = (n, value, np.dtype(dtype))
    col = _COLUMNS.get(key)
    if col is None:
        col = np.full((n, 1), value, dtype=dtype)
        col.flags.writeable = False
        col = _COLUMNS.setdefault(key, col)
    return col


_TILE_LIMIT = 1 << 16  # elements: larger tiles cost more memory traffic than the broadcast saves


def row_tile(cache: dict, vector: np.ndarray, rows: int) -> np.ndarray:
    """`vector` (1-D, a bound initializer) repeated as a read-only (rows, n) array, kept in `cache`
    per row count: adding or multiplying a same-shape array is a plain loop, while broadcasting a
    vector over rows costs NumPy about a microsecond more per call on small tensors. Returns the
    vector itself when the tile would be large."""
    tile = cache.get(rows)
    if tile is None:
        if rows * vector.size > _TILE_LIMIT or len(cache) >= 8:
            return vector
        tile = np.tile(vector, (rows, 1))
        tile.flags.writeable = False
        tile = cache.setdefault(rows, tile)
    return tile


def bound_tile(cache: dict, value: np.ndarray, bound, rows: int, dtype) -> np.ndarray:
    """row_tile() of `value` when it is the bound initializer `bound`, a vector of `dtype`; else
    `value` as it is (it then broadcasts as usual)."""
    if value is bound and value.ndim == 1 and value.dtype == dtype:
        return row_tile(cache, value, rows)
    return value


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to compute heavy float math in: half types go through float32."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize >= 4:
        return dtype
    if dtype == np.float16 or dtype.kind == "V" or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype
