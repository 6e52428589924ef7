"""A product over bound weights followed by the SkipLayerNormalization that alone reads it, as one step.

Transformer blocks end each half with `FusedMatMul` (or `MatMul`) -> `SkipLayerNormalization(y, residual)`
(BERT, ViT: four such pairs in two layers). The run loop joins them (host/cpu_ep/fusion.py): the compiled
GEMM adds the residual as its epilogue (y = act(a W + b) + residual: the sum SkipLayerNormalization
computes, and its optional second output), then ep_layernorm normalizes that sum in place of the
SkipLayerNormalization call. Same float32 operations in the same order as the two kernels; one step, one
output fewer to allocate (issue 23: the pair cost 4.3 us at 16x64, the normalization's share mostly
Python). Input the compiled path does not take runs the two kernels in turn.
"""

from __future__ import annotations

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.ops_math import _fits

_PRODUCTS = {("", "MatMul"), ("ai.ephost", "FusedMatMul")}
F32 = native.F32


def _op(node) -> tuple[str, str]:
    domain = node.kernel.node.domain
    return ("" if domain in ("", "ai.onnx") else domain), node.op_type


def _bound(node, pos: int, constants):
    return constants.get(node.inputs[pos]) if len(node.inputs) > pos and node.inputs[pos] >= 0 else None


def match_gemm_skip_norm(nodes, i: int, consumers, keep, constants):
    """(FusedNode, 2) for a product over a bound float32 weight (and bias) at nodes[i] whose output only
    the SkipLayerNormalization at nodes[i + 1] reads (as x or as skip), its scale and bias bound; else None."""
    if i + 1 >= len(nodes):
        return None
    prod, norm = nodes[i], nodes[i + 1]
    if _op(prod) not in _PRODUCTS or _op(norm) != ("ai.ephost", "SkipLayerNormalization"):
        return None
    if "run" in prod.kernel.__dict__ or "run" in norm.kernel.__dict__ or len(prod.outputs) != 1:
        return None
    y = prod.outputs[0]
    w = _bound(prod, 1, constants)
    if y < 0 or y in keep or consumers.get(y, 0) != 1 or w is None or w.dtype != F32 or w.ndim != 2:
        return None
    if len(prod.inputs) > 2 and prod.inputs[2] >= 0 and _bound(prod, 2, constants) is None:
        return None
    if len(norm.inputs) < 3 or y not in norm.inputs[:2] or norm.inputs[0] == norm.inputs[1]:
        return None
    scale, bias = _bound(norm, 2, constants), _bound(norm, 3, constants)
    if scale is None or (len(norm.inputs) > 3 and norm.inputs[3] >= 0 and bias is None):
        return None
    if len(norm.outputs) > 2 or norm.kernel.axis != -1:
        return None
    from host.cpu_ep.fusion import FusedNode  # the run loop's step type (fusion.py imports this module)

    skip = norm.inputs[1] if norm.inputs[0] == y else norm.inputs[0]
    kernel = _GemmSkipNorm(prod, norm, skip, scale, bias)
    return FusedNode(kernel, (prod.inputs[0], skip), tuple(norm.outputs), prod.frees + norm.frees,
                     (prod.name, norm.name)), 2


