"""Lowering: a partition's ONNX nodes become a small program of plan ops with static shapes.

Pure Python and NumPy (no CuPy): tested without a GPU.

Plan ops, each with value ids in and out:
  ew         one elementwise expression (attrs["expr"]: a C expression over {0}, {1}, ...)
  gemm       op(A) @ op(B) * alpha (attrs trans_a, trans_b, alpha); N-D MatMul batching
  softmax    over the last axis (attrs["log"] for LogSoftmax)
  norm       LayerNorm / RMSNorm over the trailing `cols` elements (attrs kind, eps)
  transpose  attrs["perm"]
  copy       a strided read: out[i] = in[offset + sum(coord_d(i) * in_strides[d])] (Split)
  place      a strided write: out[offset + sum(coord_d(i) * out_strides[d])] = in[i] (Concat)
  rotary     RotaryEmbedding over (batch, heads, seq, size) or (batch, seq, heads * size)
  conv       a direct 2-D convolution (groups, pads, strides, dilations; bias fused)
  mean       the mean over the trailing `inner` elements (ReduceMean, GlobalAveragePool)
  alias      a view with another shape over the same bytes (Reshape, Flatten, Squeeze, ...)
Lowering rules are registered per (domain, op_type) in one table (`LOWERINGS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from plugin_cuda.plan.errors import PlanError

FLOAT32 = 1  # ONNX TensorProto.FLOAT
INT64, INT32 = 7, 6
EPHOST_DOMAIN = "ai.ephost"
MAX_OPSET = 23


@dataclass
class Value:
    """A tensor of the program: static shape, and its data when it is a constant."""

    id: int
    name: str
    shape: tuple
    const: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))


@dataclass
class Op:
    kind: str
    node: str  # the ONNX node it came from, for error messages
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)


@dataclass
class Program:
    values: dict
    ops: list
    inputs: list  # value ids, in the partition's input order
    outputs: list

    def new_value(self, name: str, shape: tuple, const=None) -> int:
        vid = max(self.values, default=-1) + 1
        vid = max(vid, 1 << 20)  # synthetic ids never collide with the graph's value indices
        while vid in self.values:
            vid += 1
        self.values[vid] = Value(vid, name, tuple(int(d) for d in shape), const)
        return vid

    def const_value(self, name: str, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array, dtype=np.float32)
        return self.new_value(name, array.shape, array)


# ---------------------------------------------------------------------------------------------
# Registry


LOWERINGS: dict = {}


def lowers(*op_types: str, domain: str = ""):
    """Decorator: register a lowering rule fn(ctx, node) for op types of `domain`."""

    def decorate(fn):
        for op in op_types:
            key = (domain, op)
            if key in LOWERINGS:
                raise RuntimeError(f"plan lowering for {domain or 'ai.onnx'}::{op} registered twice")
            LOWERINGS[key] = fn
        return fn

    return decorate


def _domain(node) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


class _Ctx:
    """What a lowering rule sees: the program so far and helpers for shapes, constants and ops."""

    def __init__(self, prog: Program, graph, partition_outputs: set):
        self.prog = prog
        self.graph = graph
        self.partition_outputs = partition_outputs

    def shape(self, vid: int) -> tuple:
        return self.prog.values[vid].shape

    def const(self, vid: int):
        return self.prog.values[vid].const

    def host_ints(self, node, vid: int, what: str) -> tuple:
        c = self.const(vid)
        if c is None:
            raise PlanError(f"{node.op_type} node '{node.name}': {what} must be a constant for a compiled plan")
        return tuple(int(v) for v in np.asarray(c).reshape(-1))

    def set_shape(self, node, vid: int, shape: tuple) -> None:
        """Record an inferred output shape; a static shape the graph gave must agree with it."""
        shape = tuple(int(d) for d in shape)
        v = self.prog.values[vid]
        known = v.shape
        if known is not None and (len(known) != len(shape) or any(k not in (-1, s) for k, s in zip(known, shape))):
            raise PlanError(f"{node.op_type} node '{node.name}': output '{v.name}' has shape {shape}; "
                            f"the graph says {known}")
        v.shape = shape

    def emit(self, op_kind: str, node, inputs, outputs, **attrs) -> None:
        self.prog.ops.append(Op(op_kind, node.name, list(inputs), list(outputs), attrs))

    def temp(self, node, shape: tuple, suffix: str) -> int:
        return self.prog.new_value(f"{node.name}/{suffix}", shape)


def strides(shape: tuple) -> list:
    """Row-major element strides of `shape`."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def _bcast(node, *shapes) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise PlanError(f"{node.op_type} node '{node.name}': input shapes {list(shapes)} do not broadcast") from None


def _f32(x: float) -> str:
    """A float32 literal for CUDA C that reads back as exactly the same float32."""
    v = np.float32(x)
    if not np.isfinite(v):
        return f"__int_as_float(0x{int(v.view(np.uint32)):08x})"
    return repr(float(v)) + "f"


def _present(node, i: int) -> bool:
    return i < len(node.inputs) and node.inputs[i] >= 0


# ---------------------------------------------------------------------------------------------
# Elementwise


