"""Small graphs in the form torch's dynamo exporter gives GPT-2 with dynamic batch and sequence.

The dynamo exporter writes every `view` as `Reshape(x, Concat(Shape(x)[0:1], Shape(x)[1:2], consts),
allowzero=1)`: with allowzero=1 the host's rules cannot rewrite the target as a constant with 0
(docs/dynamic_shapes.md), so the target stays a value of the host's shape program
(VALUE_HOST_COMPUTED). Before the CUDA plans took such targets per signature, each of these Reshapes
split the compiled partitions (issue 23: 49 partitions on GPT-2 small).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def _shape_nodes(name: str, parts: list[str]) -> list:
    return [helper.make_node("Concat", parts, [name], axis=0)]


def gpt2_block(layers: int = 1, hidden: int = 16, heads: int = 2, seed: int = 0):
    """x[batch, seq, hidden] -> per layer: MatMul+bias, Reshape to [batch, seq, heads, -1]
    (allowzero=1, target computed from Shape(x)), Transpose, Softmax, Transpose back, Reshape to
    [batch, seq, hidden], flatten to [-1, hidden] (a constant), Gemm, Reshape back to
    [batch, seq, hidden] (computed: the rows dim is batch * seq), residual Add."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])
    inits = [numpy_helper.from_array(np.array([heads, -1], np.int64), "heads_rest"),
             numpy_helper.from_array(np.array([hidden], np.int64), "hidden"),
             numpy_helper.from_array(np.array([-1, hidden], np.int64), "flat")]
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["B"], start=0, end=1), n("Shape", ["x"], ["S"], start=1, end=2),
             *_shape_nodes("t4", ["B", "S", "heads_rest"]), *_shape_nodes("t3", ["B", "S", "hidden"])]
    h = "x"
    for k in range(layers):
        def w(name, *shape, k=k):
            inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), f"{name}{k}"))
            return f"{name}{k}"
        p = f"l{k}_"
        nodes += [n("MatMul", [h, w("W", hidden, hidden)], [p + "m"]), n("Add", [p + "m", w("b", hidden)], [p + "a"]),
                  n("Reshape", [p + "a", "t4"], [p + "r"], allowzero=1),
                  n("Transpose", [p + "r"], [p + "tr"], perm=[0, 2, 1, 3]),
                  n("Softmax", [p + "tr"], [p + "sm"], axis=-1),
                  n("Transpose", [p + "sm"], [p + "tr2"], perm=[0, 2, 1, 3]),
                  n("Reshape", [p + "tr2", "t3"], [p + "r2"], allowzero=1),
                  n("Reshape", [p + "r2", "flat"], [p + "f"], allowzero=1),
                  n("Gemm", [p + "f", w("W2", hidden, hidden), w("b2", hidden)], [p + "g"]),
                  n("Reshape", [p + "g", "t3"], [p + "r3"], allowzero=1),
                  n("Add", [p + "r3", h], [p + "out" if k < layers - 1 else "y"])]
        h = p + "out"
    graph = helper.make_graph(nodes, "gpt2_dynamo_like", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10  # the GPU machine's onnxruntime refuses newer IRs
    return model


def views(hidden: int = 16, heads: int = 2):
    """Layout only (the kinds the CPU codegen test can run): x + 1, Reshape to [batch, seq, heads, -1]
    and to [batch, heads, -1] with computed targets (allowzero=1) around a Transpose, times 2."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", heads, None])
    inits = [numpy_helper.from_array(np.array([heads, -1], np.int64), "heads_rest"),
             numpy_helper.from_array(np.array([heads], np.int64), "heads"),
             numpy_helper.from_array(np.array([-1], np.int64), "rest"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["B"], start=0, end=1), n("Shape", ["x"], ["S"], start=1, end=2),
             *_shape_nodes("t4", ["B", "S", "heads_rest"]), *_shape_nodes("t3", ["B", "heads", "rest"]),
             n("Add", ["x", "one"], ["a"]), n("Reshape", ["a", "t4"], ["r"], allowzero=1),
             n("Transpose", ["r"], ["tr"], perm=[0, 2, 1, 3]), n("Reshape", ["tr", "t3"], ["r2"], allowzero=1),
             n("Mul", ["r2", "two"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "views", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def feeds(batch: int, seq: int, hidden: int = 16, seed: int = 0) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((batch, seq, hidden)).astype(np.float32)}
