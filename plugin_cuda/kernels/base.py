"""Kernel base class, op registry and attribute parsing for the CUDA plugin's ONNX kernels.

A kernel is built once per node at session creation (attributes parsed there, never per call) and
its compute(ctx) runs thousands of times per second, so compute does as little Python as it can.

The context a kernel gets (provided by the plugin runtime):
  ctx.inputs            list of cupy.ndarray, None for an absent optional input; the inputs listed
                        in the kernel class's `host_inputs` (shapes, axes, slice bounds) should be
                        NumPy arrays: a device array there costs a synchronising copy (not capturable)
  ctx.output(i, shape, dtype) -> a preallocated C-contiguous cupy.ndarray to write output i into
  ctx.cublas            a plugin_cuda.device.cublas.CublasHandle bound to the current stream
  ctx.cudnn             a plugin_cuda.device.cudnn.CudnnHandle bound to it (kernels with
                        needs_cudnn), None where cuDNN cannot be loaded
  ctx.scratch(nbytes)   temporary device memory (kernels here let CuPy's stream-aware pool do it)
  ctx.num_outputs       optional: how many outputs the node has (1 when missing)
The runtime makes the stream current (`with stream:`) before calling compute.

Attributes are read through plugin_cuda.semantics.Attributes and shapes follow
plugin_cuda.semantics.shapes: the compiled plan's lowering uses the same rules.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from abi.dtypes import BFLOAT16_DTYPE
from plugin_cuda.semantics import Attributes, shapes

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy (or a broken CUDA install) means zero devices, not a crash
    cupy = None

__all__ = [
    "ALL",
    "EPHOST_DOMAIN",
    "FLOAT",
    "HALF",
    "INDEX",
    "KERNELS",
    "MS_DOMAIN",
    "CudaKernel",
    "UnsupportedOpError",
    "claimable",
    "is_half",
    "lookup",
    "numpy_dtype",
    "register",
    "supported_ops",
]

# float16 and bfloat16 are stored in 2 bytes and computed in float32 (CuPy 14 takes ml_dtypes'
# bfloat16 as an array dtype, `__nv_bfloat16` in its kernels; the raw kernels convert the bits).
HALF = frozenset({"float16", "bfloat16"})
FLOAT = frozenset({"float32"}) | HALF
INDEX = frozenset({"int32", "int64"})
BOOL = frozenset({"bool"})
ALL = FLOAT | INDEX | BOOL
NUMERIC = FLOAT | INDEX
LATEST_OPSET = 23
EPHOST_DOMAIN = "ai.ephost"
MS_DOMAIN = "com.microsoft"  # the quantized ops onnxruntime's quantizer emits (kernels/quant_ms.py)
_PLAN_LIMIT = 256

# ONNX TensorProto.DataType -> NumPy dtype name.
ONNX_DTYPES = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16",
}
_HALF_DTYPES = frozenset({np.dtype(np.float16), BFLOAT16_DTYPE})


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name of this module ('bfloat16' is ml_dtypes' type)."""
    return BFLOAT16_DTYPE if name == "bfloat16" else np.dtype(name)


def is_half(dtype) -> bool:
    """True for float16 and bfloat16 (computed in float32, stored in 2 bytes)."""
    return dtype in _HALF_DTYPES


class UnsupportedOpError(LookupError):
    """No kernel is registered for this op type at this opset."""


def dtype_name(dtype: Any) -> str | None:
    """Normalise a dtype given as an ONNX element type, a NumPy dtype or a name; None stays None."""
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        return ONNX_DTYPES.get(int(dtype), f"onnx-type-{int(dtype)}")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def host_ints(x) -> tuple[int, ...]:
    """The values of a small integer tensor (a shape, axes, slice bounds) as Python ints."""
    if isinstance(x, np.ndarray):
        return tuple(x.reshape(-1).tolist())
    if isinstance(x, (list, tuple)):
        return tuple(int(v) for v in x)
    # A device array: a synchronising device-to-host copy, illegal during capture. The runtime
    # should hand these inputs over as NumPy arrays (see CudaKernel.host_inputs).
    return tuple(cupy.asnumpy(x).reshape(-1).tolist())


