"""Recurrent layers: RNN, GRU and LSTM (opsets 7 and later), as onnxruntime computes them.

How: the input projection of every time step and direction is one GEMM before the recurrence
(X @ W^T plus both biases, for all steps at once); the recurrence is one Python loop over time whose
step makes one small GEMM per direction (H @ R^T, by the compiled single-threaded GEMM of
host/cpu_ep/native where it takes the product: no BLAS call overhead) and a handful of ufuncs on the
gate blocks, the directions stacked on a leading axis so each ufunc serves both. GRU without
linear_before_reset needs a second product per step, (r * H) @ Rh^T, as its equation says.

The reverse direction runs forward over a time-reversed copy of its projected input: with
sequence_lens, each batch entry is reversed within its own length (an index gather), and the outputs
are put back with the same index (the permutation is its own inverse). Past a batch entry's length its
state stops changing and its Y rows are 0; a length of 0 gives 0 in Y_h and Y_c, as in onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from host.cpu_ep.activations_rnn import NAMES as ACTIVATION_NAMES
from host.cpu_ep.activations_rnn import Activation, apply, parse_activations
from host.cpu_ep.base import OpKernel, compute_dtype
from host.cpu_ep.ops_math import native_matmul
from host.cpu_ep.registry import register

_DIRECTIONS = ("forward", "reverse", "bidirectional")


def gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for 2-D operands: the compiled single-threaded GEMM (host/cpu_ep/native) where it takes the
    product, else np.dot. A recurrence makes many small products: OpenBLAS's call and threading overhead
    would dominate them."""
    a = np.ascontiguousarray(a)
    y = native_matmul(a, b)
    return np.dot(a, b) if y is None else y


def per_direction(h: np.ndarray, rt: np.ndarray) -> np.ndarray:
    """h (D, B, H) @ rt (D, H, N) -> (D, B, N): one GEMM per direction."""
    if h.shape[0] == 1:
        return gemm(h[0], rt[0])[None]
    return np.stack([gemm(h[d], rt[d]) for d in range(h.shape[0])])


@dataclass
class _Sequence:
    """One run's inputs, in the recurrence's order: xw[s, d] is step s of direction d (time-reversed for a
    reverse direction), with both input-side biases added; valid[s] (None when every length is the full
    sequence) marks the batch entries still running at step s."""

    xw: np.ndarray  # (S, D, B, gates * H)
    valid: np.ndarray | None  # (S, 1, B, 1) bool
    order: np.ndarray | None  # (S, B) the reverse direction's time index per step and entry
    empty: np.ndarray | None  # (B,) bool: entries of length 0
    h0: np.ndarray  # (D, B, H)


