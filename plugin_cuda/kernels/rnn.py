"""RNN, GRU and LSTM (opset 7 and later) on the GPU: every attribute ONNX defines.

Formulation (docs/cuda_ops.md says why not a persistent kernel): the input projection X @ W^T of every
time step and direction is one GEMM; then per time step one batched GEMM h @ R^T (both directions in
one strided-batched call) and one fused gate kernel (plugin_cuda/kernels/rnn_cells.py) that adds the
projection and bias, applies clip and activations, updates the state in place and writes Y. The default
GRU (linear_before_reset=0) needs r before its second product: GEMM, gate kernel, GEMM, gate kernel.
GEMMs go through the plugin's cuBLAS handle (ctx.cublas) and nothing reads device memory on the host
(sequence_lens is read by the gate kernels), so the node is capturable in a CUDA graph.

float16 is computed in float32: the inputs are cast once per call, the outputs cast back.

`Recurrence.run` takes the array module and its GEMM and gate launchers as arguments, so the same
step logic runs with NumPy in a CPU test (tests/plugin_cuda/test_rnn_cpu.py, with a NumPy twin of
the gate kernels); on the device it is CuPy, cuBLAS and the NVRTC-compiled gate kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device import cublas, nvrtc
from ..device.streams import arg_ptr, grid_1d
from .base import FLOAT, CudaKernel, register
from .rnn_cells import CELL_KINDS, NAMES, cell_source, parse_activations

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

__all__ = ["GRU", "LSTM", "RNN", "Recurrence", "Weights"]

_DIRECTIONS = ("forward", "reverse", "bidirectional")
_F32 = np.float32
_THREADS = 256


@dataclass
class Weights:
    """One call's inputs in float32 (absent ones None), X in its own layout."""

    x: object
    w: object
    r: object
    b: object = None
    lens: object = None
    h0: object = None
    c0: object = None
    p: object = None


@dataclass
class Buffers:
    """What the gate kernels read and write during one call (rnn_cells' signature, in order)."""

    xw: object
    bias: object
    h: object
    c: object
    extra: object
    y: object
    lens: object
    z: object
    rh: object
    dims: tuple  # S, B, H, D, layout, rev_mask
    launch_args: tuple | None = None  # the device launcher's per-call arguments, made at the first step


