"""The recurrent layers' activations and their fused gate kernels (CUDA C, one source per configuration).

A recurrent step is: one GEMM with R (plugin_cuda/kernels/rnn.py), then one launch of a gate kernel
here that, per (direction, batch entry, hidden unit), adds the step's input projection and bias to the
GEMM's result, applies the clip and the activations, updates the state in place and writes Y. The
default GRU needs the reset gate before its second GEMM, so it has two kernels (`gru_zr`, `gru_h`).

Every kernel has one signature (unused pointers are 0), so one launcher serves all:

    (xw, bias, hr, h, c, extra, y, lens, z, rh, t, S, B, H, D, layout, rev_mask)

xw (rows, D*G*H) is X @ W^T for every step (rows ordered as X: time-major for layout 0, batch-major for
layout 1); bias (D, G*H) the input-side bias; hr (D, B, width) this step's product with R; h and c the
state (D, B, H); extra the LSTM peepholes P (D, 3H) or the GRU's Rbh (D, H); y the float32 Y in the
output's layout; lens the int32 sequence_lens or 0; z, rh the default GRU's scratch (D, B, H).

Sequence lengths are read on the device (no host copy, so the node is capturable): past a batch entry's
length the state is kept and Y is 0; a reverse direction's step t reads and writes time len - 1 - t.
Activation parameters follow onnxruntime's defaults (LeakyRelu alpha 0.01, HardSigmoid 0.2 / 0.5, Elu
1.0, 0 otherwise), as the CPU EP's host/cpu_ep/activations_rnn.py.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACTIVATIONS", "CELL_KINDS", "Activation", "cell_source", "parse_activations"]

# lower-case name -> (C expression of x, {a}, {b}; takes alpha; takes beta; default alpha; default beta)
ACTIVATIONS: dict[str, tuple[str, bool, bool, float, float]] = {
    "relu": ("fmaxf(x, 0.f)", False, False, 0.0, 0.0),
    "tanh": ("tanhf(x)", False, False, 0.0, 0.0),
    "sigmoid": ("1.f / (1.f + expf(-x))", False, False, 0.0, 0.0),
    "affine": ("{a} * x + {b}", True, True, 0.0, 0.0),
    "leakyrelu": ("(x < 0.f ? {a} * x : x)", True, False, 0.01, 0.0),
    # onnxruntime keeps x where x > alpha (ONNX writes >=; they differ only at x == alpha).
    "thresholdedrelu": ("(x > {a} ? x : 0.f)", True, False, 0.0, 0.0),
    "scaledtanh": ("{a} * tanhf({b} * x)", True, True, 0.0, 0.0),
    "hardsigmoid": ("fminf(fmaxf({a} * x + {b}, 0.f), 1.f)", True, True, 0.2, 0.5),
    "elu": ("(x < 0.f ? {a} * expm1f(x) : x)", True, False, 1.0, 0.0),
    "softsign": ("x / (1.f + fabsf(x))", False, False, 0.0, 0.0),
    "softplus": ("(fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))))", False, False, 0.0, 0.0),
}
NAMES = ("Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid",
         "Elu", "Softsign", "Softplus")
# kind -> (gates, kernels launched per step, in order)
CELL_KINDS = {"rnn": (1, ("rnn",)), "lstm": (4, ("lstm",)), "gru_lbr": (3, ("gru_lbr",)),
              "gru": (3, ("gru_zr", "gru_h"))}


@dataclass(frozen=True)
class Activation:
    name: str  # lower case
    alpha: float = 0.0
    beta: float = 0.0

    def c_expr(self) -> str:
        return ACTIVATIONS[self.name][0].format(a=f"({self.alpha!r}f)", b=f"({self.beta!r}f)")


def parse_activations(names, alphas, betas) -> list[Activation]:
    """The Activation of each name, taking alphas and betas in order; ValueError for an unknown name."""
    alpha_iter, beta_iter = iter(alphas), iter(betas)
    out = []
    for name in names:
        name = name.decode() if isinstance(name, bytes) else str(name)
        entry = ACTIVATIONS.get(name.lower())
        if entry is None:
            raise ValueError(f"activation {name!r} is not one of {', '.join(NAMES)}")
        _, takes_alpha, takes_beta, alpha, beta = entry
        if takes_alpha:
            alpha = float(next(alpha_iter, alpha))
        if takes_beta:
            beta = float(next(beta_iter, beta))
        out.append(Activation(name.lower(), alpha, beta))
    return out


_PRELUDE = r"""
#define ARGS const float* __restrict__ xw, const float* __restrict__ bias, const float* __restrict__ hr, \
    float* __restrict__ h, float* __restrict__ c, const float* __restrict__ extra, float* __restrict__ y, \
    const int* __restrict__ lens, float* __restrict__ z, float* __restrict__ rh, \
    int t, int S, int B, int H, int D, int layout, int rev_mask
struct Cell { int d, b, j; bool valid; long long xrow, yidx, sidx; };
__device__ __forceinline__ Cell cell_at(long long i, const int* lens, int t, int S, int B, int H, int D,
                                        int layout, int rev_mask) {
    Cell q;
    q.j = (int)(i % H);
    q.b = (int)((i / H) % B);
    q.d = (int)(i / ((long long)H * B));
    int len = lens ? lens[q.b] : S;
    q.valid = t < len;
    int tt = (q.valid && ((rev_mask >> q.d) & 1)) ? len - 1 - t : t;
    q.xrow = layout ? (long long)q.b * S + tt : (long long)tt * B + q.b;
    q.yidx = layout ? (((long long)q.b * S + tt) * D + q.d) * H + q.j
                    : (((long long)tt * D + q.d) * B + q.b) * H + q.j;
    q.sidx = ((long long)q.d * B + q.b) * H + q.j;
    return q;
}
#define LOOP for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)D * B * H; \
                  i += (long long)gridDim.x * blockDim.x)