class _Recurrent(OpKernel):
    """What RNN, GRU and LSTM share: attributes, input checks, the input projection and the time loop.
    Subclasses set GATES and DEFAULTS and write `_step`."""

    GATES = 1
    DEFAULTS: tuple[str, ...] = ("Tanh",)

    def __init__(self, node):
        super().__init__(node)
        self.hidden = self.attr_int("hidden_size", None, lo=1) if "hidden_size" in node.attrs else None
        self.direction = self.attr_str("direction", "forward", choices=_DIRECTIONS)
        self.dirs = 2 if self.direction == "bidirectional" else 1
        self.layout = self.attr_int("layout", 0, lo=0, hi=1)
        self.clip = self.attr_float("clip") if "clip" in node.attrs else None
        if self.clip is not None and not self.clip > 0:
            raise self.bad_attr("clip", self.clip, "a float > 0")
        self.acts = self._activations()
        self.want = [i < self.n_outputs and bool(node.outputs[i]) for i in range(3)]

    def _activations(self) -> list[tuple[Activation, ...]]:
        """Per gate function (f, g, h...): its Activation per direction, or one shared by both."""
        n = len(self.DEFAULTS)
        names = self.attr("activations", None)
        if names is None:
            names = list(self.DEFAULTS) * self.dirs
        if not isinstance(names, list) or len(names) != n * self.dirs:
            raise self.bad_attr("activations", names, f"a list of {n * self.dirs} names ({n} per direction, "
                                f"{self.dirs} direction(s))")
        alphas = self.attr("activation_alpha", [])
        betas = self.attr("activation_beta", [])
        try:
            acts = parse_activations(names, alphas, betas)
        except ValueError as exc:
            raise self.bad_attr("activations", names, "names among " + ", ".join(ACTIVATION_NAMES)) from exc
        per_fn = []
        for k in range(n):
            fns = tuple(acts[d * n + k] for d in range(self.dirs))
            per_fn.append(fns[:1] if len(set(fns)) == 1 else fns)
        return per_fn

    # -- inputs ---------------------------------------------------------------------------------------

    def _check(self, x, w, r, b, seq_lens, h0) -> tuple[int, int, int]:
        """(S, B, H) after checking every input's shape; ValueError naming the first that does not fit."""
        if x.ndim != 3:
            raise ValueError(f"X must have rank 3, got shape {x.shape}")
        s, batch = (x.shape[1], x.shape[0]) if self.layout else x.shape[:2]
        d = self.dirs
        hidden = self.hidden or (r.shape[-1] if r.ndim == 3 else -1)
        g = self.GATES
        want = {"W": (w, (d, g * hidden, x.shape[2])), "R": (r, (d, g * hidden, hidden)),
                "B": (b, (d, 2 * g * hidden)), "sequence_lens": (seq_lens, (batch,)),
                "initial_h": (h0, (batch, d, hidden) if self.layout else (d, batch, hidden))}
        for name, (arr, shape) in want.items():
            if arr is not None and arr.shape != shape:
                raise ValueError(f"{name} must have shape {shape} (direction {self.direction!r}, hidden_size "
                                 f"{hidden}, {g} gate(s)), got {arr.shape} (W: {w.shape}, X: {x.shape})")
        if seq_lens is not None and ((seq_lens < 0) | (seq_lens > s)).any():
            raise ValueError(f"sequence_lens must lie in [0, {s}] (the sequence length), got {seq_lens.tolist()}")
        return s, batch, hidden

    def _sequence(self, x, w, b_in, seq_lens, h0, ct) -> _Sequence:
        """Projects the whole input (one GEMM over every step and direction) and orders it per direction."""
        if self.layout:
            x = x.transpose(1, 0, 2)
        s, batch, _ = x.shape
        d, gh = self.dirs, w.shape[1]
        wt = np.ascontiguousarray(w.astype(ct, copy=False).transpose(2, 0, 1).reshape(x.shape[2], d * gh))
        xw = gemm(x.reshape(s * batch, -1).astype(ct, copy=False), wt)  # (S*B, D*gh)
        xw = xw.reshape(s, batch, d, gh).transpose(0, 2, 1, 3)
        if b_in is not None:
            xw = xw + b_in[None, :, None, :]
        lengths = None if seq_lens is None else seq_lens.astype(np.int64)
        full = lengths is None or bool((lengths == s).all())
        order = valid = empty = None
        if not full:
            steps = np.arange(s)[:, None]
            valid = steps < lengths[None, :]
            order = np.where(valid, lengths[None, :] - 1 - steps, steps)
            empty = lengths == 0 if (lengths == 0).any() else None
        xw = np.ascontiguousarray(xw, dtype=ct)  # (S, D, B, gh): a new array (GEMM output), ours to reorder
        rev = [k for k in range(d) if self.direction == "reverse" or k == 1]
        for k in rev:
            xw[:, k] = xw[::-1, k] if full else xw[order, k, np.arange(batch)[None, :]]
        if h0 is None:
            h0 = np.zeros((d, batch, gh // self.GATES), dtype=ct)
        else:
            h0 = (h0.transpose(1, 0, 2) if self.layout else h0).astype(ct)
        return _Sequence(xw, None if valid is None else valid[:, None, :, None], order, empty, h0)

    def _biases(self, b, ct) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(bias added to the input projection, bias kept inside the recurrence); the default puts both
        halves of B (Wb + Rb) in the projection."""
        if b is None:
            return None, None
        gh = b.shape[1] // 2
        b = b.astype(ct)
        return b[:, :gh] + b[:, gh:], None

    # -- the recurrence -------------------------------------------------------------------------------

    def _loop(self, seq: _Sequence, state, step):
        """Runs `step(xw_s, state) -> state` over time; state[0] is H. Returns (Y or None, final state)."""
        steps = seq.xw.shape[0]
        h0 = state[0]
        y = np.empty((steps, *h0.shape), dtype=h0.dtype) if self.want[0] else None
        valid = seq.valid
        for t in range(steps):
            new = step(seq.xw[t], state)
            if valid is not None:
                m = valid[t, 0]
                new = tuple(np.where(m, n, o) for n, o in zip(new, state))
            if y is not None:
                y[t] = new[0]
            state = new
        return y, state

    def _outputs(self, seq: _Sequence, y, state, dtype) -> tuple:
        """Y (zeros past each length, the reverse direction back in time order), Y_h and Y_c, in the layout
        asked for and the input dtype; outputs not asked for are empty arrays."""
        outs = []
        if y is not None:
            if seq.valid is not None:
                y *= seq.valid
            for k in range(self.dirs):
                if self.direction == "reverse" or k == 1:
                    y[:, k] = y[::-1, k] if seq.order is None else y[seq.order, k, np.arange(y.shape[2])[None, :]]
            outs.append(y.transpose(2, 0, 1, 3) if self.layout else y)
        else:
            outs.append(np.empty(0, dtype))
        for last in state:
            if seq.empty is not None:
                last = last.copy()
                last[:, seq.empty] = 0
            outs.append(last.transpose(1, 0, 2) if self.layout else last)
        outs = [o.astype(dtype, copy=False) for o in outs]
        return tuple(outs[: self.n_outputs])

    def _clip(self, x: np.ndarray) -> np.ndarray:
        """x bounded to [-clip, clip] (a new array), or x itself without clip. Never in place: x is often a
        strided view of a gate block (see activations_rnn)."""
        return x if self.clip is None else np.clip(x, -self.clip, self.clip)

    def _recurrent_weights(self, r, ct) -> np.ndarray:
        """R^T per direction: (D, H, gates * H), C-contiguous."""
        return np.ascontiguousarray(r.astype(ct, copy=False).transpose(0, 2, 1))


@register("RNN", since=7)
class RNN(_Recurrent):
    """Ht = f(Xt Wi^T + Ht-1 Ri^T + Wbi + Rbi)."""

    GATES = 1
    DEFAULTS = ("Tanh",)

    def _run(self, x, w, r, b=None, seq_lens=None, h0=None):
        self._check(x, w, r, b, seq_lens, h0)
        ct = compute_dtype(x.dtype)
        b_in, _ = self._biases(b, ct)
        seq = self._sequence(x, w, b_in, seq_lens, h0, ct)
        rt = self._recurrent_weights(r, ct)
        (f,) = self.acts

        def step(xw, state):
            g = per_direction(state[0], rt)
            g += xw
            return (apply(f, self._clip(g)),)

        y, state = self._loop(seq, (seq.h0,), step)
        return self._outputs(seq, y, state, x.dtype)


@register("GRU", since=7)
class GRU(_Recurrent):
    """Gates z, r, h (in that order in W, R, B). With linear_before_reset the recurrent bias of h stays
    inside the reset product: h = g(Xt Wh^T + Wbh + r * (Ht-1 Rh^T + Rbh))."""

    GATES = 3
    DEFAULTS = ("Sigmoid", "Tanh")

    def __init__(self, node):
        super().__init__(node)
        self.linear_before_reset = self.attr_bool("linear_before_reset", 0)

    def _biases(self, b, ct):
        if b is None or not self.linear_before_reset:
            return super()._biases(b, ct)
        gh = b.shape[1] // 2
        h = gh // 3
        b = b.astype(ct)
        b_in = b[:, :gh].copy()
        b_in[:, : 2 * h] += b[:, gh: gh + 2 * h]
        return b_in, np.ascontiguousarray(b[:, gh + 2 * h:])[:, None, :]  # Rbh as (D, 1, H)

    def _run(self, x, w, r, b=None, seq_lens=None, h0=None):
        _, _, hidden = self._check(x, w, r, b, seq_lens, h0)
        ct = compute_dtype(x.dtype)
        b_in, rbh = self._biases(b, ct)
        seq = self._sequence(x, w, b_in, seq_lens, h0, ct)
        rt = self._recurrent_weights(r, ct)
        step = self._step_linear(rt, rbh, hidden) if self.linear_before_reset else self._step(rt, hidden)
        y, state = self._loop(seq, (seq.h0,), step)
        return self._outputs(seq, y, state, x.dtype)

    def _step(self, rt, hidden):
        """The default GRU step: two products, H @ [Rz Rr]^T, then (r * H) @ Rh^T."""
        f, g = self.acts
        rt_zr = np.ascontiguousarray(rt[..., : 2 * hidden])
        rt_h = np.ascontiguousarray(rt[..., 2 * hidden:])

        def step(xw, state):
            h = state[0]
            zr = per_direction(h, rt_zr)
            zr += xw[..., : 2 * hidden]
            zr = apply(f, self._clip(zr))
            z, r = zr[..., :hidden], zr[..., hidden:]
            hh = per_direction(r * h, rt_h)
            hh += xw[..., 2 * hidden:]
            hh = apply(g, self._clip(hh))
            return (hh + z * (h - hh),)  # (1 - z) * hh + z * h

        return step

    def _step_linear(self, rt, rbh, hidden):
        """linear_before_reset: one product H @ R^T per step for all three gates."""
        f, g = self.acts

        def step(xw, state):
            h = state[0]
            gates = per_direction(h, rt)
            zr = apply(f, self._clip(gates[..., : 2 * hidden] + xw[..., : 2 * hidden]))
            z, r = zr[..., :hidden], zr[..., hidden:]
            recurrent = gates[..., 2 * hidden:] if rbh is None else gates[..., 2 * hidden:] + rbh
            hh = apply(g, self._clip(r * recurrent + xw[..., 2 * hidden:]))
            return (hh + z * (h - hh),)

        return step


@register("LSTM", since=7)
class LSTM(_Recurrent):
    """Gates i, o, f, c (in that order in W, R, B); peepholes P are i, o, f. input_forget couples the
    forget gate to the input gate (f = 1 - i). Clip bounds every gate's input before its activation."""

    GATES = 4
    DEFAULTS = ("Sigmoid", "Tanh", "Tanh")

    def __init__(self, node):
        super().__init__(node)
        self.input_forget = self.attr_bool("input_forget", 0)

    def _run(self, x, w, r, b=None, seq_lens=None, h0=None, c0=None, p=None):
        _, batch, hidden = self._check(x, w, r, b, seq_lens, h0)
        shape_c = (batch, self.dirs, hidden) if self.layout else (self.dirs, batch, hidden)
        for name, arr, shape in (("initial_c", c0, shape_c), ("P", p, (self.dirs, 3 * hidden))):
            if arr is not None and arr.shape != shape:
                raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
        ct = compute_dtype(x.dtype)
        b_in, _ = self._biases(b, ct)
        seq = self._sequence(x, w, b_in, seq_lens, h0, ct)
        if c0 is None:
            c0 = np.zeros_like(seq.h0)
        else:
            c0 = (c0.transpose(1, 0, 2) if self.layout else c0).astype(ct)
        peep = None if p is None else p.astype(ct).reshape(self.dirs, 3, 1, hidden)
        step = self._step(self._recurrent_weights(r, ct), peep, hidden)
        y, state = self._loop(seq, (seq.h0, c0), step)
        return self._outputs(seq, y, state, x.dtype)

    def _step(self, rt, peep, hidden):
        f, g, h_act = self.acts
        hid = hidden

        def step(xw, state):
            h, c = state
            gates = per_direction(h, rt)
            gates += xw
            if peep is None:
                # i, o and f are adjacent in the gate order: one activation call for the three.
                iof = apply(f, self._clip(gates[..., : 3 * hid]))
                i, o, fg = iof[..., :hid], iof[..., hid: 2 * hid], iof[..., 2 * hid:]
            else:
                i = apply(f, self._clip(gates[..., :hid] + peep[:, 0] * c))
                fg = apply(f, self._clip(gates[..., 2 * hid: 3 * hid] + peep[:, 2] * c))
            if self.input_forget:
                fg = 1 - i
            c_new = fg * c
            c_new += i * apply(g, self._clip(gates[..., 3 * hid:]))
            if peep is not None:
                # o's peephole reads the new cell state.
                o = apply(f, self._clip(gates[..., hid: 2 * hid] + peep[:, 1] * c_new))
            h_new = apply(h_act, c_new)
            h_new *= o
            return h_new, c_new

        return step