UNARY = {
    "Neg": "(-{0})",
    "Abs": "fabsf({0})",
    "Sqrt": "sqrtf({0})",
    "Exp": "expf({0})",
    "Log": "logf({0})",
    "Reciprocal": "(1.0f / {0})",
    "Tanh": "tanhf({0})",
    "Relu": "ep_relu({0})",
    "Sigmoid": "ep_sigmoid({0})",
    "Erf": "erff({0})",
}
BINARY = {
    "Add": "({0} + {1})",
    "Sub": "({0} - {1})",
    "Mul": "({0} * {1})",
    "Div": "({0} / {1})",
    "Pow": "powf({0}, {1})",
}
ACTIVATIONS = {"": None, "Relu": "ep_relu({0})", "Gelu": "ep_gelu({0})", "GeluTanh": "ep_gelu_tanh({0})"}


def _ew(ctx: _Ctx, node, inputs: list, out: int, expr: str) -> None:
    shape = _bcast(node, *(ctx.shape(i) for i in inputs))
    ctx.set_shape(node, out, shape)
    ctx.emit("ew", node, inputs, [out], expr=expr)


@lowers(*UNARY)
def _unary(ctx, node):
    _ew(ctx, node, [node.inputs[0]], node.outputs[0], UNARY[node.op_type])


@lowers(*BINARY)
def _binary(ctx, node):
    if node.opset < 7 and node.attrs.get("broadcast"):
        raise PlanError(f"{node.op_type} node '{node.name}': legacy broadcast attribute is not supported")
    _ew(ctx, node, list(node.inputs[:2]), node.outputs[0], BINARY[node.op_type])


@lowers("Max", "Min")
def _max_min(ctx, node):
    fn = "ep_max" if node.op_type == "Max" else "ep_min"
    xs = [i for i in node.inputs if i >= 0]
    if len(xs) == 1:
        _ew(ctx, node, xs, node.outputs[0], "{0}")
        return
    expr = "{0}"
    for k in range(1, len(xs)):
        expr = f"{fn}({expr}, {{{k}}})"
    _ew(ctx, node, xs, node.outputs[0], expr)


def _gelu_expr(approximate: str, node) -> str:
    if approximate not in ("none", "tanh"):
        raise PlanError(f"{node.op_type} node '{node.name}': approximate is {approximate!r}; allowed: 'none', 'tanh'")
    return "ep_gelu_tanh({0})" if approximate == "tanh" else "ep_gelu({0})"


@lowers("Gelu")
def _gelu(ctx, node):
    _ew(ctx, node, [node.inputs[0]], node.outputs[0], _gelu_expr(node.attrs.get("approximate", "none"), node))


@lowers("LeakyRelu")
def _leaky(ctx, node):
    a = _f32(node.attrs.get("alpha", 0.01))
    _ew(ctx, node, [node.inputs[0]], node.outputs[0], f"({{0}} >= 0.0f ? {{0}} : {{0}} * {a})")


@lowers("HardSigmoid")
def _hard_sigmoid(ctx, node):
    a, b = _f32(node.attrs.get("alpha", 0.2)), _f32(node.attrs.get("beta", 0.5))
    _ew(ctx, node, [node.inputs[0]], node.outputs[0], f"fminf(fmaxf({a} * {{0}} + {b}, 0.0f), 1.0f)")


@lowers("HardSwish")
def _hard_swish(ctx, node):
    _ew(ctx, node, [node.inputs[0]], node.outputs[0],
        "({0} * fminf(fmaxf(0.16666667f * {0} + 0.5f, 0.0f), 1.0f))")


@lowers("Clip")
def _clip(ctx, node):
    if node.opset < 11:
        lo, hi = node.attrs.get("min"), node.attrs.get("max")
    else:
        lo = hi = None
        for pos, what in ((1, "min"), (2, "max")):
            if _present(node, pos):
                c = ctx.const(node.inputs[pos])
                if c is None or np.asarray(c).size != 1:
                    raise PlanError(f"Clip node '{node.name}': {what} must be a scalar constant for a compiled plan")
                if pos == 1:
                    lo = float(np.asarray(c).reshape(-1)[0])
                else:
                    hi = float(np.asarray(c).reshape(-1)[0])
    expr = "{0}"
    if lo is not None:
        expr = f"ep_max({expr}, {_f32(lo)})"
    if hi is not None:
        expr = f"ep_min({expr}, {_f32(hi)})"
    _ew(ctx, node, [node.inputs[0]], node.outputs[0], expr)


@lowers("BiasGelu", domain=EPHOST_DOMAIN)
def _bias_gelu(ctx, node):
    x, b = node.inputs[0], node.inputs[1]
    shape = _bcast(node, ctx.shape(x), ctx.shape(b))
    t = ctx.temp(node, shape, "sum")
    _ew(ctx, node, [x, b], t, "({0} + {1})")
    _ew(ctx, node, [t], node.outputs[0], _gelu_expr(node.attrs.get("approximate", "none"), node))


# ---------------------------------------------------------------------------------------------
# GEMM


def matmul_shape(node, a: tuple, b: tuple) -> tuple:
    if not a or not b:
        raise PlanError(f"MatMul node '{node.name}': shapes {a} and {b}; allowed: rank 1 or more")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise PlanError(f"{node.op_type} node '{node.name}': shapes {a} and {b}; inner dimensions "
                        f"{a2[-1]} and {b2[-2]} must match")
    batch = _bcast(node, a2[:-2], b2[:-2])
    return batch + ((a2[-2],) if len(a) > 1 else ()) + ((b2[-1],) if len(b) > 1 else ())


