"""MatMul, Gemm and Einsum through the plugin's own cuBLAS binding (capturable, unlike CuPy's cuBLAS)."""

from __future__ import annotations

import numpy as np

from ..device import cublas
from .base import FLOAT, CudaKernel, is_half, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None


@register("MatMul", 1)
class MatMul(CudaKernel):
    input_types = (FLOAT, FLOAT)
    needs_cublas = True

    def _compute(self, ctx):
        a, b = ctx.inputs
        out = ctx.output(0, cublas.matmul_shape(a.shape, b.shape), a.dtype)
        cublas.matmul(ctx.cublas, a, b, out)


@register("Gemm", 1)
class Gemm(CudaKernel):
    input_types = (FLOAT, FLOAT, FLOAT)
    needs_cublas = True

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


@register("Einsum", 12)
class Einsum(CudaKernel):
    """Einsum in the forms exporters emit: two operands whose product is a batched matrix product
    after transposes ('bhqd,bhkd->bhqk', 'bij,bjk->bik', 'i,j->ij'), through the plugin's cuBLAS;
    one operand (a transpose, a trace-free sum) through CuPy. Refused (not claimed): ellipses,
    repeated letters within an operand, three or more operands, letters summed within one operand
    of a pair."""

    input_types = (FLOAT,)
    variadic = True
    needs_cublas = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        equation = self.attr_str("equation")
        if equation is None:
            raise self.bad_attr("equation", None, "a string (the attribute is required)")
        self.equation = equation.replace(" ", "")
        lhs, arrow, out = self.equation.partition("->")
        terms = lhs.split(",")
        if "." in self.equation or not 1 <= len(terms) <= 2 or not all(t.isalpha() for t in terms):
            raise self.bad_attr("equation", equation, "one or two operands of letters, no ellipsis")
        if not arrow:  # implicit output: the letters that appear once, in alphabetical order
            letters = "".join(terms)
            out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        if any(len(set(t)) != len(t) for t in terms + [out]) or not set(out) <= set("".join(terms)):
            raise self.bad_attr("equation", equation, "no repeated letter within an operand or the output")
        if len(terms) == 2:
            a, b = terms
            if any(c not in b and c not in out for c in a) or any(c not in a and c not in out for c in b):
                raise self.bad_attr("equation", equation, "every letter of an operand also in the other or the output")
        self.terms, self.out = terms, out

    @classmethod
    def claims(cls, attrs, dtypes, opset):
        if not super().claims(attrs, dtypes, opset):
            return False
        equation = attrs.get("equation", b"")
        equation = equation.decode() if isinstance(equation, bytes) else str(equation)
        return len(equation.partition("->")[0].split(",")) == len(dtypes)

    def _plan(self, shape_a, shape_b):
        a, b, o = self.terms[0], self.terms[1], self.out
        size = {}
        for term, shape in ((a, shape_a), (b, shape_b)):
            if len(term) != len(shape):
                raise ValueError(f"Einsum node '{self.node_name}': operand '{term}' has shape {list(shape)}")
            for c, d in zip(term, shape):
                if size.setdefault(c, d) != d:
                    raise ValueError(f"Einsum node '{self.node_name}': letter '{c}' is {size[c]} and {d}")
        batch = [c for c in o if c in a and c in b]
        left = [c for c in o if c in a and c not in b]
        right = [c for c in o if c in b and c not in a]
        contract = [c for c in a if c in b and c not in o]
        perm_a = tuple(a.index(c) for c in batch + left + contract)
        perm_b = tuple(b.index(c) for c in batch + contract + right)

        def prod(letters):
            return int(np.prod([size[c] for c in letters], dtype=np.int64))

        shape3_a = (prod(batch), prod(left), prod(contract))
        shape3_b = (prod(batch), prod(contract), prod(right))
        natural = batch + left + right
        result_shape = tuple(size[c] for c in natural)
        perm_out = tuple(natural.index(c) for c in o)
        return perm_a, perm_b, shape3_a, shape3_b, result_shape, perm_out, tuple(size[c] for c in o)

    def _compute(self, ctx):
        inputs = ctx.inputs
        if len(inputs) == 1:
            x = inputs[0]
            # A one-operand Einsum may sum: half inputs are summed in float32, then rounded.
            y = cupy.einsum(self.equation, x.astype(np.float32) if is_half(x.dtype) else x)
            cupy.copyto(ctx.output(0, y.shape, x.dtype), y)
            return
        a, b = inputs
        perm_a, perm_b, s3a, s3b, result_shape, perm_out, out_shape = self.plan((a.shape, b.shape), self._plan)
        out = ctx.output(0, out_shape, a.dtype)
        if not out.size:
            return
        a3 = cupy.ascontiguousarray(a.transpose(perm_a)).reshape(s3a)
        b3 = cupy.ascontiguousarray(b.transpose(perm_b)).reshape(s3b)
        if perm_out == tuple(range(len(perm_out))):
            cublas.matmul(ctx.cublas, a3, b3, out.reshape(s3a[0], s3a[1], s3b[2]))
            return
        c3 = cupy.empty((s3a[0], s3a[1], s3b[2]), a.dtype)
        cublas.matmul(ctx.cublas, a3, b3, c3)
        cupy.copyto(out, c3.reshape(result_shape).transpose(perm_out))
