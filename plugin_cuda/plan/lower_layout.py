"""Lowering rules of layout ops: Transpose, the views (Reshape, Flatten, Squeeze, Unsqueeze,
Identity), Expand, Split and Concat."""

from __future__ import annotations

from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.lowering import (
    attributes,
    broadcast,
    lowers,
    mask_only_expand,
    norm_axis,
    present,
    view,
    where,
)
from plugin_cuda.plan.program import strides
from plugin_cuda.semantics import shapes

# ---------------------------------------------------------------------------------------------
# Layout: Transpose and views


@lowers("Transpose")
def _transpose(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    perm = shapes.transpose_perm(attributes(node).integers("perm"), len(shape), where(node))
    out = node.outputs[0]
    ctx.set_shape(node, out, tuple(shape[p] for p in perm))
    if _moves_only_ones(shape, perm):
        view(ctx, node, x, out)
    else:
        ctx.emit("transpose", node, [x], [out], perm=perm)


def _moves_only_ones(shape, perm) -> bool:
    """Whether the transpose keeps the order of the dimensions larger than 1 (then it is a view)."""
    big = [p for p in perm if shape[p] != 1]
    return big == sorted(big)


@lowers("Reshape")
def _reshape(ctx, node):
    x = node.inputs[0]
    target = ctx.host_ints(node, node.inputs[1], "the shape input")
    allowzero = attributes(node).flag("allowzero") if node.opset >= 14 else False
    shape = shapes.reshape_shape(ctx.shape(x), target, allowzero, where(node))
    ctx.set_shape(node, node.outputs[0], shape)
    view(ctx, node, x, node.outputs[0])


@lowers("Flatten")
def _flatten(ctx, node):
    x = node.inputs[0]
    shape = ctx.shape(x)
    out_shape = shapes.flatten_shape(shape, attributes(node).integer("axis", 1), where(node))
    ctx.set_shape(node, node.outputs[0], out_shape)
    view(ctx, node, x, node.outputs[0])


def _axes(ctx, node) -> tuple | None:
    if node.opset >= 13:
        return ctx.host_ints(node, node.inputs[1], "axes") if present(node, 1) else None
    return attributes(node).integers("axes")


_AXES_RULES = {"Squeeze": shapes.squeeze_shape, "Unsqueeze": shapes.unsqueeze_shape}


@lowers(*_AXES_RULES)
def _squeeze_unsqueeze(ctx, node):
    x = node.inputs[0]
    out_shape = _AXES_RULES[node.op_type](ctx.shape(x), _axes(ctx, node), where(node))
    ctx.set_shape(node, node.outputs[0], out_shape)
    view(ctx, node, x, node.outputs[0])


@lowers("Expand")
def _expand(ctx, node):
    x = node.inputs[0]
    if ctx.const(node.inputs[1]) is None and mask_only_expand(ctx.graph, node):
        # Read unexpanded by the Attention after it, which broadcasts its mask (lower.mask_only_expand);
        # the value takes the mask's own shape (set directly: the graph's shape is the expanded one).
        ctx.prog.values[node.outputs[0]].shape = ctx.shape(x)
        ctx.emit("alias", node, [x], [node.outputs[0]])
        return
    target = ctx.host_ints(node, node.inputs[1], "the shape input")
    ctx.set_shape(node, node.outputs[0], broadcast(node, ctx.shape(x), target))
    ctx.emit("ew", node, [x], [node.outputs[0]], expr="{0}")


def _split_sizes(ctx, node, dim: int) -> list:
    """The chunk lengths of a Split: the split input (or attribute before opset 13), else
    num_outputs (opset 18: the last chunk may be shorter), else equal chunks per output."""
    attrs = attributes(node)
    if present(node, 1):
        sizes = list(ctx.host_ints(node, node.inputs[1], "the split input"))
    elif attrs.integers("split") is not None:
        sizes = list(attrs.integers("split"))
    else:
        num_outputs = attrs.integer("num_outputs")
        n = num_outputs or len(node.outputs)
        chunk = -(-dim // n) if num_outputs else (dim // n if dim % n == 0 else -1)
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
    axis = norm_axis(node, attributes(node).integer("axis", 0), len(shape))
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
    in_shapes = [ctx.shape(v) for v in xs]
    attrs = attributes(node)
    axis = attrs.integer("axis")
    if axis is None:
        raise attrs.bad("axis", None, "an integer (the attribute is required)")
    axis, out_shape = shapes.concat_shape(in_shapes, axis, where(node))
    out = node.outputs[0]
    ctx.set_shape(node, out, out_shape)
    out_strides = strides(out_shape)
    start = 0
    for v, s in zip(xs, in_shapes):
        if s[axis]:
            ctx.emit("place", node, [v], [out], offset=start * out_strides[axis], out_strides=out_strides)
        start += s[axis]


@lowers("Identity")
def _identity(ctx, node):
    ctx.set_shape(node, node.outputs[0], ctx.shape(node.inputs[0]))
    view(ctx, node, node.inputs[0], node.outputs[0])