#define CELL Cell q = cell_at(i, lens, t, S, B, H, D, layout, rev_mask)
#define XG(g) (xw[q.xrow * ((long long)D * G * H) + (long long)q.d * G * H + (g) * H + q.j] \
               + bias[(long long)q.d * G * H + (g) * H + q.j])
#define HR(g, width) hr[((long long)q.d * B + q.b) * (width) + (g) * H + q.j]
"""

_BODIES = {
    "rnn": r"""
extern "C" __global__ void rnn(ARGS) {
    LOOP { CELL;
        if (!q.valid) { if (y) y[q.yidx] = 0.f; continue; }
        float hn = act0(q.d, CLIP(XG(0) + HR(0, H)));
        h[q.sidx] = hn;
        if (y) y[q.yidx] = hn;
    }
}
""",
    "lstm": r"""
extern "C" __global__ void lstm(ARGS) {
    LOOP { CELL;
        if (!q.valid) { if (y) y[q.yidx] = 0.f; continue; }
        float cp = c[q.sidx];
        float gi = XG(0) + HR(0, 4 * H), go = XG(1) + HR(1, 4 * H);
        float gf = XG(2) + HR(2, 4 * H), gc = XG(3) + HR(3, 4 * H);
        const float* p = extra ? extra + (long long)q.d * 3 * H : 0;
        if (p) { gi += p[q.j] * cp; gf += p[2 * H + q.j] * cp; }
        float ig = act0(q.d, CLIP(gi));
        float fg = INPUT_FORGET ? 1.f - ig : act0(q.d, CLIP(gf));
        float cn = fg * cp + ig * act1(q.d, CLIP(gc));
        if (p) go += p[H + q.j] * cn;  /* o's peephole reads the new cell state */
        float hn = act0(q.d, CLIP(go)) * act2(q.d, cn);
        c[q.sidx] = cn;
        h[q.sidx] = hn;
        if (y) y[q.yidx] = hn;
    }
}
""",
    "gru_lbr": r"""
extern "C" __global__ void gru_lbr(ARGS) {
    LOOP { CELL;
        if (!q.valid) { if (y) y[q.yidx] = 0.f; continue; }
        float zg = act0(q.d, CLIP(XG(0) + HR(0, 3 * H)));
        float rg = act0(q.d, CLIP(XG(1) + HR(1, 3 * H)));
        float rec = HR(2, 3 * H) + (extra ? extra[(long long)q.d * H + q.j] : 0.f);
        float hh = act1(q.d, CLIP(XG(2) + rg * rec));
        float hn = (1.f - zg) * hh + zg * h[q.sidx];
        h[q.sidx] = hn;
        if (y) y[q.yidx] = hn;
    }
}
""",
    "gru_zr": r"""
extern "C" __global__ void gru_zr(ARGS) {
    LOOP { CELL;
        if (!q.valid) { rh[q.sidx] = 0.f; continue; }
        z[q.sidx] = act0(q.d, CLIP(XG(0) + HR(0, 2 * H)));
        rh[q.sidx] = act0(q.d, CLIP(XG(1) + HR(1, 2 * H))) * h[q.sidx];
    }
}
""",
    "gru_h": r"""
extern "C" __global__ void gru_h(ARGS) {
    LOOP { CELL;
        if (!q.valid) { if (y) y[q.yidx] = 0.f; continue; }
        float hh = act1(q.d, CLIP(XG(2) + HR(0, H)));
        float zg = z[q.sidx];
        float hn = (1.f - zg) * hh + zg * h[q.sidx];
        h[q.sidx] = hn;
        if (y) y[q.yidx] = hn;
    }
}
""",
}


def _activation_function(k: int, per_direction: tuple[Activation, ...]) -> str:
    """`act<k>(d, x)`: gate function k, by direction (one shared body when the directions agree)."""
    lines = [f"__device__ __forceinline__ float act{k}(int d, float x) {{"]
    for d, act in enumerate(per_direction[:-1]):
        lines.append(f"    if (d == {d}) return {act.c_expr()};")
    lines.append(f"    return {per_direction[-1].c_expr()};")
    lines.append("}")
    return "\n".join(lines)


def cell_source(kind: str, acts: list[tuple[Activation, ...]], clip: float | None, input_forget: bool) -> str:
    """The CUDA source of `kind`'s gate kernels (CELL_KINDS) for these activations (per gate function, one
    per direction or one shared), clip and input_forget."""
    gates, names = CELL_KINDS[kind]
    parts = [f"#define G {gates}", f"#define INPUT_FORGET {int(bool(input_forget))}",
             "#define CLIP(v) (v)" if clip is None else f"#define CLIP(v) fminf(fmaxf((v), -{clip!r}f), {clip!r}f)",
             _PRELUDE]
    parts += [_activation_function(k, fns) for k, fns in enumerate(acts)]
    parts += [_BODIES[name] for name in names]
    return "\n".join(parts)