class _GemmSkipNorm:
    """norm(act(a W + b) + skip), the sum kept as the normalization's second output when it has one."""

    def __init__(self, prod, norm, skip: int, scale, bias):
        self.prod, self.norm = prod, norm
        self.args = tuple(prod.inputs)  # the product's value ids (its weight and bias among them)
        self.a_id, self.skip_id = prod.inputs[0], skip
        self.y_first = norm.inputs[0] == prod.outputs[0]  # the product is SkipLayerNormalization's x
        self.scale, self.bias = scale, bias
        self.eps, self.two = norm.kernel.epsilon, len(norm.outputs) > 1
        self.prog = native.program((*prod.kernel.native_steps, native.ADD))
        self.arg_ids = ()  # reads its inputs from the values itself
        self._runs: dict[tuple, tuple] = {}
        self.name, self.op_type = norm.name, norm.op_type

    def failure(self, exc):
        return self.norm.kernel.failure(exc)

    def _run(self, values, _args):
        a, skip, lib = values[self.a_id], values[self.skip_id], native.LIB
        entry = self._runs.get(a.shape)  # the weights are initializers: a's shape and layout decide
        if entry and entry[0] is lib and entry[1] and a.dtype == F32 and a.flags.c_contiguous:
            outs = entry[1](a, skip)
            if outs is not None:
                return outs
        args = [values[v] if v >= 0 else None for v in self.args]
        if lib is not None and a.dtype == F32 and a.flags.c_contiguous and skip.dtype == F32:
            run = self._runner(lib, args)
            if run:
                outs = run(a, skip)
                if outs is not None:
                    return outs
        return self._one_by_one(args, skip)

    def _runner(self, lib, args):
        """Per a's shape: a function of (a, skip) doing both calls, or False where they do not serve."""
        a = args[0]
        entry = self._runs.get(a.shape)
        if entry is None or entry[0] is not lib:
            if len(self._runs) >= 16:
                self._runs = {}
            entry = self._runs[a.shape] = (lib, self._make(lib, args))
        return entry[1]

    def _make(self, lib, args):
        gemm = _small_gemm(lib, args, self.prog) or self.prod.kernel.native_runner(lib, args, self.prog, 0.0, 0.0)
        n = args[1].shape[1] if args[1].ndim == 2 else 0
        if (not gemm or self.scale.dtype != F32 or self.scale.shape != (n,) or not self.scale.flags.c_contiguous
                or (self.bias is not None and (self.bias.dtype != F32 or self.bias.shape != (n,)
                                               or not self.bias.flags.c_contiguous))):
            return False
        ptr, null, empty, norm = native.ptr, native.NULL, np.empty, lib.ep_layernorm
        sp, bp, eps, two = ptr(self.scale), null if self.bias is None else ptr(self.bias), self.eps, self.two

        def run(a, skip):
            total = gemm(a, skip)  # None for a skip it does not take (shape, layout)
            if total is None:
                return None
            y = empty(total.shape, dtype=F32)
            norm(ptr(total), null, sp, bp, ptr(y), null, null, null, total.size // n, n, eps)
            return (y, total) if two else (y,)

        return run

    def _one_by_one(self, args, skip):
        """The two kernels in turn."""
        from host.cpu_ep.fusion import _call

        y = _call(self.prod.kernel, *args)[0]
        return _call(self.norm.kernel, *((y, skip) if self.y_first else (skip, y)), self.scale,
                     *([] if self.bias is None else [self.bias]))


def _small_gemm(lib, args, prog: int):
    """For a product within the small GEMM (native.gemm_fits): a function of (a, res) doing a W (+ b) and
    the epilogue with `res` in one compiled call, None for a res it does not take; else None (the
    product's own closure then serves)."""
    a, w, bias = args[0], args[1], args[2] if len(args) > 2 else None
    if not _fits(a, w, bias) or not native.gemm_fits(a.size // w.shape[0], *w.shape):
        return None
    k, n = w.shape
    rows, out_shape = a.size // k, (*a.shape[:-1], n)
    ptr, null, empty, gemm = native.ptr, native.NULL, np.empty, lib.ep_gemm
    wp, bp, kind = ptr(w), null if bias is None else ptr(bias), 0 if bias is None else 1

    def run(a, res):
        if res.shape != out_shape or res.dtype != F32 or not res.flags.c_contiguous:
            return None
        y = empty(out_shape, dtype=F32)
        gemm(ptr(a), null, wp, bp, kind, ptr(y), rows, k, n, prog, ptr(res), 0.0, 0.0)
        return y

    return run
