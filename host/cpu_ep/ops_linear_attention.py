"""LinearAttention (ai.onnx opset 27): recurrent linear attention with a (d_k, d_v) state per key/value
head, updated per step by the linear, gated (decay), delta (beta) or gated-delta rule, read by the queries
(grouped-query heads share their key/value head's state). One loop over time, vectorized over batch and
heads, in float32 as onnx's reference computes it."""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep.base import OpKernel
from host.cpu_ep.registry import register
from host.errors import InvalidArgument

_RULES = ("linear", "gated", "delta", "gated_delta")


def _heads(x: np.ndarray, heads: int, what: str) -> np.ndarray:
    """(B, T, H*D) -> (B, H, T, D) in float32."""
    if x.ndim != 3 or x.shape[2] % heads:
        raise InvalidArgument(f"LinearAttention's {what} must be (batch, seq, {heads} heads * size); "
                              f"got shape {list(x.shape)}")
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3).astype(np.float32)


@register("LinearAttention", since=27)
class LinearAttention(OpKernel):
    """output (B, T, Hq*dv) and present_state (B, Hkv, dk, dv)."""

    def __init__(self, node):
        super().__init__(node)
        self.rule = self.attr_str("update_rule", "gated_delta", _RULES)
        self.q_heads = self.attr_int("q_num_heads", lo=1)
        self.kv_heads = self.attr_int("kv_num_heads", lo=1)
        if self.q_heads % self.kv_heads:
            raise self.bad_attr("q_num_heads", self.q_heads, f"a multiple of kv_num_heads ({self.kv_heads})")
        self.scale = self.attr_float("scale", 0.0)
        self.gating = self.rule in ("gated", "gated_delta")
        self.delta = self.rule in ("delta", "gated_delta")

    def _check_optional(self, decay, beta) -> None:
        for name, value, wanted in (("decay", decay, self.gating), ("beta", beta, self.delta)):
            if (value is not None) != wanted:
                verb = "needs" if wanted else "takes no"
                raise InvalidArgument(f"LinearAttention with update_rule '{self.rule}' {verb} input {name}")

    def _decay(self, decay: np.ndarray, d_k: int) -> np.ndarray:
        """(B, Hkv, T, 1 or d_k): one decay per head, or per head and key dimension."""
        h = self.kv_heads
        if decay.ndim == 3 and decay.shape[2] == h:
            return decay.reshape(*decay.shape[:2], h, 1).transpose(0, 2, 1, 3).astype(np.float32)
        if decay.ndim == 3 and decay.shape[2] == h * d_k:
            return _heads(decay, h, "decay")
        raise InvalidArgument(f"LinearAttention's decay must be (batch, seq, {h} or {h * d_k}); "
                              f"got shape {list(decay.shape)}")

    def _beta(self, beta: np.ndarray) -> np.ndarray:
        """(B, Hkv or 1, T, 1)."""
        if beta.ndim != 3 or beta.shape[2] not in (self.kv_heads, 1):
            raise InvalidArgument(f"LinearAttention's beta must be (batch, seq, {self.kv_heads} or 1); "
                                  f"got shape {list(beta.shape)}")
        return beta.reshape(*beta.shape, 1).transpose(0, 2, 1, 3).astype(np.float32)

    def _run(self, query, key, value, past_state=None, decay=None, beta=None):
        self._check_optional(decay, beta)
        q = _heads(query, self.q_heads, "query")
        k = _heads(key, self.kv_heads, "key")
        v = _heads(value, self.kv_heads, "value")
        b, _, t, d_k = q.shape
        d_v = v.shape[3]
        if past_state is None:
            state = np.zeros((b, self.kv_heads, d_k, d_v), np.float32)
        elif past_state.shape != (b, self.kv_heads, d_k, d_v):
            raise InvalidArgument(f"LinearAttention's past_state must have shape {[b, self.kv_heads, d_k, d_v]}; "
                                  f"got {list(past_state.shape)}")
        else:
            state = past_state.astype(np.float32)
        gates = None if decay is None else np.exp(self._decay(decay, d_k))
        betas = None if beta is None else self._beta(beta)
        scale = np.float32(self.scale if self.scale != 0 else 1 / math.sqrt(d_k))
        # Query head h reads key/value head h // group: group the query heads under their kv head.
        grouped = q.reshape(b, self.kv_heads, self.q_heads // self.kv_heads, t, d_k)
        out = np.empty((b, self.kv_heads, self.q_heads // self.kv_heads, t, d_v), np.float32)
        for i in range(t):
            state = self._step(state, k[:, :, i], v[:, :, i], None if gates is None else gates[:, :, i],
                               None if betas is None else betas[:, :, i])
            out[:, :, :, i] = np.matmul(grouped[:, :, :, i], state) * scale
        y = out.reshape(b, self.q_heads, t, d_v).transpose(0, 2, 1, 3).reshape(b, t, self.q_heads * d_v)
        state_type = query.dtype if past_state is None else past_state.dtype
        return y.astype(query.dtype, copy=False), state.astype(state_type, copy=False)

    @staticmethod
    def _step(state, k_t, v_t, gate, beta) -> np.ndarray:
        """One time step: decay the state, correct the value by what the state already recalls for the
        key (delta rule), add the key-value outer product."""
        if gate is not None:
            state = state * gate[..., None]
        if beta is not None:
            recalled = np.einsum("bhdm,bhd->bhm", state, k_t)
            v_t = beta * (v_t - recalled)
        return state + k_t[..., :, None] * v_t[..., None, :]
