"""Attention (ai.onnx opsets 23, 24 and 25): scaled dot-product attention with masks, causal and
sliding-window masking, KV caches (past_key/past_value, or an external cache with nonpad_kv_seqlen),
grouped-query heads, softcap and the qk_matmul_output modes; a compiled float32 kernel and a few-call
NumPy path serve the common cases."""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep import native, packed_gemm
from host.cpu_ep.base import OpKernel, compute_dtype, constant_column
from host.cpu_ep.registry import register

F32 = native.F32


def native_threads(dims) -> int:
    """Threads for ep_attention over dims (B, H, S, T, D, DV, R): the packed GEMM's rule (the run's bound,
    at most one per THREADED_MACS) over its multiply-adds; heads are shared out whole."""
    b, h, s, t, d, dv, _ = dims
    return packed_gemm.thread_count(b * h * s * t * (d + dv))


def _float_type(elem: int) -> np.dtype:
    from onnx import helper  # only when softmax_precision is set

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


@register("Attention", since=23)
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
        # Attention-25's sliding window: key j is visible from query position p when
        # p - left <= j <= p + right; -1 leaves a side unbounded.
        self.left_window = self.attr_int("left_window_size", -1, lo=-1)
        self.right_window = self.attr_int("right_window_size", -1, lo=-1)
        self._causal_cache: dict[tuple, np.ndarray] = {}
        # What _run_plain serves: one output, no softcap, softmax precision or window of its own.
        self._plain = (self.n_outputs == 1 and self.softcap == 0 and self.softmax_dtype is None
                       and self.left_window < 0 and self.right_window < 0)
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

    def _run(self, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        if (past_key is None and nonpad_kv_seqlen is None and self._plain and q.dtype in _FAST_SOFTMAX and k.dtype == q.dtype
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
        if nonpad_kv_seqlen is not None and past_key is not None:
            raise ValueError("nonpad_kv_seqlen (an external cache) cannot be combined with past_key/past_value")
        bias = self._bias(attn_mask, s, t, past_len, ct)
        if nonpad_kv_seqlen is not None or self.left_window >= 0 or self.right_window >= 0:
            bias = self._positional_bias(bias, attn_mask, s, t, past_len, nonpad_kv_seqlen, ct)
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
                            *strides, scale, self.is_causal, native_threads(dims)):
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

    def _bias(self, mask, s: int, t: int, past_len: int, ct, causal: bool = True) -> np.ndarray | None:
        """The additive bias (0 or -inf for boolean masks, the values for float ones), causal part included."""
        if mask is not None:
            if mask.shape[-1] < t:  # a short mask covers the first keys; the rest are masked
                width = [(0, 0)] * (mask.ndim - 1) + [(0, t - mask.shape[-1])]
                mask = np.pad(mask, width, constant_values=False if mask.dtype == np.bool_ else -np.inf)
            if mask.dtype == np.bool_:
                mask = np.where(mask, ct.type(0), ct.type(-np.inf))
            else:
                mask = mask.astype(ct, copy=False)
        if not (self.is_causal and causal):
            return mask
        causal = self._causal(s, t, past_len, ct)
        return causal if mask is None else mask + causal

    def _positional_bias(self, bias, mask, s: int, t: int, past_len: int, nonpad, ct) -> np.ndarray:
        """The bias with Attention-24/25's position rules: with nonpad_kv_seqlen (an external cache) batch
        entry b has nonpad[b] valid keys and its queries sit at the end of them (offset nonpad[b] - s, for
        the causal frontier and the window); the sliding window around each query's position."""
        if nonpad is None:
            offset, valid = past_len, None
        else:
            lengths = nonpad.astype(np.int64).reshape(-1, 1, 1, 1)
            offset, valid = lengths - s, np.arange(t) < lengths  # (b, 1, 1, t)
        if self.is_causal and nonpad is not None:
            bias = self._bias(mask, s, t, past_len, ct, causal=False)  # the causal part follows the offset
        distance = np.arange(s)[:, None] + offset - np.arange(t)  # query position minus key index
        allowed = np.ones(distance.shape, dtype=np.bool_)
        if self.is_causal and nonpad is not None:
            allowed &= distance >= 0
        if self.left_window >= 0:
            allowed &= distance <= self.left_window
        if self.right_window >= 0:
            allowed &= -distance <= self.right_window
        if valid is not None:
            allowed = allowed & valid
        extra = np.where(allowed, ct.type(0), ct.type(-np.inf))
        return extra if bias is None else bias + extra

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
