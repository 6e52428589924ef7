"""Matrix products and softmax-like ops."""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep import native, packed_gemm
from host.cpu_ep.base import OpKernel, compute_dtype, normalize_axis
from host.cpu_ep.registry import register


@register("MatMul")
class MatMul(OpKernel):
    """numpy.matmul semantics (1-D operands promoted then squeezed, batch broadcast)."""

    native_steps = ()

    def __init__(self, node):
        super().__init__(node)
        self._bound_b = None
        self._runs: dict[tuple, tuple | bool] = {}

    def bind_constants(self, constants):
        self._bound_b, self._runs = constants.get(1), {}
        packed_gemm.declare_weight(self._bound_b)

    def fused_native(self, args, prog, res, alpha, beta):
        """The output followed by an epilogue program (fusion.py's chains) from the compiled GEMM, or None."""
        return native_matmul(*args, None, prog, res, alpha, beta)

    def native_runner(self, lib, args, prog, alpha, beta):
        """For a chain over a bound weight: a function of (a, res) for float32 contiguous a, or False."""
        a, b = args
        return b is self._bound_b and chain_gemm_runner(lib, a, b, None, prog, alpha, beta)

    def _run(self, a, b):
        run = prepared_gemm(self._runs, a, b, None, self._bound_b, None)
        if run is not None:
            return (run(a),)
        if (b.ndim > 2 and a.dtype == b.dtype and a.dtype in _WIDE
                and a.size * b.shape[-1] < min(BATCHED_MIN_MACS, COPY_MIN_MACS)):
            # Attention's small stacked products (q k^T, p v over views): NumPy's loop, reading the views
            # as they are, is what the paths below would end in, after their checks.
            return (np.matmul(a, b),)
        lib = native.LIB
        if lib is not None:
            if b is self._bound_b and a.dtype == F32 and a.flags.c_contiguous:
                run = bound_gemm(self._runs, lib, a, b, None, 0)
                if run:
                    return (run(a),)
            y = native_matmul(a, b) if b.ndim == 2 else native_batched(lib, a, b)
            if y is not None:
                return (y,)
        if b.ndim == 2 and a.ndim >= 2 and a.dtype == b.dtype and a.dtype in _WIDE and a.flags.c_contiguous:
            # The common case (activations times a weight matrix): one np.dot, nothing else.
            if a.ndim == 2:
                return (np.dot(a, b),)
            return (np.dot(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1]),)
        ct = compute_dtype(a.dtype)
        # float16 products go through float32: numpy has no fast half GEMM and sums badly.
        y = matmul(a.astype(ct, copy=False), b.astype(ct, copy=False))
        return (y.astype(a.dtype, copy=False),)


_WIDE = (np.dtype(np.float32), np.dtype(np.float64))
F32 = native.F32


def bound_gemm(runs: dict, lib, a, b, bias, prog: int):
    """For a float32 C-contiguous `a` times an initializer `b` (+ an initializer `bias`): a function of
    such an `a` of this shape doing prog(a @ b + bias) in one compiled call, kept in `runs` per shape
    (native_matmul's checks done once); False where native_matmul would not serve."""
    return native.cached(runs, a.shape, lib, lambda: _gemm_runner(lib, a, b, bias, prog))


def _fits(a, b, bias) -> bool:
    """The compiled GEMMs take a float32 C-contiguous a (..., K) times a 2-D float32 b (K, N), bias (N,)."""
    return (b.ndim == 2 and a.ndim >= 2 and a.dtype == F32 and b.dtype == F32 and a.flags.c_contiguous
            and b.flags.c_contiguous and a.shape[-1] == b.shape[0] and bool(a.size) and bool(b.size)
            and (bias is None or (bias.dtype == F32 and bias.shape == (b.shape[1],) and bias.flags.c_contiguous)))