@lowers("MatMul")
def _matmul(ctx, node):
    a, b = node.inputs[0], node.inputs[1]
    ctx.set_shape(node, node.outputs[0], matmul_shape(node, ctx.shape(a), ctx.shape(b)))
    ctx.emit("gemm", node, [a, b], [node.outputs[0]], trans_a=False, trans_b=False, alpha=1.0)


def _transposed_const(ctx, node, vid: int) -> int:
    """A constant 2-D B stored transposed once at build time, so the GEMM reads it row-major."""
    c = ctx.const(vid)
    return ctx.prog.const_value(f"{node.name}/B^T", np.ascontiguousarray(np.asarray(c, np.float32).T))


@lowers("Gemm")
def _gemm(ctx, node):
    a, b = node.inputs[0], node.inputs[1]
    trans_a = bool(node.attrs.get("transA", 0))
    trans_b = bool(node.attrs.get("transB", 0))
    alpha = float(node.attrs.get("alpha", 1.0))
    beta = float(node.attrs.get("beta", 1.0))
    sa, sb = ctx.shape(a), ctx.shape(b)
    if len(sa) != 2 or len(sb) != 2:
        raise PlanError(f"Gemm node '{node.name}': shapes {sa} and {sb}; allowed: two 2-D matrices")
    m, k = (sa[1], sa[0]) if trans_a else sa
    k2, n = (sb[1], sb[0]) if trans_b else sb
    if k != k2:
        raise PlanError(f"Gemm node '{node.name}': inner dimensions {k} and {k2} must match")
    if trans_b and ctx.const(b) is not None:
        b, trans_b = _transposed_const(ctx, node, b), False
    out = node.outputs[0]
    ctx.set_shape(node, out, (m, n))
    if _present(node, 2) and beta != 0.0:
        core = ctx.temp(node, (m, n), "AB")
        ctx.emit("gemm", node, [a, b], [core], trans_a=trans_a, trans_b=trans_b, alpha=alpha)
        c = node.inputs[2]
        expr = "({0} + {1})" if beta == 1.0 else f"({{0}} + {_f32(beta)} * {{1}})"
        _bcast(node, (m, n), ctx.shape(c))
        ctx.emit("ew", node, [core, c], [out], expr=expr)
    else:
        ctx.emit("gemm", node, [a, b], [out], trans_a=trans_a, trans_b=trans_b, alpha=alpha)


@lowers("FusedMatMul", domain=EPHOST_DOMAIN)
def _fused_matmul(ctx, node):
    act = node.attrs.get("activation", "")
    if act not in ACTIVATIONS:
        raise PlanError(f"FusedMatMul node '{node.name}': activation {act!r}; allowed: {sorted(ACTIVATIONS)}")
    a, b = node.inputs[0], node.inputs[1]
    shape = matmul_shape(node, ctx.shape(a), ctx.shape(b))
    out = node.outputs[0]
    ctx.set_shape(node, out, shape)
    stages = []
    if _present(node, 2):
        stages.append(("({0} + {1})", node.inputs[2]))
    if ACTIVATIONS[act]:
        stages.append((ACTIVATIONS[act], None))
    cur = ctx.temp(node, shape, "AB") if stages else out
    ctx.emit("gemm", node, [a, b], [cur], trans_a=False, trans_b=False, alpha=1.0)
    for i, (expr, extra) in enumerate(stages):
        dst = out if i == len(stages) - 1 else ctx.temp(node, shape, f"stage{i}")
        ins = [cur] if extra is None else [cur, extra]
        _bcast(node, *(ctx.shape(v) for v in ins))
        ctx.emit("ew", node, ins, [dst], expr=expr)
        cur = dst


# ---------------------------------------------------------------------------------------------
# Row kernels: softmax and normalisations


