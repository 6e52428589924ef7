"""Turning fused nodes that no execution provider claims back into plain ONNX ops.

Fusion never makes a model unrunnable: after the EPs (and the CPU EP) have said what they run,
the session hands the names of unclaimed nodes to `expand_unclaimed`, which replaces each one
that has an entry in EXPANSIONS by the subgraph of simpler ops it stands for, then partitions
again. An expansion may itself produce fused ops (FusedMatMul with Gelu -> MatMul, Add, Gelu);
a second round expands those if they are still unclaimed.

Expansions cover the forms the optimizer emits; a node outside them (an Attention with past key /
value, say) raises ModelError naming what is not covered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import onnx
import onnx_ir as ir

from abi.gelu import GELU_TANH_COEFF, SQRT_2_OVER_PI
from host.errors import InvalidArgument, ModelError
from host.optimizer.opset import onnx_opset
from host.optimizer.rules.base import EPHOST_DOMAIN

Expansion = Callable[["_Builder", ir.Node], list]
EXPANSIONS: dict[tuple[str, str], Expansion] = {}


def expansion(domain: str, op_type: str):
    """Decorator: register the expansion of (domain, op_type)."""

    def deco(fn: Expansion) -> Expansion:
        EXPANSIONS[(domain, op_type)] = fn
        return fn

    return deco


def can_expand(domain: str, op_type: str) -> bool:
    """Whether nodes of this op have an expansion."""
    return ("" if domain == "ai.onnx" else domain, op_type) in EXPANSIONS


class _Builder:
    """A Tape plus the model's opset, with helpers for the few ops whose form depends on the opset."""

    def __init__(self, opset: int, prefix: str):
        self.tape = ir.tape.Tape()
        self.opset = opset
        self.prefix = prefix
        self._count = 0

    def op(self, op_type: str, *inputs, **attrs):
        self._count += 1
        return self.tape.op(op_type, list(inputs), attrs or None, name=f"{self.prefix}/{op_type}_{self._count}")

    def const(self, value, dtype=None):
        arr = np.asarray(value, dtype=dtype)
        return self.op("Constant", value=ir.tensor(arr))

    def scalar_like(self, value: float, like: ir.Value):
        """A scalar constant of `like`'s float type."""
        return self.const(np.array(value, dtype=_np_dtype(like)))

    def reduce_mean_last(self, x):
        if self.opset >= 18:
            return self.op("ReduceMean", x, self.const([-1], np.int64), keepdims=1)
        return self.op("ReduceMean", x, axes=[-1], keepdims=1)

    def gelu(self, x, approximate: str):
        if self.opset >= 20:
            return self.op("Gelu", x, approximate=approximate)
        half, one = self.scalar_like(0.5, x), self.scalar_like(1.0, x)
        if approximate == "tanh":
            cube = self.op("Mul", x, self.op("Mul", x, x))
            inner = self.op("Add", x, self.op("Mul", cube, self.scalar_like(GELU_TANH_COEFF, x)))
            term = self.op("Tanh", self.op("Mul", inner, self.scalar_like(SQRT_2_OVER_PI, x)))
        else:
            term = self.op("Erf", self.op("Div", x, self.scalar_like(math.sqrt(2.0), x)))
        return self.op("Mul", self.op("Mul", x, half), self.op("Add", term, one))


def _np_dtype(value: ir.Value) -> np.dtype:
    if value.dtype is None:
        return np.dtype(np.float32)
    return value.dtype.numpy()


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _input(node: ir.Node, i: int):
    return node.inputs[i] if i < len(node.inputs) else None


def _unsupported(node: ir.Node, what: str) -> ModelError:
    return ModelError(f"node '{node.name}' ({node.op_type}): no EP runs it and its expansion does not cover {what}")


# ---- ai.ephost --------------------------------------------------------------------------------
_ACTIVATIONS = {"": None, "Relu": "relu", "Gelu": "none", "GeluTanh": "tanh"}


@expansion(EPHOST_DOMAIN, "FusedMatMul")
def _fused_matmul(b: _Builder, node: ir.Node) -> list:
    act = _attr(node, "activation", "")
    if act not in _ACTIVATIONS:
        raise _unsupported(node, f"activation {act!r} (allowed: {sorted(_ACTIVATIONS)})")
    y = b.op("MatMul", node.inputs[0], node.inputs[1])
    bias = _input(node, 2)
    if bias is not None:
        y = b.op("Add", y, bias)
    if act == "Relu":
        y = b.op("Relu", y)
    elif act:
        y = b.gelu(y, _ACTIVATIONS[act])
    return [y]


