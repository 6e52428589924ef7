"""MatMul and Gemm through the plugin's own cuBLAS binding (capturable, unlike CuPy's cuBLAS)."""

from __future__ import annotations

from .. import cublas
from .base import FLOAT, CudaKernel, register


@register("MatMul", 1)
class MatMul(CudaKernel):
    input_types = (FLOAT, FLOAT)

    def _compute(self, ctx):
        a, b = ctx.inputs
        out = ctx.output(0, cublas.matmul_shape(a.shape, b.shape), a.dtype)
        cublas.matmul(ctx.cublas, a, b, out)


@register("Gemm", 1)
class Gemm(CudaKernel):
    input_types = (FLOAT, FLOAT, FLOAT)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.alpha = self.attr_float("alpha", 1.0)
        self.beta = self.attr_float("beta", 1.0)
        self.trans_a = bool(self.attr_int("transA", 0, (0, 1)))
        self.trans_b = bool(self.attr_int("transB", 0, (0, 1)))

    def _compute(self, ctx):
        inputs = ctx.inputs
        a, b = inputs[0], inputs[1]
        c = inputs[2] if len(inputs) > 2 else None
        out = ctx.output(0, cublas.gemm_shape(a.shape, b.shape, self.trans_a, self.trans_b), a.dtype)
        cublas.gemm(ctx.cublas, a, b, c, self.alpha, self.beta, self.trans_a, self.trans_b, out)