@dataclass(frozen=True)
class Recurrence:
    """A node's configuration: the cell kind (rnn_cells.CELL_KINDS), directions, layout."""

    kind: str
    dirs: int
    rev_mask: int
    layout: int
    hidden: int | None

    @property
    def gates(self) -> int:
        return CELL_KINDS[self.kind][0]

    def shapes(self, x_shape, w_shape, r_shape) -> tuple[int, int, int]:
        """(S, B, H) from the shapes of X, W and R; ValueError naming what does not fit."""
        if len(x_shape) != 3:
            raise ValueError(f"X must have rank 3, got shape {tuple(x_shape)}")
        s, batch = (x_shape[1], x_shape[0]) if self.layout else (x_shape[0], x_shape[1])
        hidden = self.hidden or (r_shape[-1] if len(r_shape) == 3 else -1)
        g, d = self.gates, self.dirs
        for name, got, want in (("W", w_shape, (d, g * hidden, x_shape[2])), ("R", r_shape, (d, g * hidden, hidden))):
            if tuple(got) != want:
                raise ValueError(f"{name} must have shape {want} ({d} direction(s), hidden_size {hidden}, {g} "
                                 f"gate(s)), got {tuple(got)}")
        return s, batch, hidden

    def check_optional(self, a: Weights, s: int, batch: int, hidden: int) -> None:
        """The optional inputs' shapes; ValueError naming the first that does not fit."""
        d, g = self.dirs, self.gates
        state = (batch, d, hidden) if self.layout else (d, batch, hidden)
        for name, arr, want in (("B", a.b, (d, 2 * g * hidden)), ("sequence_lens", a.lens, (batch,)),
                                ("initial_h", a.h0, state), ("initial_c", a.c0, state), ("P", a.p, (d, 3 * hidden))):
            if arr is not None and tuple(arr.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(arr.shape)}")

    def biases(self, xp, b, gh: int, hidden: int):
        """(input-side bias (D, G*H), extra): both halves of B summed, except the GRU with
        linear_before_reset, whose Rbh stays inside the reset product (returned as extra, (D, H))."""
        if b is None:
            return xp.zeros((self.dirs, gh), _F32), None
        if self.kind != "gru_lbr":
            return xp.ascontiguousarray(b[:, :gh] + b[:, gh:]), None
        bias = xp.array(b[:, :gh])
        bias[:, : 2 * hidden] += b[:, gh: gh + 2 * hidden]
        return bias, xp.ascontiguousarray(b[:, gh + 2 * hidden:])

    def state(self, xp, init, batch: int, hidden: int):
        """A fresh (D, B, H) float32 state: zeros, or a copy of init in the internal layout."""
        out = xp.zeros((self.dirs, batch, hidden), _F32)
        if init is not None:
            out[...] = init.transpose(1, 0, 2) if self.layout else init
        return out

    def run(self, xp, gemm_nt, matmul, launch, a: Weights, want_y: bool):
        """(Y float32 in the output layout or None, final h (D, B, H), final c or None).

        gemm_nt(a, b, out): out = a @ b^T (2-D); matmul(a, b, out): out = a @ b (3-D, batched);
        launch(name, buffers, t, hr): one gate kernel of rnn_cells."""
        s, batch, hidden = self.shapes(a.x.shape, a.w.shape, a.r.shape)
        self.check_optional(a, s, batch, hidden)
        d, gh = self.dirs, self.gates * hidden
        xw = xp.empty((s * batch, d * gh), _F32)
        gemm_nt(a.x.reshape(s * batch, a.x.shape[2]), a.w.reshape(d * gh, a.x.shape[2]), xw)
        bias, extra = self.biases(xp, a.b, gh, hidden)
        if self.kind == "lstm":
            extra = None if a.p is None else xp.ascontiguousarray(a.p)
        y_shape = (batch, s, d, hidden) if self.layout else (s, d, batch, hidden)
        scratch = self.kind == "gru"
        buf = Buffers(xw, bias, self.state(xp, a.h0, batch, hidden),
                      self.state(xp, a.c0, batch, hidden) if self.kind == "lstm" else None, extra,
                      xp.empty(y_shape, _F32) if want_y else None, a.lens,
                      xp.empty((d, batch, hidden), _F32) if scratch else None,
                      xp.empty((d, batch, hidden), _F32) if scratch else None,
                      (s, batch, hidden, d, self.layout, self.rev_mask))
        rt = xp.ascontiguousarray(a.r.transpose(0, 2, 1))  # (D, H, G*H)
        if self.kind == "gru":
            self._loop_gru(xp, matmul, launch, buf, rt, s, hidden)
        else:
            hr = xp.empty((d, batch, gh), _F32)
            name = CELL_KINDS[self.kind][1][0]
            for t in range(s):
                matmul(buf.h, rt, hr)
                launch(name, buf, t, hr)
        return buf.y, buf.h, buf.c

    def _loop_gru(self, xp, matmul, launch, buf: Buffers, rt, s: int, hidden: int) -> None:
        """The default GRU's step: h @ [Rz Rr]^T, gates z and r (and r * h), (r * h) @ Rh^T, gate h."""
        rt_zr = xp.ascontiguousarray(rt[..., : 2 * hidden])
        rt_h = xp.ascontiguousarray(rt[..., 2 * hidden:])
        d, batch = buf.h.shape[:2]
        hr_zr = xp.empty((d, batch, 2 * hidden), _F32)
        hr_h = xp.empty((d, batch, hidden), _F32)
        for t in range(s):
            matmul(buf.h, rt_zr, hr_zr)
            launch("gru_zr", buf, t, hr_zr)
            matmul(buf.rh, rt_h, hr_h)
            launch("gru_h", buf, t, hr_h)

    def final_state(self, xp, state, lens):
        """Y_h / Y_c: the final state, 0 for batch entries of length 0 (as onnxruntime), in the layout."""
        if lens is not None:
            state = state * (lens > 0).astype(_F32)[None, :, None]
        return state.transpose(1, 0, 2) if self.layout else state


# ---------------------------------------------------------------------------------------------
# Device side


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _device_launcher(module):
    """launch(name, buffers, t, hr) on CuPy's current stream: one gate kernel of rnn_cells."""

    def launch(name: str, buf: Buffers, t: int, hr) -> None:
        if buf.launch_args is None:  # what every step of this call shares: worked out at its first step
            s, batch, hidden, d, layout, rev_mask = buf.dims
            pointers = tuple(arg_ptr(_ptr(v)) for v in (buf.xw, buf.bias, buf.h, buf.c, buf.extra, buf.y, buf.lens,
                                                         buf.z, buf.rh))
            buf.launch_args = (grid_1d(d * batch * hidden, _THREADS), pointers,
                               tuple(np.int32(v) for v in (s, batch, hidden, d, layout, rev_mask)))
        grid, (xw, bias, h, c, extra, y, lens, z, rh), dims = buf.launch_args
        module.kernel(name)((grid,), (_THREADS,), (xw, bias, arg_ptr(_ptr(hr)), h, c, extra, y, lens, z, rh,
                                                   np.int32(t), *dims))

    return launch