def _axis(node, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise PlanError(f"{node.op_type} node '{node.name}': axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


@lowers("Softmax", "LogSoftmax")
def _softmax(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    default = -1 if node.opset >= 13 else 1
    axis = _axis(node, int(node.attrs.get("axis", default)), max(len(shape), 1))
    if axis != len(shape) - 1:
        raise PlanError(f"{node.op_type} node '{node.name}': axis {axis} of rank {len(shape)}; "
                        "a compiled plan supports the last axis only")
    ctx.set_shape(node, node.outputs[0], shape)
    ctx.emit("softmax", node, [x], [node.outputs[0]], log=node.op_type == "LogSoftmax", cols=shape[-1])


def _norm(ctx, node, x: int, scale: int, bias: int | None, kind: str, default_eps: float) -> None:
    shape = ctx.shape(x)
    axis = _axis(node, int(node.attrs.get("axis", -1)), max(len(shape), 1))
    cols = int(math.prod(shape[axis:]))
    for vid, what in ((scale, "scale"), (bias, "bias")):
        if vid is not None and ctx.prog.values[vid].size != cols:
            raise PlanError(f"{node.op_type} node '{node.name}': {what} has shape {ctx.shape(vid)}; "
                            f"a compiled plan needs {cols} elements (the normalised shape {shape[axis:]})")
    if int(node.attrs.get("stash_type", 1)) != 1:
        raise PlanError(f"{node.op_type} node '{node.name}': stash_type {node.attrs.get('stash_type')}; allowed: 1")
    ctx.set_shape(node, node.outputs[0], shape)
    ins = [x, scale] + ([bias] if bias is not None else [])
    ctx.emit("norm", node, ins, [node.outputs[0]], kind=kind, eps=float(node.attrs.get("epsilon", default_eps)),
             cols=cols)


def _used_outputs(ctx, node) -> list:
    return [v for v in node.outputs[1:] if v >= 0]


@lowers("LayerNormalization")
def _layer_norm(ctx, node):
    if _used_outputs(ctx, node):
        raise PlanError(f"LayerNormalization node '{node.name}': Mean/InvStdDev outputs are not supported "
                        "in a compiled plan")
    _norm(ctx, node, node.inputs[0], node.inputs[1], node.inputs[2] if _present(node, 2) else None, "layer", 1e-5)


@lowers("RMSNormalization")
def _rms_norm(ctx, node):
    _norm(ctx, node, node.inputs[0], node.inputs[1], None, "rms", 1e-5)


@lowers("SkipLayerNormalization", domain=EPHOST_DOMAIN)
def _skip_layer_norm(ctx, node):
    x, skip = node.inputs[0], node.inputs[1]
    shape = _bcast(node, ctx.shape(x), ctx.shape(skip))
    extra = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] >= 0 else None
    total = extra if extra is not None else ctx.temp(node, shape, "sum")
    _ew(ctx, node, [x, skip], total, "({0} + {1})")
    _norm(ctx, node, total, node.inputs[2], node.inputs[3] if _present(node, 3) else None, "layer", 1e-12)


@lowers("Attention")
def _attention(ctx, node):
    """Attention-23 without past: scores = scale * Q K^T (cuBLAS, batched), a row softmax (causal
    when asked, plus the additive float attn_mask when given), Y = P V (cuBLAS). The GEMM layouts and
    the mask's broadcast strides come from the per-node kernel's attention_plan, so both paths read
    Q, K, V and the mask and write Y the same way."""
    try:
        from plugin_cuda.kernels.attention import attention_plan
    except ImportError as exc:
        raise PlanError(f"Attention node '{node.name}': the attention kernels are not available ({exc})") from None
    if any(_present(node, i) for i in range(4, len(node.inputs))):
        raise PlanError(f"Attention node '{node.name}': past_key/past_value inputs are not supported in a "
                        "compiled plan")
    if any(v >= 0 for v in node.outputs[1:]):
        raise PlanError(f"Attention node '{node.name}': only output Y is supported in a compiled plan")
    if float(node.attrs.get("softcap", 0.0) or 0.0) != 0.0:
        raise PlanError(f"Attention node '{node.name}': softcap is not supported in a compiled plan")
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if _present(node, 3) else None
    try:
        plan = attention_plan(ctx.shape(q), ctx.shape(k), ctx.shape(v), None if mask is None else ctx.shape(mask),
                              np.float32, node.attrs.get("q_num_heads"), node.attrs.get("kv_num_heads"),
                              bool(node.attrs.get("is_causal", 0)), node.attrs.get("scale"), 0.0, np.float32,
                              f"Attention node '{node.name}'")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    rows = plan.batch * plan.q_heads * plan.q_len
    scores = ctx.temp(node, (rows, plan.kv_len), "scores")
    probs = ctx.temp(node, (rows, plan.kv_len), "probs")
    ctx.set_shape(node, node.outputs[0], plan.out_shape)
    ctx.emit("bgemm", node, [k, q], [scores], gemm=plan.scores, alpha=plan.scale)
    masked = {} if mask is None else {"mask_strides": plan.mask_strides[:3], "mask_len": plan.mask_len,
                                      "heads": plan.q_heads}
    ctx.emit("softmax", node, [scores] + ([] if mask is None else [mask]), [probs], log=False, cols=plan.kv_len,
             causal=plan.causal, q_len=plan.q_len, **masked)
    ctx.emit("bgemm", node, [v, probs], [node.outputs[0]], gemm=plan.values, alpha=1.0)


# ---------------------------------------------------------------------------------------------
# Layout: Transpose and views


@lowers("Transpose")
def _transpose(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    perm = tuple(node.attrs.get("perm") or reversed(range(len(shape))))
    if sorted(perm) != list(range(len(shape))):
        raise PlanError(f"Transpose node '{node.name}': perm {perm} for rank {len(shape)}")
    out = node.outputs[0]
    ctx.set_shape(node, out, tuple(shape[p] for p in perm))
    if _moves_only_ones(shape, perm):
        _view(ctx, node, x, out)
    else:
        ctx.emit("transpose", node, [x], [out], perm=perm)


def _moves_only_ones(shape, perm) -> bool:
    """Whether the transpose keeps the order of the dimensions larger than 1 (then it is a view)."""
    big = [p for p in perm if shape[p] != 1]
    return big == sorted(big)


def _view(ctx, node, x: int, out: int) -> None:
    """A view; but a partition output needs its own bytes, so it gets a copy instead."""
    if out in ctx.partition_outputs:
        view = ctx.temp(node, ctx.shape(out), "view")
        ctx.emit("alias", node, [x], [view])
        ctx.emit("ew", node, [view], [out], expr="{0}")
    else:
        ctx.emit("alias", node, [x], [out])


def _reshape_shape(node, shape: tuple, target: tuple, allowzero: bool) -> tuple:
    out = []
    for i, d in enumerate(target):
        if d == 0 and not allowzero:
            if i >= len(shape):
                raise PlanError(f"Reshape node '{node.name}': 0 at position {i} but the input has rank {len(shape)}")
            out.append(shape[i])
        else:
            out.append(d)
    total = math.prod(shape)
    if out.count(-1) > 1:
        raise PlanError(f"Reshape node '{node.name}': shape {target} has more than one -1")
    if -1 in out:
        rest = math.prod(d for d in out if d != -1)
        if rest == 0 or total % rest:
            raise PlanError(f"Reshape node '{node.name}': cannot reshape {shape} to {target}")
        out[out.index(-1)] = total // rest
    if math.prod(out) != total:
        raise PlanError(f"Reshape node '{node.name}': cannot reshape {shape} to {target}")
    return tuple(out)


@lowers("Reshape")
def _reshape(ctx, node):
    x = node.inputs[0]
    target = ctx.host_ints(node, node.inputs[1], "the shape input")
    shape = _reshape_shape(node, ctx.shape(x), target, bool(node.attrs.get("allowzero", 0)))
    ctx.set_shape(node, node.outputs[0], shape)
    _view(ctx, node, x, node.outputs[0])


@lowers("Flatten")
def _flatten(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    axis = int(node.attrs.get("axis", 1))
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis <= len(shape):
        raise PlanError(f"Flatten node '{node.name}': axis {axis} for rank {len(shape)}")
    ctx.set_shape(node, node.outputs[0], (math.prod(shape[:axis]), math.prod(shape[axis:])))
    _view(ctx, node, x, node.outputs[0])


def _axes(ctx, node) -> tuple | None:
    if node.opset >= 13:
        return ctx.host_ints(node, node.inputs[1], "axes") if _present(node, 1) else None
    axes = node.attrs.get("axes")
    return None if axes is None else tuple(int(a) for a in axes)


@lowers("Squeeze")
def _squeeze(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    axes = _axes(ctx, node)
    if axes is None:
        out = tuple(d for d in shape if d != 1)
    else:
        norm = {_axis(node, a, len(shape)) for a in axes}
        if any(shape[a] != 1 for a in norm):
            raise PlanError(f"Squeeze node '{node.name}': axes {axes} of shape {shape} are not all 1")
        out = tuple(d for i, d in enumerate(shape) if i not in norm)
    ctx.set_shape(node, node.outputs[0], out)
    _view(ctx, node, x, node.outputs[0])


@lowers("Unsqueeze")
def _unsqueeze(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    axes = _axes(ctx, node)
    if axes is None:
        raise PlanError(f"Unsqueeze node '{node.name}': axes are missing")
    rank = len(shape) + len(axes)
    norm = sorted({_axis(node, a, rank) for a in axes})
    out = list(shape)
    for a in norm:
        out.insert(a, 1)
    ctx.set_shape(node, node.outputs[0], tuple(out))
    _view(ctx, node, x, node.outputs[0])


@lowers("Expand")
def _expand(ctx, node):
    x = node.inputs[0]
    target = ctx.host_ints(node, node.inputs[1], "the shape input")
    ctx.set_shape(node, node.outputs[0], _bcast(node, ctx.shape(x), target))
    ctx.emit("ew", node, [x], [node.outputs[0]], expr="{0}")


def _split_sizes(ctx, node, dim: int) -> list:
    """The chunk lengths of a Split: the split input (or attribute before opset 13), else
    num_outputs (opset 18: the last chunk may be shorter), else equal chunks per output."""
    if _present(node, 1):
        sizes = list(ctx.host_ints(node, node.inputs[1], "the split input"))
    elif node.attrs.get("split") is not None:
        sizes = [int(s) for s in node.attrs["split"]]
    else:
        n = int(node.attrs.get("num_outputs") or len(node.outputs))
        chunk = -(-dim // n) if node.attrs.get("num_outputs") else (dim // n if dim % n == 0 else -1)
        if chunk < 0:
            raise PlanError(f"Split node '{node.name}': {dim} elements do not split into {n} equal chunks")
        sizes = [min(chunk, max(dim - k * chunk, 0)) for k in range(n)]
    if len(sizes) != len(node.outputs) or sum(sizes) != dim or min(sizes, default=0) < 0:
        raise PlanError(f"Split node '{node.name}': chunks {sizes} for {len(node.outputs)} outputs of an axis of "
                        f"{dim}; they must be one per output and add up to {dim}")
    return sizes


@lowers("Split")
def _split(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    axis = _axis(node, int(node.attrs.get("axis", 0)), len(shape))
    in_strides = strides(shape)
    start = 0
    for out, size in zip(node.outputs, _split_sizes(ctx, node, shape[axis])):
        if out >= 0:
            ctx.set_shape(node, out, shape[:axis] + (size,) + shape[axis + 1:])
            ctx.emit("copy", node, [x], [out], offset=start * in_strides[axis], in_strides=in_strides)
        start += size


@lowers("Concat")
def _concat(ctx, node):
    xs = [v for v in node.inputs if v >= 0]
    shapes = [ctx.shape(v) for v in xs]
    rank = len(shapes[0])
    axis = _axis(node, int(node.attrs.get("axis", 0)), rank)
    for s in shapes:
        if len(s) != rank or s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:]:
            raise PlanError(f"Concat node '{node.name}': input shapes {shapes} differ off axis {axis}")
    out_shape = shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]
    out = node.outputs[0]
    ctx.set_shape(node, out, out_shape)
    out_strides = strides(out_shape)
    start = 0
    for v, s in zip(xs, shapes):
        if s[axis]:
            ctx.emit("place", node, [v], [out], offset=start * out_strides[axis], out_strides=out_strides)
        start += s[axis]


@lowers("RotaryEmbedding")
def _rotary(ctx, node):
    if _present(node, 3):
        raise PlanError(f"RotaryEmbedding node '{node.name}': position_ids are not supported in a compiled plan")
    x, cos, sin = node.inputs[:3]
    shape = ctx.shape(x)
    heads = int(node.attrs.get("num_heads", 0) or 0)
    if len(shape) == 4:
        batch, heads, seq, size = shape
    elif len(shape) == 3 and heads > 0 and shape[2] % heads == 0:
        batch, seq, size = shape[0], shape[1], shape[2] // heads
    else:
        raise PlanError(f"RotaryEmbedding node '{node.name}': input shape {shape} with num_heads {heads}; allowed: "
                        "4-D (batch, heads, seq, size), or 3-D with num_heads dividing the last dimension")
    rot = int(node.attrs.get("rotary_embedding_dim", 0) or 0) or size
    cache = ctx.shape(cos)
    if rot % 2 or rot > size or ctx.shape(sin) != cache or len(cache) != 3 or cache[0] not in (1, batch) \
            or cache[1:] != (seq, rot // 2):
        raise PlanError(f"RotaryEmbedding node '{node.name}': caches {cache} and {ctx.shape(sin)} for input {shape} "
                        f"and rotary dim {rot}; a compiled plan needs both ({batch} or 1, {seq}, {rot // 2})")
    ctx.set_shape(node, node.outputs[0], shape)
    ctx.emit("rotary", node, [x, cos, sin], [node.outputs[0]], heads=heads, seq=seq, size=size, rot=rot,
             seq_major=len(shape) == 3, interleaved=bool(node.attrs.get("interleaved", 0)),
             cache_batch=0 if cache[0] == 1 else seq * rot // 2)


def _window(node, size: tuple, kernel: tuple, ceil_mode: bool = False) -> tuple:
    """(out_sizes, strides, dilations, pads_begin, pads_end) of a 2-D windowed op, as the per-node
    kernels compute them (plugin_cuda/kernels/conv.py:output_geometry: auto_pad, ceil_mode)."""
    from plugin_cuda.kernels.conv import AUTO_PADS, output_geometry

    auto = node.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in AUTO_PADS:
        raise PlanError(f"{node.op_type} node '{node.name}': auto_pad {auto!r}; allowed: {', '.join(AUTO_PADS)}")
    strides = tuple(node.attrs.get("strides") or (1, 1))
    dil = tuple(node.attrs.get("dilations") or (1, 1))
    pads = tuple(node.attrs.get("pads") or (0, 0, 0, 0))
    if len(strides) != 2 or len(dil) != 2 or len(pads) != 4:
        raise PlanError(f"{node.op_type} node '{node.name}': strides {strides}, dilations {dil}, pads {pads}; "
                        "a compiled plan runs 2-D windows (2, 2 and 4 values)")
    try:
        out, begin, end = output_geometry(node.name, size, kernel, strides, dil, pads, auto, ceil_mode)
    except ValueError as exc:
        raise PlanError(f"{node.op_type} {exc}") from None
    return out, strides, dil, begin, end


# A convolution whose outputs alone give fewer threads than this is split over its input channels
# (partial sums, then one reduction kernel that also runs the epilogue): the deep layers of a
# batch-1 CNN have a few thousand outputs, each a sum of thousands of products.
CONV_THREADS_WANTED = 1 << 16
CONV_MIN_SLICE = 64  # products per thread and slice, at least


def conv_slices(outputs: int, channels: int, taps: int) -> int:
    """How many channel slices a convolution with `outputs` elements is split into (1: not split)."""
    slices = 1
    while (outputs * slices < CONV_THREADS_WANTED and slices * 2 <= channels
           and -(-channels // (slices * 2)) * taps >= CONV_MIN_SLICE):
        slices *= 2
    return slices


@lowers("Conv")
def _conv(ctx, node):
    x, w = node.inputs[:2]
    xs, ws = ctx.shape(x), ctx.shape(w)
    group = int(node.attrs.get("group", 1))
    if len(xs) != 4 or len(ws) != 4:
        raise PlanError(f"Conv node '{node.name}': input {xs} and weight {ws}; a compiled plan runs 2-D convolutions "
                        "(4-D input and weight)")
    if group < 1 or xs[1] % group or ws[0] % group or ws[1] * group != xs[1]:
        raise PlanError(f"Conv node '{node.name}': {xs[1]} input channels, weight {ws} and group {group} do not fit")
    out, strides_, dil, begin, _ = _window(node, xs[2:], tuple(ws[2:]))
    bias = node.inputs[2] if _present(node, 2) else None
    if bias is not None and ctx.prog.values[bias].size != ws[0]:
        raise PlanError(f"Conv node '{node.name}': bias has shape {ctx.shape(bias)}; expected ({ws[0]},)")
    out_shape = (xs[0], ws[0], out[0], out[1])
    ctx.set_shape(node, node.outputs[0], out_shape)
    geometry = dict(group=group, strides=strides_, dilations=dil, pads=tuple(begin))
    slices = conv_slices(math.prod(out_shape), ws[1], ws[2] * ws[3])
    extra = [bias] if bias is not None else []
    if slices == 1:
        ctx.emit("conv", node, [x, w] + extra, [node.outputs[0]], **geometry)
        return
    partial = ctx.temp(node, (slices,) + out_shape, "partial")
    ctx.emit("conv_partial", node, [x, w], [partial], slices=slices, **geometry)
    ctx.emit("slice_sum", node, [partial] + extra, [node.outputs[0]], slices=slices)


@lowers("MaxPool", "AveragePool")
def _pool(ctx, node):
    x = node.inputs[0]
    xs = ctx.shape(x)
    kernel = tuple(node.attrs.get("kernel_shape") or ())
    if len(xs) != 4 or len(kernel) != 2:
        raise PlanError(f"{node.op_type} node '{node.name}': input {xs}, kernel_shape {kernel}; a compiled plan "
                        "runs 2-D pools (4-D input)")
    if any(v >= 0 for v in node.outputs[1:]):
        raise PlanError(f"{node.op_type} node '{node.name}': the Indices output is not supported in a compiled plan")
    out, strides_, dil, begin, end = _window(node, xs[2:], kernel, bool(node.attrs.get("ceil_mode", 0)))
    ctx.set_shape(node, node.outputs[0], (xs[0], xs[1], out[0], out[1]))
    ctx.emit("pool", node, [x], [node.outputs[0]], kernel=kernel, strides=strides_, dilations=dil,
             pads=tuple(begin), pads_end=tuple(end), average=node.op_type == "AveragePool",
             include_pad=bool(node.attrs.get("count_include_pad", 0)))


def _mean(ctx, node, axes: list) -> None:
    shape = ctx.shape(node.inputs[0])
    axes = sorted({_axis(node, a, len(shape)) for a in axes})
    first = axes[0] if axes else len(shape)
    if axes != list(range(first, len(shape))):
        raise PlanError(f"{node.op_type} node '{node.name}': axes {axes} of rank {len(shape)}; a compiled plan "
                        "reduces trailing axes only")
    keep = bool(node.attrs.get("keepdims", 1))
    out = shape[:first] + ((1,) * (len(shape) - first) if keep else ())
    ctx.set_shape(node, node.outputs[0], out)
    ctx.emit("mean", node, [node.inputs[0]], [node.outputs[0]], inner=int(math.prod(shape[first:])))


@lowers("ReduceMean")
def _reduce_mean(ctx, node):
    if _present(node, 1):
        axes = list(ctx.host_ints(node, node.inputs[1], "the axes input"))
    else:
        axes = list(node.attrs.get("axes") or [])
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            ctx.set_shape(node, node.outputs[0], ctx.shape(node.inputs[0]))
            _view(ctx, node, node.inputs[0], node.outputs[0])
            return
        axes = list(range(len(ctx.shape(node.inputs[0]))))
    _mean(ctx, node, axes)


@lowers("GlobalAveragePool")
def _global_average_pool(ctx, node):
    _mean(ctx, node, list(range(2, len(ctx.shape(node.inputs[0])))))


@lowers("Identity")
def _identity(ctx, node):
    ctx.set_shape(node, node.outputs[0], ctx.shape(node.inputs[0]))
    _view(ctx, node, node.inputs[0], node.outputs[0])


# ---------------------------------------------------------------------------------------------
# Entry points


HOST_INPUTS = {("", "Reshape"): (1,), ("", "Squeeze"): (1,), ("", "Unsqueeze"): (1,), ("", "Clip"): (1, 2),
               ("", "Expand"): (1,), ("", "Split"): (1,), ("", "ReduceMean"): (1,)}


def _elem_type(v) -> int | None:
    t = getattr(v, "elem_type", None)
    return getattr(v, "dtype", None) if t is None else t


def node_supported(graph, node, need_static: bool = True) -> str:
    """'' when a plan can run `node` (op, opset, float32, static shapes); otherwise the reason.

    need_static: also ask for static shapes of every input (the planner infers the rest itself)."""
    key = (_domain(node), node.op_type)
    if key not in LOWERINGS:
        return f"no plan lowering for {key[0] or 'ai.onnx'}::{node.op_type}"
    if node.opset > MAX_OPSET:
        return f"opset {node.opset} is newer than {MAX_OPSET}"
    host = HOST_INPUTS.get(key, ())
    for pos, vid in enumerate(node.inputs):
        if vid < 0:
            continue
        v = graph.values[vid]
        if pos in host:
            if v.constant is None:
                return f"input {pos} must be a constant"
            continue
        if _elem_type(v) not in (FLOAT32, 0, None) or need_static and _elem_type(v) != FLOAT32:
            return f"input {pos} has element type {_elem_type(v)}; plans run float32"
        if need_static and (v.shape is None or any(d is None or d < 0 for d in v.shape)):
            return f"input {pos} has no static shape"
    for vid in node.outputs:
        if vid >= 0 and _elem_type(graph.values[vid]) not in (FLOAT32, 0, None):
            return f"an output has element type {_elem_type(graph.values[vid])}; plans run float32"
    return _lowering_error(graph, node) if need_static else ""


def _value(i: int, v) -> Value:
    const = None if v.constant is None else np.asarray(v.constant)
    if const is not None and const.dtype == np.float64:
        const = const.astype(np.float32)
    shape = None if v.shape is None else tuple(-1 if d is None else int(d) for d in v.shape)
    if const is not None:
        shape = tuple(const.shape)
    return Value(i, v.name, shape, const)


def _lowering_error(graph, node) -> str:
    """'' when the node's lowering rule accepts it alone (attributes, axes, shapes), else its
    PlanError: a claimed group then never fails to compile because of one of its nodes."""
    ids = [v for v in list(node.inputs) + list(node.outputs) if v >= 0]
    ctx = _Ctx(Program({i: _value(i, graph.values[i]) for i in ids}, [], [], []), graph, set())
    try:
        LOWERINGS[(_domain(node), node.op_type)](ctx, node)
    except PlanError as exc:
        return str(exc)
    return ""


def _ids_by_name(graph, specs, what: str) -> list:
    index = {v.name: i for i, v in enumerate(graph.values)}
    out = []
    for s in specs:
        name = s if isinstance(s, str) else s.name
        if name not in index:
            raise PlanError(f"partition {what} {name!r} is not a value of the graph")
        out.append(index[name])
    return out


def partition_io(graph, inputs=None, outputs=None) -> tuple[list, list]:
    """Input and output value ids: given (names or ValueSpecs), from the graph's own lists, or derived."""
    if inputs is None and getattr(graph, "input_ids", None):
        inputs = [graph.values[i] for i in graph.input_ids]
    if outputs is None and getattr(graph, "output_ids", None):
        outputs = [graph.values[i] for i in graph.output_ids]
    if inputs is None:
        inputs = getattr(graph, "inputs", None) or None  # an empty list: not given, derive them
    if outputs is None:
        outputs = getattr(graph, "outputs", None) or None
    produced = {v for n in graph.nodes for v in n.outputs if v >= 0}
    consumed = {v for n in graph.nodes for v in n.inputs if v >= 0}
    if inputs is not None:
        ins = _ids_by_name(graph, inputs, "input")
    else:
        ins, seen = [], set()
        for n in graph.nodes:
            for v in n.inputs:
                if v >= 0 and v not in produced and graph.values[v].constant is None and v not in seen:
                    seen.add(v)
                    ins.append(v)
    if outputs is not None:
        outs = _ids_by_name(graph, outputs, "output")
    else:
        outs = [v for n in graph.nodes for v in n.outputs
                if v >= 0 and (v not in consumed or graph.values[v].kind == 2)]
    return ins, outs


def topo_order(graph) -> list:
    """The graph's nodes in a dependency order (the given order when it already is one)."""
    producer = {v: n.index for n in graph.nodes for v in n.outputs if v >= 0}
    by_index = {n.index: n for n in graph.nodes}
    done, order = set(), []
    for start in graph.nodes:
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node.index in done:
                continue
            if expanded:
                done.add(node.index)
                order.append(node)
                continue
            stack.append((node, True))
            for v in node.inputs:
                p = producer.get(v)
                if p is not None and p not in done and p != node.index:
                    stack.append((by_index[p], False))
    return order


def lower(graph, inputs=None, outputs=None) -> Program:
    """The partition `graph` (a GraphSpec) as a Program; PlanError names the first node it cannot run."""
    ins, outs = partition_io(graph, inputs, outputs)
    values = {i: _value(i, v) for i, v in enumerate(graph.values)}
    for vid in ins:
        shape = values[vid].shape
        if shape is None or any(d < 0 for d in shape):
            raise PlanError(f"partition input '{values[vid].name}' has shape {shape}; a compiled plan needs "
                            "static shapes")
    prog = Program(values, [], ins, outs)
    ctx = _Ctx(prog, graph, set(outs))
    for node in topo_order(graph):
        reason = node_supported(graph, node, need_static=False)
        if reason:
            raise PlanError(f"node '{node.name}' ({node.op_type}) cannot run in a compiled plan: {reason}")
        for vid in node.inputs:
            if vid >= 0 and values[vid].shape is None and values[vid].const is None:
                raise PlanError(f"node '{node.name}': input '{values[vid].name}' has an unknown shape")
        LOWERINGS[(_domain(node), node.op_type)](ctx, node)
    for vid in outs:
        if vid in ins:
            raise PlanError(f"partition output '{values[vid].name}' is also a partition input; nothing computes it")
    return prog