def num_outputs(ctx) -> int:
    return getattr(ctx, "num_outputs", 1)


class CudaKernel:
    """One ONNX node's kernel. Subclasses parse attributes in __init__ and write _compute(ctx)."""

    op_type: ClassVar[str] = ""
    since: ClassVar[int] = 1
    # Allowed dtype names per input position; None allows any. For variadic ops the last entry
    # applies to every further input.
    input_types: ClassVar[tuple[frozenset[str] | None, ...]] = (FLOAT,)
    variadic: ClassVar[bool] = False
    # Input positions that must share one dtype ("all" for every input).
    same_type: ClassVar[tuple[int, ...] | str] = "all"
    # Input positions read on the host (shapes, axes): the runtime should pass NumPy arrays there.
    host_inputs: ClassVar[tuple[int, ...]] = ()
    # The most outputs a node may ask for (None: any); a node asking for more is not claimed.
    max_outputs: ClassVar[int | None] = None
    # Whether compute uses ctx.cublas (the runtime then binds the stream's handle).
    needs_cublas: ClassVar[bool] = False
    # Whether compute uses ctx.cudnn (the stream's cuDNN handle, None where cuDNN is not loadable).
    needs_cudnn: ClassVar[bool] = False

    def __init__(self, attrs: dict, opset: int, node_name: str):
        self.attrs = dict(attrs)
        self.opset = int(opset)
        self.node_name = node_name
        self.attributes = Attributes(self.attrs, self.op_type, node_name)
        self.where = self.attributes.where
        self._plans: dict = {}

    def plan(self, key: tuple, make):
        """make(*key), memoised per kernel: per-shape work is done once, not on every call."""
        plan = self._plans.get(key)
        if plan is None:
            plan = make(*key)
            if len(self._plans) >= _PLAN_LIMIT:  # dynamic shapes must not grow this without bound
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def compute(self, ctx) -> None:
        """Run the node on ctx's stream; errors carry the node's name."""
        try:
            self._compute(ctx)
        except Exception as e:
            e.add_note(f"in {self.op_type} node '{self.node_name}' (CUDA plugin)")
            raise

    def _compute(self, ctx) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _compute")

    # -- claiming -----------------------------------------------------------------------------

    @classmethod
    def claims(cls, attrs: dict, dtypes: list[str | None], opset: int) -> bool:
        """Whether this kernel runs a node with these attributes and input dtypes."""
        types = cls.input_types
        if len(dtypes) > len(types) and not cls.variadic:
            return False
        for i, dtype in enumerate(dtypes):
            if dtype is None:
                continue
            allowed = types[min(i, len(types) - 1)]
            if allowed is not None and dtype not in allowed:
                return False
        positions = range(len(dtypes)) if cls.same_type == "all" else cls.same_type
        shared = {dtypes[i] for i in positions if i < len(dtypes) and dtypes[i] is not None}
        if len(shared) > 1:
            return False
        try:
            cls(attrs, opset, "<claimable>")
        except (ValueError, TypeError):
            return False
        return True

    # -- attribute parsing (at construction only) --------------------------------------------------

    def bad_attr(self, name: str, value: Any, allowed: str) -> ValueError:
        return self.attributes.bad(name, value, allowed)

    def attr_int(self, name: str, default: int | None = None, allowed=None) -> int | None:
        return self.attributes.integer(name, default, allowed)

    def attr_float(self, name: str, default: float | None = None) -> float | None:
        return self.attributes.number(name, default)

    def attr_str(self, name: str, default: str | None = None, allowed=None) -> str | None:
        return self.attributes.string(name, default, allowed)

    def attr_ints(self, name: str, default=None, length: int | None = None,
                  minimum: int | None = None) -> tuple[int, ...] | None:
        return self.attributes.integers(name, default, length, minimum)

    def axis(self, axis: int, rank: int, name: str = "axis", allow_end: bool = False) -> int:
        """Normalise a possibly negative axis against `rank` (`allow_end`: `rank` itself is allowed,
        as in Flatten); OpError (a ValueError) when out of range."""
        return shapes.normalize_axis(axis, rank, self.where, name, allow_end)


