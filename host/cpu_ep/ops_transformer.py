"""Transformer building blocks: RMSNormalization, RotaryEmbedding (ai.onnx opset 23; Attention is in ops_attention)
and the fused ops of ephost's optimizer domain (ai.ephost: SkipLayerNormalization, FusedMatMul,
BiasGelu; semantics in docs/optimizer.md)."""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep import native, packed_gemm
from host.cpu_ep.base import OpKernel, bound_tile, compute_dtype, constant_column, normalize_axis, row_tile
from host.cpu_ep.ops_attention import _FAST_SOFTMAX, Attention  # noqa: F401  (Attention: moved there)
from host.cpu_ep.ops_elementwise import gelu
from host.cpu_ep.ops_math import bound_gemm, chain_gemm_runner, matmul, native_matmul, prepared_gemm
from host.cpu_ep.ops_standardize import fast_rows, read_norm_attrs, standardize, standardize_rows
from host.cpu_ep.registry import register

EPHOST_DOMAIN = "ai.ephost"
F32 = native.F32


@register("RMSNormalization", since=23)
class RMSNormalization(OpKernel):
    """x / sqrt(mean(x^2 over axes [axis, rank)) + epsilon) * scale, computed in the stash type."""

    def __init__(self, node):
        super().__init__(node)
        read_norm_attrs(self)
        self._bound_scale = None
        self._tiles: dict[int, np.ndarray] = {}
        self._runs: dict[tuple, tuple | bool] = {}

    def bind_constants(self, constants):
        self._bound_scale, self._tiles, self._runs = constants.get(1), {}, {}

    def _runner(self, lib, x, scale):
        """For a bound scale: a function of a float32 contiguous x of x's shape doing the compiled call, or
        False where it does not serve."""
        if (self.stash_type != 1 or not x.ndim or normalize_axis(self.axis, x.ndim) != x.ndim - 1 or not x.size
                or not _vector(scale, x.shape[-1])):
            return False
        shape, n, eps = x.shape, x.shape[-1], self.epsilon
        rows, sp, ptr, empty, norm = x.size // n, native.ptr(scale), native.ptr, np.empty, lib.ep_rmsnorm

        def run(x):
            y = empty(shape, dtype=F32)
            norm(ptr(x), sp, ptr(y), rows, n, eps)
            return (y,)

        return run

    def _run(self, x, scale):
        lib = native.LIB
        if lib is not None and scale is self._bound_scale and x.dtype == F32 and x.flags.c_contiguous:
            run = native.cached(self._runs, x.shape, lib, lambda: self._runner(lib, x, scale))
            if run:
                return run(x)
        axis = normalize_axis(self.axis, x.ndim)
        st = np.float64 if self.stash_type == 11 or x.dtype == np.float64 else np.float32
        if (lib is not None and st is np.float32 and x.dtype == F32 and fast_rows(x, axis) and scale.dtype == F32
                and scale.shape == x.shape[-1:] and scale.flags.c_contiguous):
            # One pass per row in C (the sum of squares accumulates in double).
            y = np.empty(x.shape, dtype=F32)
            lib.ep_rmsnorm(native.ptr(x), native.ptr(scale), native.ptr(y), x.size // x.shape[-1], x.shape[-1],
                           self.epsilon)
            return (y,)
        if x.dtype == st and fast_rows(x, axis):
            # The mean of squares as one GEMV against a 1/n column; y = x / sqrt(ms + eps) * scale.
            x2 = x.reshape(-1, x.shape[-1])
            ms = np.dot(np.square(x2), constant_column(x2.shape[1], 1 / x2.shape[1], st))
            ms += st(self.epsilon)
            np.sqrt(ms, out=ms)
            y = np.divide(x2, ms)
            y *= bound_tile(self._tiles, scale, self._bound_scale, y.shape[0], st)
            return (y.reshape(x.shape),)
        axes = tuple(range(axis, x.ndim))
        xc = x.astype(st, copy=False)
        ms = np.add.reduce(xc * xc, axis=axes, keepdims=True)
        ms *= st(1 / math.prod(x.shape[a] for a in axes))
        ms += st(self.epsilon)
        inv = np.sqrt(ms, out=ms)
        np.reciprocal(inv, out=inv)
        y = xc * inv
        y *= scale
        return (y.astype(x.dtype, copy=False),)


