"""Transformer building blocks: Attention, RMSNormalization, RotaryEmbedding (ai.onnx opset 23)
and the fused ops of ephost's optimizer domain (ai.ephost: SkipLayerNormalization, FusedMatMul,
BiasGelu; semantics in docs/optimizer.md)."""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel, bound_tile, compute_dtype, constant_column, normalize_axis, row_tile
from host.cpu_ep.ops_elementwise import gelu
from host.cpu_ep.ops_math import bound_gemm, chain_gemm_runner, matmul, native_matmul
from host.cpu_ep.ops_nn import fast_rows, standardize, standardize_rows
from host.cpu_ep.registry import register

EPHOST_DOMAIN = "ai.ephost"
F32 = native.F32


def _float_type(elem: int) -> np.dtype:
    from onnx import helper  # only when softmax_precision is set

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


@register("Attention", since=23, until=23)  # 24 adds nonpad_kv_seqlen, 25 sliding windows
class Attention(OpKernel):
    """Scaled dot-product attention with optional mask, causal masking, KV cache (past_key/value
    appended on the sequence axis), grouped-query heads (kv heads < q heads), softcap.

    3-D Q/K/V (batch, seq, heads*size) need q_num_heads and kv_num_heads; 4-D ones are
    (batch, heads, seq, size). A query row with no attendable key gives zeros (the reference's rule).
    """

    def __init__(self, node):
        super().__init__(node)
        self.is_causal = self.attr_bool("is_causal", 0)
        self.q_heads = self.attr_int("q_num_heads", 0, lo=0)
        self.kv_heads = self.attr_int("kv_num_heads", 0, lo=0)
        self.mode = self.attr_int("qk_matmul_output_mode", 0, lo=0, hi=3)
        scale = self.attr("scale", None)
        self.scale = None if scale is None else self.attr_float("scale")
        self.softcap = self.attr_float("softcap", 0.0)
        precision = self.attr("softmax_precision", None)
        self.softmax_dtype = None if precision is None else _float_type(self.attr_int("softmax_precision"))
        self._causal_cache: dict[tuple, np.ndarray] = {}
        # What _run_plain serves: one output, no softcap or softmax precision of its own.
        self._plain = self.n_outputs == 1 and self.softcap == 0 and self.softmax_dtype is None
        self._native_layouts: dict[tuple, tuple | None] = {}

    def _heads_first(self, x: np.ndarray, heads: int, what: str) -> np.ndarray:
        if x.ndim == 4:
            return x
        if x.ndim != 3:
            raise ValueError(f"{what} must be 3-D or 4-D, got shape {x.shape}")
        if heads < 1 or x.shape[2] % heads:
            raise ValueError(f"3-D {what} of shape {x.shape} needs a head count (q_num_heads / kv_num_heads) "
                             f"dividing its last dimension; got {heads}")
        b, s, hidden = x.shape
        return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)

    def _run(self, q, k, v, attn_mask=None, past_key=None, past_value=None):
        if (past_key is None and self._plain and q.dtype in _FAST_SOFTMAX and k.dtype == q.dtype
                and v.dtype == q.dtype):
            lib = native.LIB
            y = None if lib is None or q.dtype != F32 else self._run_native(lib, q, k, v, attn_mask)
            if y is None:
                y = self._run_plain(q, k, v, attn_mask)
            if y is not None:
                return (y,)
        if not q.ndim == k.ndim == v.ndim:
            raise ValueError(f"Q, K, V ranks differ: {q.shape}, {k.shape}, {v.shape}")
        if (past_key is None) != (past_value is None):
            raise ValueError("past_key and past_value must be given together")
        three_d = q.ndim == 3
        dtype = q.dtype
        ct = compute_dtype(dtype)
        q4 = self._heads_first(q, self.q_heads, "Q").astype(ct, copy=False)
        k4 = self._heads_first(k, self.kv_heads, "K").astype(ct, copy=False)
        v4 = self._heads_first(v, self.kv_heads, "V").astype(ct, copy=False)
        past_len = 0
        if past_key is not None:
            past_len = past_key.shape[2]
            k4 = np.concatenate([past_key.astype(ct, copy=False), k4], axis=2)
            v4 = np.concatenate([past_value.astype(ct, copy=False), v4], axis=2)
        b, h, s, d = q4.shape
        kvh, t = k4.shape[1], k4.shape[2]
        if h % kvh or v4.shape[1] != kvh:
            raise ValueError(f"{h} query heads cannot share {kvh} key / {v4.shape[1]} value heads")
        rep = h // kvh
        scale = self.scale if self.scale is not None else 1 / math.sqrt(d)
        # Query head g*rep + r uses kv head g: group the query heads so one batched matmul serves a group.
        if rep == 1:  # no grouping: the 4-D views multiply as they are (no copy of transposed 3-D inputs)
            scores = np.matmul(q4, np.swapaxes(k4, 2, 3))
        else:
            scores = np.matmul(q4.reshape(b, kvh, rep * s, d), np.swapaxes(k4, 2, 3)).reshape(b, h, s, t)
        scores *= ct.type(scale)
        if self.softcap > 0:
            scores = np.tanh(scores / self.softcap) * self.softcap
        bias = self._bias(attn_mask, s, t, past_len, ct)
        want_qk = self.n_outputs > 3
        qk_out = scores.copy() if want_qk and self.mode in (0, 1) else None
        if bias is not None:
            scores += bias  # scores is this kernel's own array
        if want_qk and self.mode == 2:
            qk_out = scores.copy()
        probs = self._softmax(scores, bias)
        if want_qk and self.mode == 3:
            qk_out = probs.copy()
        probs = probs.astype(ct, copy=False)
        dv = v4.shape[3]
        if rep == 1 and three_d:
            # Straight into the (batch, seq, heads, size) layout of a 3-D output: no transposed copy.
            y = np.empty((b, s, h, dv), dtype=ct)
            np.matmul(probs, v4, out=y.transpose(0, 2, 1, 3))
            y = y.reshape(b, s, h * dv)
        else:
            if rep == 1:
                y = np.matmul(probs, v4)
            else:
                y = np.matmul(probs.reshape(b, kvh, rep * s, t), v4).reshape(b, h, s, dv)
            if three_d:
                y = y.transpose(0, 2, 1, 3).reshape(b, s, h * dv)
        outs = [y.astype(dtype, copy=False), k4.astype(dtype, copy=False), v4.astype(dtype, copy=False)]
        if want_qk:
            outs.append(qk_out.astype(dtype, copy=False))
        return tuple(outs[:self.n_outputs])

    def _run_native(self, lib, q, k, v, mask):
        """_run_plain's cases for float32 in one call of the compiled kernel (scores, mask, causal part,
        softmax with each row's own maximum, weighted sum; a row with no attendable key gives zeros);
        None where it does not serve (the NumPy paths then decide)."""
        if mask is not None and not (mask.flags.c_contiguous and (mask.dtype == F32 or mask.dtype == np.bool_)):
            return None
        # Views the kernel reads through strides (a Transpose's permutations); other views (Split's column
        # blocks of a fused QKV projection) are copied: one small copy costs less than the NumPy path.
        qp, kp, vp = native.first_element(q), native.first_element(k), native.first_element(v)
        if qp is None:
            q = np.ascontiguousarray(q)
            qp = native.ptr(q)
        if kp is None:
            k = np.ascontiguousarray(k)
            kp = native.ptr(k)
        if vp is None:
            v = np.ascontiguousarray(v)
            vp = native.ptr(v)
        key = (q.shape, k.shape, v.shape, q.strides, k.strides, v.strides,
               None if mask is None else (mask.shape, mask.dtype))
        layout = self._native_layouts.get(key, False)
        if layout is False:
            layout = self._native_layout(q, k, v, mask)
            if len(self._native_layouts) < 16:
                self._native_layouts[key] = layout
        if layout is None:
            return None
        dims, strides, out_shape, mask_kind, scale = layout
        y = np.empty(out_shape, dtype=F32)
        mptr = native.NULL if mask is None else native.ptr(mask)
        if lib.ep_attention(qp, kp, vp, mptr, mask_kind, native.ptr(y), *dims,
                            *strides, scale, self.is_causal):
            return None
        return y

    def _native_layout(self, q, k, v, mask):
        """(B, H, S, T, D, DV, R), the element strides of q, k, v, y and the mask over (batch, head, seq,
        key or feature), the output shape, the mask kind (0 none, 1 additive, 2 boolean) and the scale,
        for these shapes; None where the compiled kernel does not serve them. R: query heads per key/value
        head (grouped-query attention; query head h reads kv head h // R)."""
        if q.ndim == 3 and k.ndim == 3 and v.ndim == 3:
            h, g = self.q_heads, self.kv_heads
            if h < 1 or g < 1 or h % g or q.shape[2] % h or k.shape[2] % g or v.shape[2] % g:
                return None
            b, s, t = q.shape[0], q.shape[1], k.shape[1]
            d, dv = q.shape[2] // h, v.shape[2] // g
            if k.shape[0] != b or v.shape[0] != b or v.shape[1] != t or k.shape[2] // g != d:
                return None
            if q.strides[2] != 4 or k.strides[2] != 4 or v.strides[2] != 4:
                return None
            # Element strides over (batch, head, seq): a head is a block of the feature axis.
            qs, ks, vs = ((a.strides[0] // 4, hd, a.strides[1] // 4) for a, hd in ((q, d), (k, d), (v, dv)))
            ys, out_shape = (s * h * dv, dv, h * dv), (b, s, h * dv)
        elif q.ndim == 4 and k.ndim == 4 and v.ndim == 4:
            b, h, s, d = q.shape
            g, t, dv = k.shape[1], k.shape[2], v.shape[3]
            if g < 1 or h % g or k.shape != (b, g, t, d) or v.shape[:3] != (b, g, t):
                return None
            if q.strides[3] != 4 or k.strides[3] != 4 or v.strides[3] != 4:
                return None
            # Element strides: the 4-D inputs may be a Transpose's views of (batch, seq, heads, size).
            qs, ks, vs = (tuple(st // 4 for st in a.strides[:3]) for a in (q, k, v))
            ys, out_shape = (h * s * dv, s * dv, dv), (b, h, s, dv)
        else:
            return None
        if min(b, h, s, t, d, dv) < 1:
            return None
        ms, mask_kind = (0, 0, 0, 0), 0
        if mask is not None:
            if mask.ndim > 4 or mask.shape[-1] != t:
                return None
            shape = (1,) * (4 - mask.ndim) + mask.shape
            dense = np.empty(shape, dtype=np.uint8).strides  # element strides of a contiguous mask
            if any(m not in (1, want) for m, want in zip(shape, (b, h, s, t))):
                return None
            ms = tuple(0 if m == 1 else st for m, st in zip(shape, dense))
            mask_kind = 1 if mask.dtype == F32 else 2
        scale = float(np.float32(self.scale if self.scale is not None else 1 / math.sqrt(d)))
        new = native.ffi.new
        strides = tuple(new("int64_t[4]", [*st, 0][:4]) for st in (qs, ks, vs, ys)) + (new("int64_t[4]", ms),)
        return (b, h, s, t, d, dv, h // g), strides, out_shape, mask_kind, scale

    def _run_plain(self, q, k, v, mask):
        """The common case in few NumPy calls: one output, no cache, no softcap, float32/float64, as
        many key/value heads as query heads, a mask covering every key. None when that is not the case
        (the general path then decides, errors included)."""
        if q.ndim == 3 and k.ndim == 3 and v.ndim == 3:
            h = self.q_heads
            if h < 1 or self.kv_heads != h or q.shape[2] % h or k.shape[2] % h or v.shape[2] % h:
                return None
            b, s = q.shape[:2]
            q4 = q.reshape(b, s, h, -1).transpose(0, 2, 1, 3)
            k4 = k.reshape(k.shape[0], k.shape[1], h, -1).transpose(0, 2, 3, 1)  # (b, h, d, t)
            v4 = v.reshape(v.shape[0], v.shape[1], h, -1).transpose(0, 2, 1, 3)
        elif q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and q.shape[1] == k.shape[1] == v.shape[1]:
            q4, k4, v4 = q, k.transpose(0, 1, 3, 2), v
        else:
            return None
        t = k4.shape[3]
        if mask is not None and (mask.shape[-1] != t or (mask.dtype != q.dtype and mask.dtype != np.bool_)):
            return None
        ct = q.dtype.type
        d = q4.shape[3]
        scores = np.matmul(q4, k4)
        scores *= ct(self.scale if self.scale is not None else 1 / math.sqrt(d))
        bias = self._bias(mask, q4.shape[2], t, 0, q.dtype)
        if bias is not None:
            scores += bias
        probs = self._softmax(scores, bias)
        if q.ndim == 4:
            return np.matmul(probs, v4)
        b, h, s = q4.shape[:3]
        dv = v4.shape[3]
        y = np.empty((b, s, h, dv), dtype=q.dtype)  # written in the 3-D output's layout: no transposed copy
        np.matmul(probs, v4, out=y.transpose(0, 2, 1, 3))
        return y.reshape(b, s, h * dv)

    def _bias(self, mask, s: int, t: int, past_len: int, ct) -> np.ndarray | None:
        """The additive bias (0 or -inf for boolean masks, the values for float ones), causal part included."""
        if mask is not None:
            if mask.shape[-1] < t:  # a short mask covers the first keys; the rest are masked
                width = [(0, 0)] * (mask.ndim - 1) + [(0, t - mask.shape[-1])]
                mask = np.pad(mask, width, constant_values=False if mask.dtype == np.bool_ else -np.inf)
            if mask.dtype == np.bool_:
                mask = np.where(mask, ct.type(0), ct.type(-np.inf))
            else:
                mask = mask.astype(ct, copy=False)
        if not self.is_causal:
            return mask
        causal = self._causal(s, t, past_len, ct)
        return causal if mask is None else mask + causal

    def _causal(self, s: int, t: int, past_len: int, ct) -> np.ndarray:
        """The (s, t) causal bias (0 where key j <= query i + past_len, else -inf), built once per shape;
        read-only, so runs on several threads can share it."""
        key = (s, t, past_len, ct)
        causal = self._causal_cache.get(key)
        if causal is None:
            allowed = np.arange(t)[None, :] <= np.arange(s)[:, None] + past_len
            causal = np.where(allowed, ct.type(0), ct.type(-np.inf))
            causal.flags.writeable = False
            self._causal_cache[key] = causal
        return causal

    def _softmax(self, scores: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """Softmax over keys. First tried with one maximum for the whole tensor (NumPy's max along a
        short last axis costs several times a whole-array max) and row sums as a GEMV; that is exact
        unless a row lies so far below the maximum that its exponentials underflow, which the row
        sums show (a sum below sqrt(tiny)): then the per-row softmax."""
        x = scores if self.softmax_dtype is None else scores.astype(self.softmax_dtype)
        if x.dtype in _FAST_SOFTMAX and x.flags.c_contiguous and x.size:
            top = np.maximum.reduce(x, axis=None)
            if np.isfinite(top):
                # Scores near 0 need no shift at all (exp cannot overflow): one call fewer.
                e = np.exp(x) if -30 < top < 30 else np.exp(np.subtract(x, top))
                rows = e.reshape(-1, x.shape[-1])
                total = np.dot(rows, constant_column(x.shape[-1], 1, x.dtype))
                if np.minimum.reduce(total, axis=None) >= _FAST_SOFTMAX[x.dtype]:
                    rows /= total
                    return e
        return self._softmax_rows(x, bias)

    @staticmethod
    def _softmax_rows(x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """Softmax over keys with each row's own maximum, in place on `x` (the kernel's own array)."""
        top = np.maximum.reduce(x, axis=-1, keepdims=True)
        dead = None
        if bias is not None:
            # Rows whose every key is masked attend to nothing: zeros, decided on the bias.
            dead = np.isneginf(np.maximum.reduce(bias, axis=-1, keepdims=True))
            if dead.any():
                top[np.isneginf(top)] = 0
            else:
                dead = None
        x -= top
        np.exp(x, out=x)
        total = np.add.reduce(x, axis=-1, keepdims=True)
        if dead is not None:
            total[total == 0] = 1
        x /= total
        if dead is not None:
            x = np.where(dead, 0, x)
        return x


# Row sums below these (sqrt of the smallest normal number) mean the shared maximum was too far
# above the row: exponentials may have lost precision or vanished (a row masked out entirely sums to 0).
_FAST_SOFTMAX = {np.dtype(t): np.sqrt(np.finfo(t).tiny) for t in (np.float32, np.float64)}


@register("RMSNormalization", since=23)
class RMSNormalization(OpKernel):
    """x / sqrt(mean(x^2 over axes [axis, rank)) + epsilon) * scale, computed in the stash type."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self.stash_type = self.attr_int("stash_type", 1)
        if self.stash_type not in (1, 11):
            raise self.bad_attr("stash_type", self.stash_type, "1 (FLOAT) or 11 (DOUBLE)")
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