def _product(lib, a, b, bias, prog, alpha=0.0, beta=0.0):
    """A function of (a, y, res) doing y = prog(a @ b + bias) by the compiled GEMM for a's shape: the
    small-tile ep_gemm within native.gemm_fits, the packed GEMM beyond it for a declared weight b
    (packed_gemm.py); False where neither serves."""
    if not _fits(a, b, bias):
        return False
    k, n = b.shape
    rows = a.size // k
    if not native.gemm_fits(rows, k, n):
        return packed_gemm.serves(b) and packed_gemm.runner(lib, b, bias, prog, rows, alpha, beta)
    ptr, null, gemm = native.ptr, native.NULL, lib.ep_gemm
    bp, biasp, kind = ptr(b), null if bias is None else ptr(bias), 0 if bias is None else 1

    def run(a, y, res=None):
        gemm(ptr(a), null, bp, biasp, kind, ptr(y), rows, k, n, prog, null if res is None else ptr(res), alpha, beta)

    return run


def _gemm_runner(lib, a, b, bias, prog):
    out_shape, empty = (*a.shape[:-1], b.shape[1]), np.empty
    k, n = b.shape
    if _fits(a, b, bias) and native.gemm_fits(a.size // k, k, n):
        # The small products of small models: the compiled call itself, nothing between (issue 23: at
        # 16x64x64 the Python around the call cost more than the product).
        ptr, null, gemm, rows = native.ptr, native.NULL, lib.ep_gemm, a.size // k
        bp, biasp, kind = ptr(b), null if bias is None else ptr(bias), 0 if bias is None else 1

        def small(a):
            y = empty(out_shape, dtype=F32)
            gemm(ptr(a), null, bp, biasp, kind, ptr(y), rows, k, n, prog, null, 0.0, 0.0)
            return y

        return small
    product = _product(lib, a, b, bias, prog)
    if not product:
        return False

    def run(a):
        y = empty(out_shape, dtype=F32)
        product(a, y)
        return y

    return run


def prepared_gemm(runs: dict, a, b, bias, bound_b, bound_bias):
    """The function bound_gemm made for a's shape, when this call is one it serves (the bound operands, a
    float32 C-contiguous `a`, the library it was made with), else None: the kernels' first check, before
    any other work."""
    entry = runs.get(a.shape)
    if (entry and b is bound_b and bias is bound_bias and entry[0] is native.LIB and a.dtype == F32
            and a.flags.c_contiguous):
        return entry[1]
    return None


def chain_gemm_runner(lib, a, b, bias, prog, alpha, beta):
    """_gemm_runner's function for a chain (fusion.py): of (a, res), res being the residual operand or None;
    it returns None for a residual it cannot take (another shape, dtype or layout)."""
    product = _product(lib, a, b, bias, prog, alpha, beta)
    if not product:
        return False
    out_shape, empty = (*a.shape[:-1], b.shape[1]), np.empty

    def run(a, res):
        if res is not None and (res.shape != out_shape or res.dtype != F32 or not res.flags.c_contiguous):
            return None
        y = empty(out_shape, dtype=F32)
        product(a, y, res)
        return y

    return run


def native_matmul(a, b, bias=None, prog: int = 0, res=None, alpha: float = 0.0, beta: float = 0.0):
    """prog(a @ b + bias) for a float32 a (..., K) and b (K, N), bias (N,) or None, by the compiled GEMM
    (a plain loop beats OpenBLAS's call overhead at these sizes: 2.3 against 2.7 us for 16x64x64; beyond
    native.gemm_fits, the packed GEMM for a declared weight); `res` is the epilogue's residual operand,
    shaped as the output. None when the library is off or the operands are not what it takes (other
    dtypes, layouts, broadcasting, empty, too large for an activation b)."""
    lib = native.LIB
    if lib is None:
        return None
    out_shape = (*a.shape[:-1], b.shape[-1])
    if res is not None and (res.shape != out_shape or res.dtype != F32 or not res.flags.c_contiguous):
        return None
    product = _product(lib, a, b, bias, prog, alpha, beta)
    if not product:
        return None
    y = np.empty(out_shape, dtype=F32)
    product(a, y, res)
    return y


# Below this many multiply-adds in all, NumPy's matmul loop (with its copy of a transposed operand) is
# cheaper than the strided-view bookkeeping here: at GPT-2's (1, 2, 16, 32) @ (1, 2, 32, 16) 2.5 us against
# 8 us; at (8, 2, 128, 32) @ (8, 2, 32, 128), 8.4 M, 114 us against 135 us.
BATCHED_MIN_MACS = 1 << 21


def native_batched(lib, a, b):
    """a @ b over stacked float32 matrices of the same batch shape (attention's q k^T and p v) by the
    compiled GEMM, one small product each (native.gemm_fits), both operands read in place with their
    strides (the views a Split, Reshape and Transpose leave: q, k^T, v); None where it does not serve
    (broadcasting, more than two batch axes above 1, a's rows not contiguous, strides not whole elements)."""
    if (a.ndim < 3 or b.ndim != a.ndim or a.dtype != F32 or b.dtype != F32 or a.shape[:-2] != b.shape[:-2]
            or a.shape[-1] != b.shape[-2] or not a.size or not b.size):
        return None
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if a.size // k * k * n < BATCHED_MIN_MACS:
        return None
    sa, sb = _elements(a), _elements(b)
    if sa is None or sb is None or (sa[-1] != 1 and k > 1) or not native.gemm_fits(m, k, n):
        return None
    lead = [i for i, d in enumerate(a.shape[:-2]) if d != 1]
    if len(lead) > 2:
        return None
    lead = [None] * (2 - len(lead)) + lead
    outer, inner = (1 if i is None else a.shape[i] for i in lead)
    sa1, sa2 = (0 if i is None else sa[i] for i in lead)
    sb1, sb2 = (0 if i is None else sb[i] for i in lead)
    y = np.empty((*a.shape[:-1], n), dtype=F32)
    if lib.ep_matmul_batched(_address(a), _address(b), native.ptr(y), outer * inner, inner, m, k, n, sa1, sa2,
                             sa[-2], sb1, sb2, sb[-2], sb[-1]):
        return None
    return y


def _elements(x):
    """x's strides in elements, or None when one is negative or not whole elements."""
    size = x.itemsize
    if any(st % size or st < 0 for st in x.strides):
        return None
    return [st // size for st in x.strides]


def _address(x):
    """A pointer to x's first element, for a view too (ffi.from_buffer takes contiguous buffers only)."""
    return native.ptr(x) if x.flags.c_contiguous else native.ffi.cast("void *", x.__array_interface__["data"][0])


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy.matmul; an N-D activation times a 2-D weight runs as one 2-D GEMM over the flattened
    leading axes (one BLAS call instead of numpy's batched loop). 2-D products go through np.dot,
    which costs less to call than the matmul ufunc (same result for 2-D operands)."""
    if b.ndim == 2:
        if a.ndim == 2:
            return np.dot(a, b)
        if a.ndim > 2 and a.flags.c_contiguous:
            return np.dot(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1])
    # numpy's matmul calls BLAS only for matrices whose rows are unit-stride; a transposed view
    # (attention's K^T, a Transpose over the last two axes) takes its own loop instead: 1.06 ms
    # against 0.56 ms with the copy for an [8, 2, 128, 32] x [8, 2, 32, 128] product, one thread. Below
    # COPY_MIN_MACS the loop wins (no copy to make): 1.4 against 2.1 us at [1, 2, 16, 32] x [1, 2, 32, 16],
    # 20.7 against 23.6 us at 1 M multiply-adds.
    if a.size * b.shape[-1] >= COPY_MIN_MACS:
        if a.ndim >= 2 and a.strides[-1] != a.itemsize:
            a = np.ascontiguousarray(a)
        if b.ndim >= 2 and b.strides[-1] != b.itemsize:
            b = np.ascontiguousarray(b)
    return np.matmul(a, b)


COPY_MIN_MACS = 1 << 21


@register("Gemm", since=7)
class Gemm(OpKernel):
    """alpha * A' @ B' + beta * C, C optional and unidirectionally broadcast."""

    def __init__(self, node):
        super().__init__(node)
        self.alpha = self.attr_float("alpha", 1.0)
        self.beta = self.attr_float("beta", 1.0)
        self.trans_a = self.attr_bool("transA", 0)
        self.trans_b = self.attr_bool("transB", 0)
        self._bound_b = self._bound_bt = self._bound_c = None
        self._runs: dict[tuple, tuple | bool] = {}  # per A shape, for the bound B and C (bound_gemm)

    def bind_constants(self, constants):
        self._bound_b, self._bound_bt, self._bound_c, self._runs = constants.get(1), None, constants.get(2), {}
        if not self.trans_b:
            packed_gemm.declare_weight(self._bound_b)

    native_steps = ()

    def fused_native(self, args, prog, res, alpha, beta):
        """The output followed by an epilogue program (fusion.py's chains) from the compiled GEMM, or None."""
        return self._native(*args, prog=prog, res=res, alpha=alpha, beta=beta)

    def native_runner(self, lib, args, prog, alpha, beta):
        """For a chain (fusion.py) over a bound B and C: a function of (a, res) (the transposed B made once),
        or False where the compiled GEMM does not take this Gemm."""
        a, b, c = (*args, None)[:3]
        if b is not self._bound_b or (c is not None and c is not self._bound_c) or a.ndim != 2:
            return False
        b = self._plain_b(b, c)
        return b is not None and chain_gemm_runner(lib, a, b, c, prog, alpha, beta)

    def _plain_b(self, b, c):
        """B as the compiled GEMM takes it (K x N; a bound transposed B transposed once), or None where alpha,
        beta, transA, C or B's form rule the compiled GEMM out."""
        if self.trans_a or self.alpha != 1.0 or (c is not None and (self.beta != 1.0 or c.ndim != 1)) or b.ndim != 2:
            return None
        if not self.trans_b:
            return b
        if b is not self._bound_b:
            return None
        if self._bound_bt is None:
            self._bound_bt = np.ascontiguousarray(b.T)
            packed_gemm.declare_weight(self._bound_bt)
        return self._bound_bt

    def _native(self, a, b, c=None, prog=0, res=None, alpha=0.0, beta=0.0):
        """A @ B (+ C as a bias vector) by the compiled GEMM when alpha and beta are 1, A is not transposed
        and a transposed B is a bound initializer (transposed once); else None."""
        b = self._plain_b(b, c)
        if b is None or a.ndim != 2:
            return None
        if (not prog and res is None and b is (self._bound_bt if self.trans_b else self._bound_b) and c is self._bound_c
                and a.dtype == F32 and a.flags.c_contiguous):
            run = bound_gemm(self._runs, native.LIB, a, b, c, 0)  # kept per shape: _run checks it first
            if run:
                return run(a)
        return native_matmul(a, b, c, prog, res, alpha, beta)

    def _run(self, a, b, c=None):
        run = prepared_gemm(self._runs, a, b, c, self._bound_b, self._bound_c)
        if run is not None:
            return (run(a),)
        if native.LIB is not None:
            y = self._native(a, b, c)
            if y is not None:
                return (y,)
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(f"A and B must be 2-D, got shapes {a.shape} and {b.shape}")
        dtype = a.dtype
        ct = compute_dtype(dtype)
        a = a.astype(ct, copy=False)
        a = a.T if self.trans_a else a
        b = b.astype(ct, copy=False)
        b = b.T if self.trans_b else b
        y = a @ b  # a new array: updated in place below
        in_place = ct.kind == "f"  # integer Gemm with a float alpha/beta promotes: no in-place there
        if self.alpha != 1.0:
            if in_place:
                y *= ct.type(self.alpha)
            else:
                y = y * self.alpha
        if c is not None and self.beta != 0.0:
            c = c.astype(ct, copy=False)
            c = c if self.beta == 1.0 else c * self.beta
            fits = c.ndim <= 2 and all(cd in (1, yd) for cd, yd in zip(c.shape[::-1], y.shape[::-1]))
            if in_place and fits and c.dtype == y.dtype:
                y += c
            else:
                y = y + c
        # Integer Gemm with a float alpha/beta computes in float64; cast back.
        return (y.astype(dtype, copy=False),)


class _SoftmaxBase(OpKernel):
    """Before opset 13 the input is coerced to 2-D at `axis` (default 1); since, axis is -1."""

    log_form = 0  # ep_softmax's flag: 1 for LogSoftmax

    def __init__(self, node):
        super().__init__(node)
        self.legacy = self.opset < 13
        self.axis = self.attr_int("axis", 1 if self.legacy else -1)
        self._runs: dict[tuple, tuple] = {}  # input shape -> (library, its compiled call), for float32 C-contiguous x

    def _run(self, x):
        run = self._runs.get(x.shape)
        if run is not None and run[0] is native.LIB and x.dtype == F32 and x.flags.c_contiguous:
            return run[1](x)
        if x.size == 0:
            return (x.copy(),)
        axis = normalize_axis(self.axis, x.ndim)
        lib = native.LIB
        n = math.prod(x.shape[axis:])
        if (lib is not None and x.dtype == F32 and x.flags.c_contiguous and n < 2**31
                and (axis == x.ndim - 1 or self.legacy)):
            # One pass per row in C (max, exp, sum, divide): NumPy's path makes four passes and three
            # temporaries over the whole tensor (attention scores: 1.1 ms against 0.2 ms at [8, 2, 128, 128]).
            if len(self._runs) >= 16:
                self._runs.clear()
            run = self._runs[x.shape] = (lib, _softmax_runner(lib, x.shape, n, self.log_form))
            return run[1](x)
        ct = compute_dtype(x.dtype)
        xc = x.astype(ct, copy=False)
        if self.legacy:
            xc = xc.reshape(math.prod(x.shape[:axis]), -1)
            axis = 1
        shifted = xc - xc.max(axis=axis, keepdims=True)
        return (self._finish(shifted, axis).reshape(x.shape).astype(x.dtype, copy=False),)


def _softmax_runner(lib, shape: tuple, n: int, log_form: int):
    """A function of a float32 C-contiguous x of `shape` doing ep_softmax over rows of n."""
    rows, ptr, empty, softmax = math.prod(shape) // n, native.ptr, np.empty, lib.ep_softmax

    def run(x):
        y = empty(shape, dtype=F32)
        softmax(ptr(x), ptr(y), rows, n, log_form)
        return (y,)

    return run


@register("Softmax")
class Softmax(_SoftmaxBase):
    @staticmethod
    def _finish(shifted, axis):
        e = np.exp(shifted)
        return e / e.sum(axis=axis, keepdims=True)


@register("LogSoftmax")
class LogSoftmax(_SoftmaxBase):
    log_form = 1

    @staticmethod
    def _finish(shifted, axis):
        return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


@register("Einsum", since=12)
class Einsum(OpKernel):
    """numpy.einsum with the node's equation (explicit '->' or implicit output, '...' broadcast)."""

    def __init__(self, node):
        super().__init__(node)
        self.equation = self.attr_str("equation").replace(" ", "")
        n_terms = len(self.equation.split("->")[0].split(","))
        if n_terms != len(node.inputs):
            raise self.bad_attr("equation", self.equation, f"an equation with one term per input ({len(node.inputs)})")

    def _run(self, *xs):
        ct = compute_dtype(xs[0].dtype)
        y = np.einsum(self.equation, *(x.astype(ct, copy=False) for x in xs), optimize=len(xs) > 2)
        return (np.asarray(y).astype(xs[0].dtype, copy=False),)