@register("RotaryEmbedding", since=23)
class RotaryEmbedding(OpKernel):
    """Rotates the first rotary_embedding_dim features of each head by the cached cos/sin of its
    position (position_ids index the caches; without them the caches are already per token).
    X is (batch, heads, seq, size), or (batch, seq, heads*size) with num_heads."""

    def __init__(self, node):
        super().__init__(node)
        self.interleaved = self.attr_bool("interleaved", 0)
        self.rotary_dim = self.attr_int("rotary_embedding_dim", 0, lo=0)
        self.num_heads = self.attr_int("num_heads", 0, lo=0)
        self._bound_cos = self._bound_sin = None
        self._full: tuple | None = None  # (cos, sin, C, S) for the bound caches
        self._runs: dict[tuple, tuple | bool] = {}

    def bind_constants(self, constants):
        self._bound_cos, self._bound_sin, self._full = constants.get(1), constants.get(2), None
        self._runs = {}

    def _native_runner(self, lib, x, cos, sin, split: bool):
        """A function of (x, cos, sin) for float32 x (B, H, S, D) with x's shape and strides (a Transpose's
        view too) and float32 contiguous caches of cos's shape, rotating x in one compiled call (None for a
        view it cannot read), or False where the whole-head path does not apply. `split`: x is the head
        split of a contiguous 3-D input, and the output is written in that 3-D layout."""
        if not (x.ndim == 4 and not self.interleaved and x.strides[3] == 4 and cos.dtype == F32 and sin.dtype == F32
                and cos.ndim == 3 and cos.shape == sin.shape and cos.shape[1] == x.shape[2]
                and 2 * cos.shape[2] == x.shape[3] and self.rotary_dim in (0, x.shape[3])
                and cos.flags.c_contiguous and sin.flags.c_contiguous and cos.shape[0] in (1, x.shape[0])):
            return False
        b, h, s, d = x.shape
        new = native.ffi.new
        strides = new("int64_t[3]", [st // 4 for st in x.strides[:3]])
        # The output: (B, S, H, D) memory for a split 3-D input (its 3-D reshape is then a view), else
        # contiguous (B, H, S, D).
        shape, out_strides = ((b, s, h, d), (s * h * d, d, h * d)) if split else (x.shape, (h * s * d, s * d, d))
        y_strides = new("int64_t[3]", out_strides)
        batch = 0 if cos.shape[0] == 1 else s * (d // 2)
        first, ptr, empty, rotate = native.first_element, native.ptr, np.empty, lib.ep_rotary_halves

        def run(x, cos, sin):
            xp = first(x)
            if xp is None:
                return None
            y = empty(shape, dtype=F32)
            rotate(xp, strides, ptr(cos), ptr(sin), ptr(y), y_strides, b, h, s, d, batch)
            return y.transpose(0, 2, 1, 3) if split else y

        return run

    def _run(self, x, cos_cache, sin_cache, position_ids=None):
        if x.ndim == 3:
            # The 3-D form is the 4-D one on the head split (batch, heads, seq, size) of x.
            if self.num_heads < 1 or x.shape[2] % self.num_heads:
                raise ValueError(f"3-D input of shape {x.shape} needs num_heads dividing its last dimension; "
                                 f"got {self.num_heads}")
            b, s, hidden = x.shape
            heads = x.reshape(b, s, self.num_heads, hidden // self.num_heads).transpose(0, 2, 1, 3)
            y = self._rotate(heads, cos_cache, sin_cache, position_ids, split=x.flags.c_contiguous)
            return (y.transpose(0, 2, 1, 3).reshape(x.shape),)
        if x.ndim != 4:
            raise ValueError(f"input must be 3-D or 4-D, got shape {x.shape}")
        return (self._rotate(x, cos_cache, sin_cache, position_ids, split=False),)

    def _rotate(self, x, cos_cache, sin_cache, position_ids, split: bool):
        """x (batch, heads, seq, size) rotated."""
        lib = native.LIB
        if (lib is not None and position_ids is None and x.dtype == F32 and cos_cache.dtype == F32
                and sin_cache.dtype == F32 and cos_cache.flags.c_contiguous and sin_cache.flags.c_contiguous
                and cos_cache.shape == sin_cache.shape):
            # Per (x's shape and strides, the caches' shape): the checks once, then one compiled call.
            run = native.cached(self._runs, (x.shape, x.strides, cos_cache.shape, split), lib,
                                lambda: self._native_runner(lib, x, cos_cache, sin_cache, split))
            y = run and run(x, cos_cache, sin_cache)
            if y is not None and y is not False:
                return y
        if (position_ids is None and not self.interleaved and x.dtype in _FAST_SOFTMAX
                and cos_cache.dtype == x.dtype and sin_cache.dtype == x.dtype and cos_cache.ndim == 3
                and cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == x.shape[2]
                and 2 * cos_cache.shape[2] == x.shape[3] and self.rotary_dim in (0, x.shape[3])):
            return self._rotate_whole(x, cos_cache, sin_cache)
        xs = x.transpose(0, 2, 1, 3)  # (batch, seq, heads, size)
        size = xs.shape[3]
        rd = self.rotary_dim or size
        if rd > size or rd % 2:
            raise ValueError(f"rotary_embedding_dim {rd} must be even and at most the head size {size}")
        if position_ids is not None:
            pos = position_ids.astype(np.int64, copy=False)
            cos_cache, sin_cache = cos_cache[pos], sin_cache[pos]
        half = rd // 2
        if cos_cache.shape[-1] != half or sin_cache.shape[-1] != half:
            raise ValueError(f"cos/sin caches end in {cos_cache.shape[-1]}/{sin_cache.shape[-1]}; "
                             f"expected rotary_embedding_dim/2 = {half}")
        cos = cos_cache[:, :, None, :]
        sin = sin_cache[:, :, None, :]
        rot = xs[..., :rd]
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if self.interleaved else (rot[..., :half], rot[..., half:])
        real = cos * x1 - sin * x2
        imag = sin * x1 + cos * x2
        out = np.empty(xs.shape, dtype=np.result_type(x.dtype, real.dtype))
        if self.interleaved:
            out[..., 0:rd:2], out[..., 1:rd:2] = real, imag
        else:
            out[..., :half], out[..., half:rd] = real, imag
        out[..., rd:] = xs[..., rd:]
        return out.astype(x.dtype, copy=False).transpose(0, 2, 1, 3)

    def _rotate_whole(self, x, cos, sin):
        """(batch, heads, seq, size) input rotated over all of each head, halves layout: with
        C = [cos, cos] and S = [-sin, sin] per token, y = x * C + [x2, x1] * S, which is the same
        products and sums as the two halves computed apart (negation is exact). C and S are kept for
        initializer caches."""
        full = self._full
        if full is None or full[0] is not cos or full[1] is not sin:
            C = np.concatenate((cos, cos), axis=-1)[:, None]
            S = np.concatenate((-sin, sin), axis=-1)[:, None]
            full = (cos, sin, C, S)
            if cos is self._bound_cos and sin is self._bound_sin:
                self._full = full
        half = x.shape[3] // 2
        y = x * full[2]
        swapped = np.concatenate((x[..., half:], x[..., :half]), axis=-1)
        swapped *= full[3]
        y += swapped
        return y


# -- ai.ephost fused ops ---------------------------------------------------------------------


@register("SkipLayerNormalization", domain=EPHOST_DOMAIN, since=1)
class SkipLayerNormalization(OpKernel):
    """Y = LayerNorm(X + Skip) * Scale + Bias over axes [axis, rank); optional 2nd output X + Skip."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self._bound: dict[int, np.ndarray] = {}
        self._tiles: tuple[dict, dict] = ({}, {})
        self._runs: dict[tuple, tuple | bool] = {}

    def bind_constants(self, constants):
        self._bound, self._tiles, self._runs = constants, ({}, {}), {}

    def _runner(self, lib, x, scale, bias):
        """For bound scale and bias: a function of (x, skip) of x's shape (float32, contiguous, checked by the
        caller) doing the compiled call, or False where it does not serve."""
        n = x.shape[-1] if x.ndim else 0
        if (not x.ndim or self.axis not in (-1, x.ndim - 1) or not x.size or not _vector(scale, n)
                or (bias is not None and not _vector(bias, n))):
            return False
        shape, rows, eps, two = x.shape, x.size // n, self.epsilon, self.n_outputs > 1
        ptr, null, empty, norm = native.ptr, native.NULL, np.empty, lib.ep_layernorm
        sp, bp = ptr(scale), null if bias is None else ptr(bias)

        def run(x, skip):
            y = empty(shape, dtype=F32)
            if not two:
                norm(ptr(x), ptr(skip), sp, bp, ptr(y), null, null, null, rows, n, eps)
                return (y,)
            total = empty(shape, dtype=F32)
            norm(ptr(x), ptr(skip), sp, bp, ptr(y), ptr(total), null, null, rows, n, eps)
            return y, total

        return run

    def _run(self, x, skip, scale, bias=None):
        run = self._runs.get(x.shape)  # the call made for this shape, when this call is one it serves
        if (run and run[0] is native.LIB and scale is self._bound.get(2) and bias is self._bound.get(3)
                and skip.shape == x.shape and x.dtype == F32 and skip.dtype == F32 and x.flags.c_contiguous
                and skip.flags.c_contiguous):
            return run[1](x, skip)
        lib = native.LIB
        if (lib is not None and x.dtype == F32 and skip.dtype == F32 and x.flags.c_contiguous
                and skip.flags.c_contiguous and x.shape == skip.shape and scale is self._bound.get(2)
                and bias is self._bound.get(3)):
            run = native.cached(self._runs, x.shape, lib, lambda: self._runner(lib, x, scale, bias))
            if run:
                return run(x, skip)
        if (lib is not None and x.dtype == F32 and skip.dtype == F32 and x.shape == skip.shape and x.ndim
                and self.axis in (-1, x.ndim - 1) and x.size and x.flags.c_contiguous and skip.flags.c_contiguous
                and _vector(scale, x.shape[-1]) and (bias is None or _vector(bias, x.shape[-1]))):
            # One call: the sum, its statistics (in double), the normalized rows, scale and bias.
            n = x.shape[-1]
            y = np.empty(x.shape, dtype=F32)
            total = np.empty(x.shape, dtype=F32) if self.n_outputs > 1 else None
            ptr, null = native.ptr, native.NULL
            lib.ep_layernorm(ptr(x), ptr(skip), ptr(scale), null if bias is None else ptr(bias), ptr(y),
                             null if total is None else ptr(total), null, null, x.size // n, n, self.epsilon)
            return (y, total)[:self.n_outputs]
        s = x + skip
        axis = normalize_axis(self.axis, s.ndim)
        st = np.float64 if s.dtype == np.float64 else np.float32
        if s.dtype == st and fast_rows(s, axis):
            y2 = standardize_rows(s.reshape(-1, s.shape[-1]), self.epsilon)[0]
            rows = y2.shape[0]
            y2 *= bound_tile(self._tiles[0], scale, self._bound.get(2), rows, st)
            if bias is not None:
                y2 += bound_tile(self._tiles[1], bias, self._bound.get(3), rows, st)
            return (y2.reshape(s.shape), s)[:self.n_outputs]
        else:
            y = standardize(s.astype(st, copy=False), tuple(range(axis, s.ndim)), self.epsilon)[0]
        y *= scale
        if bias is not None:
            y += bias
        outs = (y.astype(x.dtype, copy=False), s)
        return outs[:self.n_outputs]


def _vector(v: np.ndarray, n: int) -> bool:
    """v is a contiguous float32 vector of n elements (a scale or bias the compiled kernels take)."""
    return v.dtype == F32 and v.shape == (n,) and v.flags.c_contiguous


_ACTIVATIONS = ("", "Relu", "Gelu", "GeluTanh")
_NATIVE_STEPS = {"": (), "Relu": (native.RELU,), "Gelu": (native.GELU,), "GeluTanh": (native.GELU_TANH,)}


@register("FusedMatMul", domain=EPHOST_DOMAIN, since=1)
class FusedMatMul(OpKernel):
    """act(A @ B + Bias), numpy.matmul semantics, activation in '', Relu, Gelu, GeluTanh."""

    def __init__(self, node):
        super().__init__(node)
        self.activation = self.attr_str("activation", "", choices=_ACTIVATIONS)
        self.native_steps = _NATIVE_STEPS[self.activation]  # the activation as compiled epilogue steps
        self._prog = native.program(self.native_steps)
        self._bound_b = self._bound_bias = None
        self._tiles: dict[int, np.ndarray] = {}
        self._runs: dict[tuple, tuple | bool] = {}

    def bind_constants(self, constants):
        self._bound_b, self._bound_bias, self._tiles, self._runs = constants.get(1), constants.get(2), {}, {}
        packed_gemm.declare_weight(self._bound_b)

    def fused_native(self, args, prog, res, alpha, beta):
        """The output with an epilogue program (fusion.py's chains; it starts with this node's activation)
        computed by the compiled GEMM; None where it does not serve."""
        a, b, *rest = args
        return native_matmul(a, b, rest[0] if rest else None, prog, res, alpha, beta)

    def native_runner(self, lib, args, prog, alpha, beta):
        """For a chain over bound weights and bias: a function of (a, res) for float32 contiguous a, or False."""
        a, b, *rest = args
        bias = rest[0] if rest else None
        if b is not self._bound_b or bias is not self._bound_bias:
            return False
        return chain_gemm_runner(lib, a, b, bias, prog, alpha, beta)

    def _run(self, a, b, bias=None):
        run = prepared_gemm(self._runs, a, b, bias, self._bound_b, self._bound_bias)
        if run is not None:
            return (run(a),)
        lib = native.LIB
        if lib is not None:
            if b is self._bound_b and bias is self._bound_bias and a.dtype == F32 and a.flags.c_contiguous:
                run = bound_gemm(self._runs, lib, a, b, bias, self._prog)
                if run:
                    return (run(a),)
            y = native_matmul(a, b, bias, self._prog)
            if y is not None:
                return (y,)
        if (b.ndim == 2 and a.ndim >= 2 and a.dtype == b.dtype and a.dtype in _FAST_SOFTMAX
                and a.flags.c_contiguous and (bias is None or (bias.ndim <= 1 and bias.dtype == a.dtype))):
            # The common case (an activation times a weight matrix, a bias vector): one 2-D GEMM, the
            # bias added as a same-shape tile when it is an initializer.
            y = np.dot(a.reshape(-1, a.shape[-1]), b)
            if bias is not None:
                y += row_tile(self._tiles, bias, y.shape[0]) if bias is self._bound_bias and bias.ndim else bias
            return (self._activate(y).reshape(*a.shape[:-1], b.shape[1]),)
        ct = compute_dtype(a.dtype)
        y = matmul(a.astype(ct, copy=False), b.astype(ct, copy=False))
        if bias is not None:
            y += bias.astype(ct, copy=False)
        return (self._activate(y).astype(a.dtype, copy=False),)

    def _activate(self, y):
        """The activation, in place where it can be (y is this kernel's own array)."""
        if self.activation == "Relu":
            np.maximum(y, 0, out=y)
        elif self.activation:
            y = gelu(y, self.activation == "GeluTanh")
        return y


@register("BiasGelu", domain=EPHOST_DOMAIN, since=1)
class BiasGelu(OpKernel):
    """Gelu(X + Bias), approximate in none, tanh."""

    def __init__(self, node):
        super().__init__(node)
        self.tanh = self.attr_str("approximate", "none", choices=("none", "tanh")) == "tanh"

    def _run(self, x, bias):
        lib = native.LIB
        if lib is not None and x.dtype == F32 and x.ndim and x.size and x.flags.c_contiguous and _vector(bias, x.shape[-1]):
            y = np.empty(x.shape, dtype=F32)
            lib.ep_bias_act(native.ptr(x), native.ptr(bias), native.ptr(y), x.size // x.shape[-1], x.shape[-1],
                            native.GELU_TANH if self.tanh else native.GELU, native.NULL, 0.0, 0.0)
            return (y,)
        return (gelu(x + bias, self.tanh).astype(x.dtype, copy=False),)
