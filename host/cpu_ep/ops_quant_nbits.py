"""com.microsoft MatMulNBits: blocked 2/4/8-bit weight-only quantization, as onnxruntime's
`matmul_nbits_quantizer` (MatMul4BitsQuantizer) writes it, and as the optimizer fuses a blocked
DequantizeLinear -> MatMul into (host/optimizer/rules/qdq_nbits.py).

Y = A @ dequantize(B)^T (+ bias). B is (N, k_blocks, block_size * bits / 8) bytes: each column n of the
weight, cut into blocks of `block_size` rows along K, packed low bits first; `scales` is (N, k_blocks);
`zero_points` is packed the same way (uint8, one row of ceil(k_blocks * bits / 8) bytes per column) or
one float per block (the scales' type), and defaults to 2**(bits - 1). `g_idx` (deprecated in
onnxruntime) names each row's block instead of row // block_size.

The weight is dequantized to a float32 (K, N) matrix once, when the plan binds it (it is an
initializer) and the matrix fits DENSE_LIMIT_BYTES, and every run is one BLAS sgemm: NumPy has no 4-bit or int8 GEMM, and a
dequantize per run costs more than the product itself at the sizes a session runs repeatedly (the
matrix takes 8x the memory of the 4-bit weight: the limit keeps that bounded). Larger or non-constant
weights are dequantized at each run, in slices of columns. `accuracy_level` is accepted and does not
change the arithmetic: ephost always computes in float32 (onnxruntime's level 4 quantizes A to int8
first, so its results there differ from the float product by A's quantization error).
"""

from __future__ import annotations

import numpy as np

from abi.nbits import NBitsLayout
from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register

MS = "com.microsoft"
F32 = np.dtype(np.float32)
DENSE_LIMIT_BYTES = 256 << 20  # a dequantized weight kept per node up to this size
SLICE_BYTES = 32 << 20  # the per-run dequantization works in column slices of about this size


@register("MatMulNBits", domain=MS)
class MatMulNBits(OpKernel):
    """Y = A @ dequantize(B)^T + bias, in float32 (see the module docstring)."""

    def __init__(self, node):
        super().__init__(node)
        bits = self.attr_int("bits", 4)
        if bits not in (2, 4, 8):
            raise self.bad_attr("bits", bits, "2, 4 or 8")
        block_size = self.attr_int("block_size", lo=16)
        if block_size & (block_size - 1):
            raise self.bad_attr("block_size", block_size, "a power of 2 >= 16")
        self.attr_int("accuracy_level", 0, lo=0, hi=4)  # checked, then unused: the product is float32
        self.layout = NBitsLayout(self.attr_int("K", lo=1), self.attr_int("N", lo=1), bits, block_size)
        self._bound: dict[int, np.ndarray] = {}
        self._dense: np.ndarray | None = None

    def bind_constants(self, constants):
        """Dequantizes the weight here, at plan time, when all its inputs are initializers."""
        self._bound = {pos: constants[pos] for pos in (1, 2, 3, 4) if pos in constants}
        self._dense = None
        inputs = self.node.inputs
        named = [pos for pos in (1, 2, 3, 4) if len(inputs) > pos and inputs[pos]]
        if all(pos in self._bound for pos in named) and self.layout.k * self.layout.n * 4 <= DENSE_LIMIT_BYTES:
            try:
                self._dense = self.layout.dequantize(*(self._bound.get(pos) for pos in (1, 2, 3, 4)))
            except ValueError:
                pass  # wrong sizes: the run reports them, naming the node

    def _cached(self, b, scales, zero_points, g_idx) -> np.ndarray | None:
        """The weight dequantized once, when every weight input is the bound initializer."""
        bound = self._bound
        args = {1: b, 2: scales, 3: zero_points, 4: g_idx}
        if any(bound.get(pos) is not arr for pos, arr in args.items() if arr is not None or pos in bound):
            return None
        if self._dense is None and self.layout.k * self.layout.n * 4 <= DENSE_LIMIT_BYTES:
            self._dense = self.layout.dequantize(b, scales, zero_points, g_idx)
        return self._dense

    def _run(self, a, b, scales, zero_points=None, g_idx=None, bias=None):
        layout = self.layout
        if a.shape[-1:] != (layout.k,):
            raise ValueError(f"input A has shape {list(a.shape)}; its last dimension must be K={layout.k}")
        a32 = a.astype(F32, copy=False)
        w = self._cached(b, scales, zero_points, g_idx)
        if w is not None:
            y = np.matmul(a32, w)
        else:
            y = self._sliced(a32, b, scales, zero_points, g_idx)
        if bias is not None:
            y += bias.astype(F32, copy=False)
        return (y.astype(a.dtype, copy=False),)

    def _sliced(self, a32, b, scales, zero_points, g_idx) -> np.ndarray:
        """A @ W, dequantizing W a slice of columns at a time (the whole of W may not fit)."""
        layout = self.layout
        y = np.empty((*a32.shape[:-1], layout.n), F32)
        step = max(1, SLICE_BYTES // (4 * layout.k))
        for start in range(0, layout.n, step):
            cols = slice(start, min(start + step, layout.n))
            y[..., cols] = np.matmul(a32, layout.dequantize(b, scales, zero_points, g_idx, cols))
        return y