@expansion(EPHOST_DOMAIN, "BiasGelu")
def _bias_gelu(b: _Builder, node: ir.Node) -> list:
    return [b.gelu(b.op("Add", node.inputs[0], node.inputs[1]), _attr(node, "approximate", "none"))]


@expansion(EPHOST_DOMAIN, "SkipLayerNormalization")
def _skip_layer_norm(b: _Builder, node: ir.Node) -> list:
    total = b.op("Add", node.inputs[0], node.inputs[1])
    args = [total, node.inputs[2]] + ([node.inputs[3]] if _input(node, 3) is not None else [])
    y = b.op("LayerNormalization", *args, axis=_attr(node, "axis", -1), epsilon=_attr(node, "epsilon", 1e-5))
    return [y, total][: len(node.outputs)]


# ---- standard ops the optimizer emits -----------------------------------------------------------
@expansion("", "Gelu")
def _gelu(b: _Builder, node: ir.Node) -> list:
    b.opset = min(b.opset, 19)  # the arithmetic, never Gelu itself
    return [b.gelu(node.inputs[0], _attr(node, "approximate", "none"))]


def _check_last_axis(node: ir.Node) -> None:
    axis = _attr(node, "axis", -1)
    x = node.inputs[0]
    if axis != -1 and not (x.shape is not None and axis == x.shape.rank() - 1):
        raise _unsupported(node, f"axis={axis} (only the last axis)")


@expansion("", "LayerNormalization")
def _layer_norm(b: _Builder, node: ir.Node) -> list:
    _check_last_axis(node)
    x = node.inputs[0]
    if any(o.uses() for o in node.outputs[1:]):
        raise _unsupported(node, "the Mean / InvStdDev outputs")
    dev = b.op("Sub", x, b.reduce_mean_last(x))
    var = b.reduce_mean_last(b.op("Mul", dev, dev))
    std = b.op("Sqrt", b.op("Add", var, b.scalar_like(_attr(node, "epsilon", 1e-5), x)))
    y = b.op("Mul", b.op("Div", dev, std), node.inputs[1])
    if _input(node, 2) is not None:
        y = b.op("Add", y, node.inputs[2])
    return [y] + [None] * (len(node.outputs) - 1)


@expansion("", "RMSNormalization")
def _rms_norm(b: _Builder, node: ir.Node) -> list:
    _check_last_axis(node)
    x = node.inputs[0]
    mean_sq = b.reduce_mean_last(b.op("Mul", x, x))
    rms = b.op("Sqrt", b.op("Add", mean_sq, b.scalar_like(_attr(node, "epsilon", 1e-5), x)))
    return [b.op("Mul", b.op("Div", x, rms), node.inputs[1])]


@expansion("", "HardSigmoid")
def _hard_sigmoid(b: _Builder, node: ir.Node) -> list:
    x = node.inputs[0]
    return [_clip01(b, x, _attr(node, "alpha", 0.2), _attr(node, "beta", 0.5))]


@expansion("", "HardSwish")
def _hard_swish(b: _Builder, node: ir.Node) -> list:
    x = node.inputs[0]
    return [b.op("Mul", x, _clip01(b, x, 1.0 / 6.0, 0.5))]


def _clip01(b: _Builder, x, alpha: float, beta: float):
    y = b.op("Add", b.op("Mul", x, b.scalar_like(alpha, x)), b.scalar_like(beta, x))
    return b.op("Max", b.op("Min", y, b.scalar_like(1.0, x)), b.scalar_like(0.0, x))


@expansion("", "Gemm")
def _gemm(b: _Builder, node: ir.Node) -> list:
    a, w = node.inputs[0], node.inputs[1]
    if _attr(node, "transA", 0):
        a = b.op("Transpose", a, perm=[1, 0])
    if _attr(node, "transB", 0):
        w = b.op("Transpose", w, perm=[1, 0])
    y = b.op("MatMul", a, w)
    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    if alpha != 1.0:
        y = b.op("Mul", y, b.scalar_like(alpha, node.inputs[0]))
    c = _input(node, 2)
    if c is not None:
        y = b.op("Add", y, c if beta == 1.0 else b.op("Mul", c, b.scalar_like(beta, node.inputs[0])))
    return [y]


