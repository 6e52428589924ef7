"""Small model builders (onnx.helper only) for tests, benchmarks and the CLI.

Every builder is deterministic from `seed`, returns an `onnx.ModelProto` at `opset` (17 by default)
and names every node, so `InferenceSession.node_assignment()` reads well. Weights are scaled by
1/sqrt(fan_in) so activations stay O(1) however deep the model is.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from host.errors import InvalidArgument

DEFAULT_OPSET = 17


class _Builder:
    """Collects nodes and initializers; `model()` wraps them in a checked ModelProto."""

    def __init__(self, seed: int, dtype=np.float32):
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count: dict[str, int] = {}

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape: tuple, fan_in: int) -> str:
        w = self.rng.standard_normal(shape) / math.sqrt(fan_in)
        return self.const(name, w.astype(self.dtype))

    def bias(self, name: str, size: int) -> str:
        return self.const(name, (0.1 * self.rng.standard_normal(size)).astype(self.dtype))

    def scalar(self, name: str, value: float) -> str:
        return self.const(name, np.array(value, self.dtype))

    def node(self, op: str, inputs: list[str], name: str, out: str | None = None, **attrs) -> str:
        """Adds one node with one output (named after the node unless `out`); returns that output."""
        out = out or name
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def model(self, graph_name: str, inputs, outputs, opset: int) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, inputs, outputs, self.inits)
        ops = [helper.make_opsetid("", opset)]
        # The lowest IR version the opset needs, so older runtimes (onnxruntime) load the model too.
        model = helper.make_model(graph, opset_imports=ops, producer_name="ephost.zoo",
                                  ir_version=helper.find_min_ir_version_for(ops))
        onnx.checker.check_model(model)
        return model


def _elem_type(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _batch_dim(batch: int, dynamic_batch: bool):
    return "batch" if dynamic_batch else batch


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidArgument(f"{name} must be a positive integer; got {value!r}")


def mlp(layers: int = 8, hidden: int = 256, batch: int = 1, in_features: int | None = None,
        dtype=np.float32, seed: int = 0, use_gemm: bool = False, opset: int = DEFAULT_OPSET,
        dynamic_batch: bool = False) -> onnx.ModelProto:
    """`layers` x (MatMul + Add + Relu), or (Gemm + Relu) with `use_gemm`; input [batch, in_features]."""
    in_features = hidden if in_features is None else in_features
    _check_positive(layers=layers, hidden=hidden, batch=batch, in_features=in_features)
    b = _Builder(seed, dtype)
    x, width = "input", in_features
    for i in range(layers):
        p = f"layer{i}"
        if use_gemm:
            # torch.nn.Linear exports Gemm with W stored [out, in] and transB=1.
            w = b.weight(f"{p}.weight", (hidden, width), width)
            x = b.node("Gemm", [x, w, b.bias(f"{p}.bias", hidden)], f"{p}/Gemm", transB=1)
        else:
            w = b.weight(f"{p}.weight", (width, hidden), width)
            x = b.node("MatMul", [x, w], f"{p}/MatMul")
            x = b.node("Add", [x, b.bias(f"{p}.bias", hidden)], f"{p}/Add")
        x = b.node("Relu", [x], f"{p}/Relu", out="output" if i == layers - 1 else None)
        width = hidden
    batch_dim = _batch_dim(batch, dynamic_batch)
    et = _elem_type(dtype)
    inputs = [helper.make_tensor_value_info("input", et, [batch_dim, in_features])]
    outputs = [helper.make_tensor_value_info("output", et, [batch_dim, hidden])]
    return b.model("mlp", inputs, outputs, opset)


def cnn(batch: int = 1, channels: int = 3, size: int = 32, seed: int = 0, opset: int = DEFAULT_OPSET,
        dynamic_batch: bool = False, classes: int = 10) -> onnx.ModelProto:
    """Conv, BatchNormalization, Relu, MaxPool, Conv, GlobalAveragePool, Flatten, Gemm."""
    _check_positive(batch=batch, channels=channels, size=size, classes=classes)
    if size < 2:
        raise InvalidArgument(f"size must be at least 2 (MaxPool halves it); got {size}")
    c1, c2 = 8, 16
    b = _Builder(seed)
    x = b.node("Conv", ["input", b.weight("conv1.weight", (c1, channels, 3, 3), channels * 9),
                        b.bias("conv1.bias", c1)], "conv1/Conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    gamma = b.const("bn1.weight", (1 + 0.1 * b.rng.standard_normal(c1)).astype(np.float32))
    beta = b.bias("bn1.bias", c1)
    mean = b.const("bn1.running_mean", (0.1 * b.rng.standard_normal(c1)).astype(np.float32))
    var = b.const("bn1.running_var", b.rng.uniform(0.5, 1.5, c1).astype(np.float32))
    x = b.node("BatchNormalization", [x, gamma, beta, mean, var], "bn1/BatchNormalization", epsilon=1e-5)
    x = b.node("Relu", [x], "relu1/Relu")
    x = b.node("MaxPool", [x], "pool1/MaxPool", kernel_shape=[2, 2], strides=[2, 2])
    x = b.node("Conv", [x, b.weight("conv2.weight", (c2, c1, 3, 3), c1 * 9), b.bias("conv2.bias", c2)],
               "conv2/Conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    x = b.node("GlobalAveragePool", [x], "gap/GlobalAveragePool")
    x = b.node("Flatten", [x], "flatten/Flatten", axis=1)
    fc_w = b.weight("fc.weight", (classes, c2), c2)
    b.node("Gemm", [x, fc_w, b.bias("fc.bias", classes)], "fc/Gemm", out="output", transB=1)
    batch_dim = _batch_dim(batch, dynamic_batch)
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch_dim, channels, size, size])]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch_dim, classes])]
    return b.model("cnn", inputs, outputs, opset)


def _layer_norm(b: _Builder, x: str, prefix: str, hidden: int) -> str:
    gamma = b.const(f"{prefix}.weight", (1 + 0.1 * b.rng.standard_normal(hidden)).astype(np.float32))
    return b.node("LayerNormalization", [x, gamma, b.bias(f"{prefix}.bias", hidden)],
                  f"{prefix}/LayerNormalization", axis=-1, epsilon=1e-5)


def _linear(b: _Builder, x: str, prefix: str, n_in: int, n_out: int) -> str:
    y = b.node("MatMul", [x, b.weight(f"{prefix}.weight", (n_in, n_out), n_in)], f"{prefix}/MatMul")
    return b.node("Add", [y, b.bias(f"{prefix}.bias", n_out)], f"{prefix}/Add")


def _gelu(b: _Builder, x: str, prefix: str, opset: int) -> str:
    if opset >= 20:
        return b.node("Gelu", [x], f"{prefix}/Gelu", approximate="none")
    # What torch.onnx writes before Gelu became an op: x * 0.5 * (1 + erf(x / sqrt(2))).
    t = b.node("Div", [x, b.scalar(f"{prefix}.sqrt2", math.sqrt(2.0))], f"{prefix}/Div")
    t = b.node("Erf", [t], f"{prefix}/Erf")
    t = b.node("Add", [t, b.scalar(f"{prefix}.one", 1.0)], f"{prefix}/Add")
    t = b.node("Mul", [x, t], f"{prefix}/Mul")
    return b.node("Mul", [t, b.scalar(f"{prefix}.half", 0.5)], f"{prefix}/Mul_1")


def _attention(b: _Builder, x: str, hidden: int, heads: int) -> str:
    d = hidden // heads
    # Reshape's 0 copies the batch and sequence dims, so a symbolic batch works too.
    split = b.const("attn.split_shape", np.array([0, 0, heads, d], np.int64))
    merge = b.const("attn.merge_shape", np.array([0, 0, hidden], np.int64))
    q, k, v = (_linear(b, x, f"attn.{n}", hidden, hidden) for n in "qkv")
    q = b.node("Reshape", [q, split], "attn.q/Reshape")
    k = b.node("Reshape", [k, split], "attn.k/Reshape")
    v = b.node("Reshape", [v, split], "attn.v/Reshape")
    q = b.node("Transpose", [q], "attn.q/Transpose", perm=[0, 2, 1, 3])   # [b, h, s, d]
    k = b.node("Transpose", [k], "attn.k/Transpose", perm=[0, 2, 3, 1])   # [b, h, d, s]
    v = b.node("Transpose", [v], "attn.v/Transpose", perm=[0, 2, 1, 3])
    scores = b.node("MatMul", [q, k], "attn/MatMul_qk")
    scores = b.node("Mul", [scores, b.scalar("attn.scale", 1.0 / math.sqrt(d))], "attn/Mul_scale")
    probs = b.node("Softmax", [scores], "attn/Softmax", axis=-1)
    ctx = b.node("MatMul", [probs, v], "attn/MatMul_v")
    ctx = b.node("Transpose", [ctx], "attn.ctx/Transpose", perm=[0, 2, 1, 3])
    ctx = b.node("Reshape", [ctx, merge], "attn.ctx/Reshape")
    return _linear(b, ctx, "attn.out", hidden, hidden)


def transformer_block(batch: int = 1, seq: int = 128, hidden: int = 256, heads: int = 4, ffn: int = 1024,
                      seed: int = 0, opset: int = DEFAULT_OPSET, dynamic_batch: bool = False) -> onnx.ModelProto:
    """A pre-norm encoder block as torch.onnx exports it: x + MHA(LN(x)), then x + FFN(LN(x))."""
    _check_positive(batch=batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn)
    if hidden % heads:
        raise InvalidArgument(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if opset < 17:
        raise InvalidArgument(f"transformer_block needs opset >= 17 (LayerNormalization); got {opset}")
    b = _Builder(seed)
    attn = _attention(b, _layer_norm(b, "input", "ln1", hidden), hidden, heads)
    x1 = b.node("Add", ["input", attn], "residual1/Add")
    h = _linear(b, _layer_norm(b, x1, "ln2", hidden), "ffn.fc1", hidden, ffn)
    h = _linear(b, _gelu(b, h, "ffn.gelu", opset), "ffn.fc2", ffn, hidden)
    b.node("Add", [x1, h], "residual2/Add", out="output")
    shape = [_batch_dim(batch, dynamic_batch), seq, hidden]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)]
    return b.model("transformer_block", inputs, outputs, opset)


def random_inputs(model: onnx.ModelProto, seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random feeds for every graph input (not initializers); a symbolic dim takes its size in `sizes`,
    other symbolic or unknown dims become 1."""
    sizes = sizes or {}
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise InvalidArgument(f"input {vi.name!r} is not a tensor; random_inputs fills tensors only")
        t = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else sizes.get(d.dim_param, 1)
                 for d in t.shape.dim]
        feeds[vi.name] = _random_array(rng, shape, dtype)
    return feeds


def _random_array(rng: np.random.Generator, shape: list[int], dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 10, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


__all__ = ["DEFAULT_OPSET", "cnn", "mlp", "random_inputs", "transformer_block"]
