"""The program a partition lowers to: values with static shapes and element types, plan ops, and
how generated CUDA C writes a float32 constant. Pure Python and NumPy (no CuPy).

Element types: float32, float16 or bfloat16 per value (PLAN_DTYPES). Kernels compute in float32
and read and write each buffer in its own type (plan/codegen.py); cuBLAS and cuDNN steps take
the types from the values (docs/compiled_plan.md, "Half precision").

Plan ops, each with value ids in and out:
  ew         one elementwise expression (attrs["expr"]: a C expression over {0}, {1}, ...)
  gemm       op(A) @ op(B) * alpha (attrs trans_a, trans_b, alpha); N-D MatMul batching
  softmax    over the last axis (attrs["log"] for LogSoftmax)
  norm       LayerNorm / RMSNorm over the trailing `cols` elements (attrs kind, eps)
  transpose  attrs["perm"]
  copy       a strided read: out[i] = in[offset + sum(coord_d(i) * in_strides[d])] (Split)
  place      a strided write: out[offset + sum(coord_d(i) * out_strides[d])] = in[i] (Concat)
  rotary     RotaryEmbedding over (batch, heads, seq, size) or (batch, seq, heads * size)
  conv       a direct 2-D convolution (groups, pads, strides, dilations; bias fused)
  cudnn_conv the same on cuDNN (plan/cudnn_step.py; attrs["relu"] and a 4th input, a residual, when folded)
  mean       the mean over the trailing `inner` elements (ReduceMean, GlobalAveragePool)
  alias      a view with another shape over the same bytes (Reshape, Flatten, Squeeze, ...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from abi.dtypes import BFLOAT16_DTYPE
from plugin_cuda.plan.symint import dim

__all__ = ["BF16", "C_TYPES", "F16", "F32", "PLAN_DTYPES", "Op", "Program", "Value", "f32_literal", "plan_dtype",
           "strides"]

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), BFLOAT16_DTYPE
# ONNX element type -> the NumPy dtype of a plan value (the types a compiled plan runs).
PLAN_DTYPES = {1: F32, 10: F16, 16: BF16}
# The C type of a buffer of each dtype in generated kernels (plugin_cuda/semantics/half.py).
C_TYPES = {F32: "float", F16: "half_bits", BF16: "bf16_bits"}
# A float32 value rounded to each plan type, as a C expression template over {0} (ep_round_*: codegen's
# HALF_PRELUDE).
ROUNDINGS = {F32: "{0}", F16: "ep_round_f16({0})", BF16: "ep_round_bf16({0})"}


def plan_dtype(elem_type) -> np.dtype | None:
    """The plan dtype of an ONNX element type; None when a plan does not run that type (or unknown)."""
    return PLAN_DTYPES.get(elem_type)


@dataclass
class Value:
    """A tensor of the program: static shape, and its data when it is a constant."""

    id: int
    name: str
    shape: tuple
    const: np.ndarray | None = None
    dtype: np.dtype | None = None  # F32, F16 or BF16; None until the lowering knows it

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))

    @property
    def itemsize(self) -> int:
        """Bytes per element (a value of unknown type is planned as float32)."""
        return (self.dtype or F32).itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass
class Op:
    kind: str
    node: str  # the ONNX node it came from, for error messages
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)


@dataclass
class Program:
    values: dict
    ops: list
    inputs: list  # value ids, in the partition's input order
    outputs: list
    symbols: list = field(default_factory=list)  # SymInts S0, S1, ...: kernel parameters (plan/symint.py)

    def new_value(self, name: str, shape: tuple, const=None, dtype=F32) -> int:
        vid = max(self.values, default=-1) + 1
        vid = max(vid, 1 << 20)  # synthetic ids never collide with the graph's value indices
        while vid in self.values:
            vid += 1
        self.values[vid] = Value(vid, name, tuple(dim(d) for d in shape), const, np.dtype(dtype))
        return vid

    def const_value(self, name: str, array: np.ndarray) -> int:
        """A constant the lowering derived, in its own type when a plan runs it (else float32)."""
        array = np.asarray(array)
        dtype = array.dtype if array.dtype in C_TYPES else F32
        array = np.ascontiguousarray(array, dtype=dtype)
        return self.new_value(name, array.shape, array, dtype)

    def has_half(self) -> bool:
        """Whether any value is float16 or bfloat16 (the kernels then need the half helpers)."""
        return any(v.dtype is not None and v.dtype != F32 for v in self.values.values())




def strides(shape: tuple) -> list:
    """Row-major element strides of `shape`."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def f32_literal(x: float) -> str:
    """A float32 literal for CUDA C that reads back as exactly the same float32."""
    v = np.float32(x)
    if not np.isfinite(v):
        return f"__int_as_float(0x{int(v.view(np.uint32)):08x})"
    return repr(float(v)) + "f"