@expansion("", "Attention")
def _attention(b: _Builder, node: ir.Node) -> list:
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    mask = _input(node, 3)
    if len([x for x in node.inputs[4:] if x is not None]) or any(o.uses() for o in node.outputs[1:]):
        raise _unsupported(node, "past key / value or the extra outputs")
    # Attention-25's sliding windows (left/right_window_size) are not expanded either.
    for name, default in (("is_causal", 0), ("softcap", 0.0), ("qk_matmul_output_mode", 0),
                          ("left_window_size", -1), ("right_window_size", -1)):
        if _attr(node, name, default) != default:
            raise _unsupported(node, f"{name}={_attr(node, name, default)}")
    if mask is not None and mask.dtype == ir.DataType.BOOL:
        raise _unsupported(node, "a boolean mask")
    three_d = q.shape is not None and q.shape.rank() == 3
    if three_d:
        hq, hkv = _attr(node, "q_num_heads", 0), _attr(node, "kv_num_heads", 0)
        if not hq or hq != hkv:
            raise _unsupported(node, f"q_num_heads={hq}, kv_num_heads={hkv} (equal head counts only)")
        q, k, v = (b.op("Transpose", b.op("Reshape", x, b.const([0, 0, hq, -1], np.int64)), perm=[0, 2, 1, 3])
                   for x in (q, k, v))
    scale = _attr(node, "scale", None)
    if scale is None:
        head = node.inputs[0].shape[-1] if node.inputs[0].shape is not None else None
        if three_d and isinstance(head, int):
            head //= _attr(node, "q_num_heads", 1)
        if not isinstance(head, int):
            raise _unsupported(node, "an unknown head size without a scale attribute")
        scale = 1.0 / math.sqrt(head)
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))
    scores = b.op("Mul", scores, b.scalar_like(scale, node.inputs[0]))
    if mask is not None:
        scores = b.op("Add", scores, mask)
    y = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
    if three_d:
        y = b.op("Reshape", b.op("Transpose", y, perm=[0, 2, 1, 3]), b.const([0, 0, -1], np.int64))
    return [y] + [None] * (len(node.outputs) - 1)


@expansion("", "RotaryEmbedding")
def _rotary(b: _Builder, node: ir.Node) -> list:
    x, cos, sin = node.inputs[0], node.inputs[1], node.inputs[2]
    if _input(node, 3) is not None or _attr(node, "interleaved", 0) or _attr(node, "rotary_embedding_dim", 0):
        raise _unsupported(node, "position_ids, interleaved or a partial rotary_embedding_dim")
    head = x.shape[-1] if x.shape is not None and x.shape.rank() == 4 else None
    if not isinstance(head, int):
        raise _unsupported(node, "an input that is not 4-D with a known head size")
    half = head // 2
    axes3 = b.const([3], np.int64)
    x1 = b.op("Slice", x, b.const([0], np.int64), b.const([half], np.int64), axes3)
    x2 = b.op("Slice", x, b.const([half], np.int64), b.const([head], np.int64), axes3)
    c = b.op("Unsqueeze", cos, b.const([1], np.int64))
    s = b.op("Unsqueeze", sin, b.const([1], np.int64))
    first = b.op("Sub", b.op("Mul", x1, c), b.op("Mul", x2, s))
    second = b.op("Add", b.op("Mul", x2, c), b.op("Mul", x1, s))
    return [b.op("Concat", first, second, axis=-1)]


# ---- the hook ---------------------------------------------------------------------------------
def _node_key(node: ir.Node, index: int) -> str:
    # The session names unnamed nodes "<op_type>_<index in the graph>" (host/runtime/model.py).
    return node.name or f"{node.op_type}_{index}"


def expand_unclaimed(model: onnx.ModelProto, node_names: Iterable[str]) -> onnx.ModelProto:
    """`model` with each named node that has an expansion replaced by its unfused subgraph.

    Names without an expansion (or not in the model) are left alone; the caller decides whether
    what remains unclaimed is an error.
    """
    if not isinstance(model, onnx.ModelProto):
        raise InvalidArgument(f"expand_unclaimed() takes an onnx.ModelProto; got {type(model).__name__}")
    wanted = set(node_names)
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    targets = [n for i, n in enumerate(graph) if _node_key(n, i) in wanted and can_expand(n.domain, n.op_type)]
    opset = onnx_opset(ir_model)
    for node in targets:
        _expand(graph, node, opset)
    from host.optimizer.pipeline import unique_node_names  # here: pipeline imports the rule modules

    unique_node_names(graph)
    return ir.serde.serialize_model(ir_model)


def _expand(graph: ir.Graph, node: ir.Node, opset: int) -> None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    b = _Builder(opset, node.name or node.op_type)
    outputs = EXPANSIONS[(domain, node.op_type)](b, node)
    old = [o for o, new in zip(node.outputs, outputs) if new is not None]
    new = [n for n in outputs if n is not None]
    if any(o.uses() or o.is_graph_output() for o, n in zip(node.outputs, outputs) if n is None):
        raise _unsupported(node, "an output that is used")
    ir.convenience.replace_nodes_and_values(graph, node, [node], b.tape.nodes, old, new)


# The QDQ fusion's integer kernels: registered on import (the module needs the names above).
from host.optimizer import fallback_qdq  # noqa: E402, F401
