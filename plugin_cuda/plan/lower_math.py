"""Lowering rules of elementwise ops and GEMMs (MatMul, Gemm, ai.ephost FusedMatMul)."""

from __future__ import annotations

import numpy as np

from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.lowering import EPHOST_DOMAIN, attributes, broadcast, ew, lowers, present
from plugin_cuda.plan.program import F32, ROUNDINGS, f32_literal, plan_dtype
from plugin_cuda.semantics import shapes

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
    # full-range reduction (no fast math): a rotary table's angles reach thousands of radians
    "Cos": "cosf({0})",
    "Sin": "sinf({0})",
}
BINARY = {
    "Add": "({0} + {1})",
    "Sub": "({0} - {1})",
    "Mul": "({0} * {1})",
    "Div": "({0} / {1})",
    "Pow": "powf({0}, {1})",
}
ACTIVATIONS = {"": None, "Relu": "ep_relu({0})", "Gelu": "ep_gelu({0})", "GeluTanh": "ep_gelu_tanh({0})"}


@lowers(*UNARY)
def _unary(ctx, node):
    ew(ctx, node, [node.inputs[0]], node.outputs[0], UNARY[node.op_type])


@lowers(*BINARY)
def _binary(ctx, node):
    if node.opset < 7 and node.attrs.get("broadcast"):
        raise PlanError(f"{node.op_type} node '{node.name}': legacy broadcast attribute is not supported")
    ew(ctx, node, list(node.inputs[:2]), node.outputs[0], BINARY[node.op_type])


@lowers("Max", "Min")
def _max_min(ctx, node):
    fn = "ep_max" if node.op_type == "Max" else "ep_min"
    xs = [i for i in node.inputs if i >= 0]
    if len(xs) == 1:
        ew(ctx, node, xs, node.outputs[0], "{0}")
        return
    expr = "{0}"
    for k in range(1, len(xs)):
        expr = f"{fn}({expr}, {{{k}}})"
    ew(ctx, node, xs, node.outputs[0], expr)


def _gelu_expr(node) -> str:
    """ep_gelu / ep_gelu_tanh: plugin_cuda.semantics.GELU_CUDA, in the plan's prelude."""
    approximate = attributes(node).string("approximate", "none", ("none", "tanh"))
    return "ep_gelu_tanh({0})" if approximate == "tanh" else "ep_gelu({0})"


@lowers("Gelu")
def _gelu(ctx, node):
    ew(ctx, node, [node.inputs[0]], node.outputs[0], _gelu_expr(node))


@lowers("LeakyRelu")
def _leaky(ctx, node):
    a = f32_literal(attributes(node).number("alpha", 0.01))
    ew(ctx, node, [node.inputs[0]], node.outputs[0], f"({{0}} >= 0.0f ? {{0}} : {{0}} * {a})")


@lowers("HardSigmoid")
def _hard_sigmoid(ctx, node):
    attrs = attributes(node)
    a, b = f32_literal(attrs.number("alpha", 0.2)), f32_literal(attrs.number("beta", 0.5))
    ew(ctx, node, [node.inputs[0]], node.outputs[0], f"fminf(fmaxf({a} * {{0}} + {b}, 0.0f), 1.0f)")


@lowers("HardSwish")
def _hard_swish(ctx, node):
    ew(ctx, node, [node.inputs[0]], node.outputs[0],
        "({0} * fminf(fmaxf(0.16666667f * {0} + 0.5f, 0.0f), 1.0f))")


@lowers("Clip")
def _clip(ctx, node):
    if node.opset < 11:
        lo, hi = attributes(node).number("min"), attributes(node).number("max")
    else:
        lo = hi = None
        for pos, what in ((1, "min"), (2, "max")):
            if present(node, pos):
                c = ctx.const(node.inputs[pos])
                if c is None or np.asarray(c).size != 1:
                    raise PlanError(f"Clip node '{node.name}': {what} must be a scalar constant for a compiled plan")
                if pos == 1:
                    lo = float(np.asarray(c).reshape(-1)[0])
                else:
                    hi = float(np.asarray(c).reshape(-1)[0])
    expr = "{0}"
    if lo is not None:
        expr = f"ep_max({expr}, {f32_literal(lo)})"
    if hi is not None:
        expr = f"ep_min({expr}, {f32_literal(hi)})"
    ew(ctx, node, [node.inputs[0]], node.outputs[0], expr)


# Cast between the plan's float types: the value rounded to its own type, then to the target type.
# With EPHOST_PLAN_ROUND=0 kernels keep a fused group's intermediates in float32, so without these
# roundings a half value cast to float32 (or a float32 one cast to half, then read in the same kernel)
# would keep float32 precision; a rounding repeated (codegen's, a store into a 16-bit buffer) changes
# nothing.


@lowers("Cast")
def _cast(ctx, node):
    to = attributes(node).integer("to")
    dtype = plan_dtype(to)
    if dtype is None:
        raise PlanError(f"Cast node '{node.name}': to {to}; a compiled plan casts to float32 (1), float16 (10) "
                        "or bfloat16 (16)")
    ctx.prog.values[node.outputs[0]].dtype = dtype
    source = ctx.dtype(node.inputs[0])
    expr = ROUNDINGS[dtype] if source in (dtype, F32) else ROUNDINGS[dtype].format(ROUNDINGS[source])
    ew(ctx, node, [node.inputs[0]], node.outputs[0], expr)