# ---------------------------------------------------------------------------------------------
# Registry

KERNELS: dict[str, dict[int, type[CudaKernel]]] = {}


def table_key(op_type: str, domain: str = "") -> str:
    """The KERNELS key of an op: its type for the ONNX domain, 'domain.Type' for another domain."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}.{op_type}"


def register(op_type: str, since: int = 1, domain: str = ""):
    """Class decorator: register a kernel for `op_type` (of `domain`) from opset `since` on."""

    def decorate(cls: type[CudaKernel]) -> type[CudaKernel]:
        versions = KERNELS.setdefault(table_key(op_type, domain), {})
        if since in versions:
            raise RuntimeError(
                f"kernel for {op_type} since opset {since} registered twice: "
                f"{versions[since].__name__} and {cls.__name__}"
            )
        cls.op_type = op_type
        cls.since = since
        versions[since] = cls
        return cls

    return decorate


def lookup(op_type: str, opset: int, domain: str = "") -> type[CudaKernel]:
    """The kernel class for `op_type` at `opset` (the newest registered at or below it)."""
    op_type = table_key(op_type, domain)
    versions = KERNELS.get(op_type)
    if versions:
        usable = [v for v in versions if v <= opset]
        if usable:
            return versions[max(usable)]
        raise UnsupportedOpError(
            f"CUDA plugin has {op_type} kernels from opset {min(versions)}; the model uses opset {opset}"
        )
    raise UnsupportedOpError(f"CUDA plugin has no kernel for op type {op_type!r}")


def supported_ops() -> list[str]:
    """Op types with at least one registered kernel."""
    return sorted(KERNELS)


def claimable(op_type: str, attrs: dict, input_dtypes, opset: int | None = None, *, domain: str = "",
              num_outputs: int | None = None) -> bool:
    """Whether the CUDA EP should claim a node: a kernel exists and supports these dtypes and attributes.

    input_dtypes: one entry per input (None for an absent optional input), as ONNX element types,
    NumPy dtypes or dtype names. num_outputs: how many outputs the node asks for (None: not checked).
    """
    if opset is None:
        opset = 1 if domain == EPHOST_DOMAIN else LATEST_OPSET
    if domain in ("", "ai.onnx") and opset > LATEST_OPSET:
        return False  # a newer opset may have changed the op's meaning
    try:
        cls = lookup(op_type, opset, domain)
    except UnsupportedOpError:
        return False
    if num_outputs is not None and cls.max_outputs is not None and num_outputs > cls.max_outputs:
        return False
    dtypes = [dtype_name(d) for d in input_dtypes]
    return cls.claims(attrs, dtypes, opset)


def coverage_rows() -> list[str]:
    """Markdown table rows (op, domain, opsets, dtypes of input 0, module) of every registered kernel:
    the op table of docs/cuda_ops.md, which a test keeps equal to the registry."""
    rows = []
    for key in sorted(KERNELS):
        versions = KERNELS[key]
        cls = versions[max(versions)]
        domain = next((d for d in (EPHOST_DOMAIN, MS_DOMAIN) if key.startswith(d + ".")), "ai.onnx")
        op = key if domain == "ai.onnx" else key[len(domain) + 1:]
        opsets = f"{min(versions)}..{LATEST_OPSET}" if domain == "ai.onnx" else "1"
        types = cls.input_types[0] if cls.input_types else None
        dtypes = "any" if types is None else ", ".join(sorted(types))
        rows.append(f"| {op} | {domain} | {opsets} | {dtypes} | "
                    f"{cls.__module__.rsplit('.', 1)[-1]} |")
    return rows
