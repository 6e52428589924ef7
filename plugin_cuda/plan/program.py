"""The program a partition lowers to: values with static shapes, plan ops, and how generated
CUDA C writes a float32 constant. Pure Python and NumPy (no CuPy).

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

from plugin_cuda.plan.symint import dim

__all__ = ["Op", "Program", "Value", "f32_literal", "strides"]


@dataclass
class Value:
    """A tensor of the program: static shape, and its data when it is a constant."""

    id: int
    name: str
    shape: tuple
    const: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


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

    def new_value(self, name: str, shape: tuple, const=None) -> int:
        vid = max(self.values, default=-1) + 1
        vid = max(vid, 1 << 20)  # synthetic ids never collide with the graph's value indices
        while vid in self.values:
            vid += 1
        self.values[vid] = Value(vid, name, tuple(dim(d) for d in shape), const)
        return vid

    def const_value(self, name: str, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array, dtype=np.float32)
        return self.new_value(name, array.shape, array)




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