class _Recurrent(CudaKernel):
    """What RNN, GRU and LSTM share: attributes, the cell source, the run on the device."""

    # X, W, R, B, sequence_lens, initial_h, (LSTM: initial_c, P)
    input_types = (FLOAT, FLOAT, FLOAT, FLOAT, frozenset({"int32"}), FLOAT, FLOAT, FLOAT)
    same_type = (0, 1, 2, 3, 5, 6, 7)
    needs_cublas = True
    DEFAULTS: tuple[str, ...] = ("Tanh",)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        hidden = self.attr_int("hidden_size")
        if hidden is not None and hidden < 1:
            raise self.bad_attr("hidden_size", hidden, "an integer >= 1")
        direction = self.attr_str("direction", "forward", _DIRECTIONS)
        dirs = 2 if direction == "bidirectional" else 1
        layout = self.attr_int("layout", 0, (0, 1))
        self.clip = self.attr_float("clip")
        if self.clip is not None and not self.clip > 0:
            raise self.bad_attr("clip", self.clip, "a float > 0")
        rev_mask = {"forward": 0, "reverse": 1, "bidirectional": 2}[direction]
        self.recurrence = Recurrence(self._kind(), dirs, rev_mask, layout, hidden)
        self.acts = self._activations(dirs)
        self.source = cell_source(self._kind(), self.acts, self.clip, self._input_forget())
        self._modules: dict = {}

    def _kind(self) -> str:
        raise NotImplementedError

    def _input_forget(self) -> bool:
        return False

    def _activations(self, dirs: int):
        """Per gate function: its Activation per direction, or one shared by both directions."""
        n = len(self.DEFAULTS)
        names = self.attrs.get("activations")
        if names is None:
            names = list(self.DEFAULTS) * dirs
        if not isinstance(names, (list, tuple)) or len(names) != n * dirs:
            raise self.bad_attr("activations", names, f"a list of {n * dirs} names ({n} per direction, "
                                f"{dirs} direction(s))")
        try:
            acts = parse_activations(names, list(self.attrs.get("activation_alpha", ())),
                                     list(self.attrs.get("activation_beta", ())))
        except ValueError as exc:
            raise self.bad_attr("activations", names, "names among " + ", ".join(NAMES)) from exc
        per_fn = []
        for k in range(n):
            fns = tuple(acts[d * n + k] for d in range(dirs))
            per_fn.append(fns[:1] if len(set(fns)) == 1 else fns)
        return per_fn

    def _compute(self, ctx):
        inputs = list(ctx.inputs) + [None] * (8 - len(ctx.inputs))
        x = inputs[0]
        dtype = x.dtype

        def f32(v):
            return None if v is None else cupy.ascontiguousarray(v, dtype=_F32)

        lens = None if inputs[4] is None else cupy.ascontiguousarray(inputs[4], dtype=np.int32)
        a = Weights(f32(x), f32(inputs[1]), f32(inputs[2]), f32(inputs[3]), lens, f32(inputs[5]),
                    f32(inputs[6]), f32(inputs[7]))
        device = cupy.cuda.Device().id
        module = self._modules.get(device)
        if module is None:  # compiled once per device (and cached on disk by CuPy)
            module = self._modules[device] = nvrtc.load(cupy, self.source, device)
        handle = ctx.cublas
        wants = [_wants(ctx, i) for i in range(3 if self.recurrence.kind == "lstm" else 2)]

        def gemm_nt(p, q, out):
            cublas.gemm(handle, p, q, None, 1.0, 0.0, False, True, out)

        def matmul(p, q, out):
            cublas.matmul(handle, p, q, out)

        y, h, c = self.recurrence.run(cupy, gemm_nt, matmul, _device_launcher(module), a, wants[0])
        if wants[0]:
            cupy.copyto(ctx.output(0, y.shape, dtype), y)
        for index, state in ((1, h), (2, c)):
            if index < len(wants) and wants[index]:
                final = self.recurrence.final_state(cupy, state, lens)
                cupy.copyto(ctx.output(index, final.shape, dtype), final)


def _wants(ctx, index: int) -> bool:
    """Whether the node has output `index` (an empty name in the middle is an absent output)."""
    wants = getattr(ctx, "wants", None)
    if wants is not None:
        return wants(index)
    return index < getattr(ctx, "num_outputs", 1)


@register("RNN", 7)
class RNN(_Recurrent):
    """Ht = f(Xt Wi^T + Ht-1 Ri^T + Wbi + Rbi)."""

    max_outputs = 2
    input_types = _Recurrent.input_types[:6]

    def _kind(self):
        return "rnn"


@register("GRU", 7)
class GRU(_Recurrent):
    """Gates z, r, h; linear_before_reset keeps Rbh inside the reset product (one GEMM per step)."""

    max_outputs = 2
    input_types = _Recurrent.input_types[:6]
    DEFAULTS = ("Sigmoid", "Tanh")

    def _kind(self):
        return "gru_lbr" if self.attributes.flag("linear_before_reset", 0) else "gru"


@register("LSTM", 7)
class LSTM(_Recurrent):
    """Gates i, o, f, c; peepholes P (i, o, f); input_forget couples f to 1 - i."""

    max_outputs = 3
    DEFAULTS = ("Sigmoid", "Tanh", "Tanh")

    def _kind(self):
        return "lstm"

    def _input_forget(self):
        return self.attributes.flag("input_forget", 0)