@lowers("BatchNormalization")
def _batch_norm(ctx, node):
    """Inference BatchNormalization with constant statistics: y = x * a + b per channel, with
    a = scale / sqrt(var + eps) and b = bias - mean * a folded at build time (float32 constants,
    so a half model keeps their precision). Left to the optimizer's Conv folding where it applies;
    this runs the ones it cannot fold (a Cast between the Conv and the BatchNormalization)."""
    attrs = attributes(node)
    if attrs.flag("training_mode") or any(v >= 0 for v in node.outputs[1:]):
        raise PlanError(f"BatchNormalization node '{node.name}': training mode is not supported in a compiled plan")
    x = node.inputs[0]
    shape = ctx.shape(x)
    params = [ctx.const(v) for v in node.inputs[1:5]]
    if len(shape) < 2 or any(p is None or np.asarray(p).size != shape[1] for p in params):
        raise PlanError(f"BatchNormalization node '{node.name}': scale, bias, mean and var must be constants of "
                        f"{shape[1] if len(shape) > 1 else '?'} values (the channels of input {shape})")
    scale, bias, mean, var = (np.asarray(p, np.float64).reshape(-1) for p in params)
    a = scale / np.sqrt(var + attrs.number("epsilon", 1e-5))
    channel = (shape[1],) + (1,) * (len(shape) - 2)
    va = ctx.prog.const_value(f"{node.name}/a", (a.astype(np.float32)).reshape(channel))
    vb = ctx.prog.const_value(f"{node.name}/b", (bias - mean * a).astype(np.float32).reshape(channel))
    ew(ctx, node, [x, va, vb], node.outputs[0], "({0} * {1} + {2})")


@lowers("BiasGelu", domain=EPHOST_DOMAIN)
def _bias_gelu(ctx, node):
    x, b = node.inputs[0], node.inputs[1]
    shape = broadcast(node, ctx.shape(x), ctx.shape(b))
    t = ctx.temp(node, shape, "sum")
    ew(ctx, node, [x, b], t, "({0} + {1})")
    ew(ctx, node, [t], node.outputs[0], _gelu_expr(node))


# ---------------------------------------------------------------------------------------------
# GEMM


@lowers("MatMul")
def _matmul(ctx, node):
    a, b = node.inputs[0], node.inputs[1]
    ctx.set_shape(node, node.outputs[0], shapes.matmul_shape(ctx.shape(a), ctx.shape(b)))
    ctx.emit("gemm", node, [a, b], [node.outputs[0]], trans_a=False, trans_b=False, alpha=1.0)


def _transposed_const(ctx, node, vid: int) -> int:
    """A constant 2-D B stored transposed once at build time, so the GEMM reads it row-major."""
    c = np.asarray(ctx.const(vid))
    if c.dtype == np.float64:
        c = c.astype(np.float32)
    return ctx.prog.const_value(f"{node.name}/B^T", np.ascontiguousarray(c.T))


@lowers("Gemm")
def _gemm(ctx, node):
    a, b = node.inputs[0], node.inputs[1]
    attrs = attributes(node)
    trans_a, trans_b = attrs.flag("transA"), attrs.flag("transB")
    alpha, beta = attrs.number("alpha", 1.0), attrs.number("beta", 1.0)
    m, n = shapes.gemm_shape(ctx.shape(a), ctx.shape(b), trans_a, trans_b)
    if trans_b and ctx.const(b) is not None:
        b, trans_b = _transposed_const(ctx, node, b), False
    out = node.outputs[0]
    ctx.set_shape(node, out, (m, n))
    if present(node, 2) and beta != 0.0:
        core = ctx.temp(node, (m, n), "AB")
        ctx.emit("gemm", node, [a, b], [core], trans_a=trans_a, trans_b=trans_b, alpha=alpha)
        c = node.inputs[2]
        expr = "({0} + {1})" if beta == 1.0 else f"({{0}} + {f32_literal(beta)} * {{1}})"
        broadcast(node, (m, n), ctx.shape(c))
        ctx.emit("ew", node, [core, c], [out], expr=expr)
    else:
        ctx.emit("gemm", node, [a, b], [out], trans_a=trans_a, trans_b=trans_b, alpha=alpha)


@lowers("FusedMatMul", domain=EPHOST_DOMAIN)
def _fused_matmul(ctx, node):
    act = attributes(node).string("activation", "", tuple(ACTIVATIONS))
    a, b = node.inputs[0], node.inputs[1]
    shape = shapes.matmul_shape(ctx.shape(a), ctx.shape(b))
    out = node.outputs[0]
    ctx.set_shape(node, out, shape)
    stages = []
    if present(node, 2):
        stages.append(("({0} + {1})", node.inputs[2]))
    if ACTIVATIONS[act]:
        stages.append((ACTIVATIONS[act], None))
    cur = ctx.temp(node, shape, "AB") if stages else out
    ctx.emit("gemm", node, [a, b], [cur], trans_a=False, trans_b=False, alpha=1.0)
    for i, (expr, extra) in enumerate(stages):
        dst = out if i == len(stages) - 1 else ctx.temp(node, shape, f"stage{i}")
        ins = [cur] if extra is None else [cur, extra]
        broadcast(node, *(ctx.shape(v) for v in ins))
        ctx.emit("ew", node, ins, [dst], expr=expr)
        cur = dst

