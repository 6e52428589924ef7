"""One-node ONNX models of the ops a compiled plan lowers to its one-thread-per-element kernels
(Split, Concat, Expand, RotaryEmbedding, Conv, MaxPool, AveragePool, ReduceMean, GlobalAveragePool), and a
residual convolution block, with their feeds: shared by the CPU lowering tests and the GPU plan tests,
which compare against onnx.reference."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _model(op: str, inputs: dict, consts: dict, outputs: int, opset: int, **attrs) -> onnx.ModelProto:
    names = list(inputs) + list(consts)
    node = helper.make_node(op, [n if n else "" for n in names], [f"Y{k}" for k in range(outputs)], name="n",
                            **attrs)
    graph = helper.make_graph(
        [node], op.lower(), [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()],
        [helper.make_tensor_value_info(f"Y{k}", TensorProto.FLOAT, None) for k in range(outputs)],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _rotary(x, cache, **attrs):
    return _model("RotaryEmbedding", {"X": x, "C": cache, "S": cache}, {}, 1, 23, **attrs)


def _conv(x, w, bias: bool = False, **attrs):
    rng = np.random.default_rng(7)
    consts = {"W": rng.standard_normal(w).astype(np.float32)}
    if bias:
        consts["B"] = rng.standard_normal(w[0]).astype(np.float32)
    return _model("Conv", {"X": x}, consts, 1, 17, **attrs)


def _residual_block(channels: int = 8, size: int = 6) -> onnx.ModelProto:
    """relu(conv2(relu(conv1(X))) + X), as in a ResNet basic block (convolutions with their
    epilogues: bias, ReLU, the residual Add)."""
    rng = np.random.default_rng(11)
    w = {f"W{k}": rng.standard_normal((channels, channels, 3, 3)).astype(np.float32) * 0.2 for k in (1, 2)}
    b = {f"B{k}": rng.standard_normal(channels).astype(np.float32) for k in (1, 2)}
    nodes = [helper.make_node("Conv", ["X", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Add", ["c2", "X"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["Y0"], name="relu2")]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, channels, size, size])],
                              [helper.make_tensor_value_info("Y0", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in {**w, **b}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _conv_and_relu_outputs() -> onnx.ModelProto:
    """A convolution whose result is a graph output and also read by a ReLU (also an output): the
    convolution cannot hide in the ReLU's kernel without writing its own result."""
    model = _conv((1, 3, 5, 5), (4, 3, 3, 3), True, pads=[1, 1, 1, 1])
    model.graph.node.append(helper.make_node("Relu", ["Y0"], ["Y1"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("Y1", TensorProto.FLOAT, None))
    return model


# name -> model
CASES = {
    "concat-axis1-with-constant": lambda: _model("Concat", {"A": (2, 1, 4), "B": (2, 3, 4)},
                                                 {"C": np.arange(16, dtype=np.float32).reshape(2, 2, 4)}, 1, 13,
                                                 axis=1),
    "concat-last-axis": lambda: _model("Concat", {"A": (3, 2), "B": (3, 5)}, {}, 1, 13, axis=-1),
    "conv-3x3-stride2-pad1": lambda: _conv((1, 3, 9, 9), (8, 3, 3, 3), pads=[1, 1, 1, 1], strides=[2, 2]),
    "conv-depthwise-5x5-bias": lambda: _conv((2, 6, 7, 7), (6, 1, 5, 5), True, group=6, pads=[2, 2, 2, 2],
                                             strides=[2, 2]),
    "conv-grouped-dilated-asym-pads": lambda: _conv((1, 4, 8, 6), (6, 2, 3, 2), True, group=2, dilations=[2, 1],
                                                    pads=[1, 0, 2, 1]),
    # odd total padding on both axes: SAME_UPPER puts the extra row/column at the end, SAME_LOWER first
    "conv-same-upper": lambda: _conv((1, 2, 6, 5), (3, 2, 3, 2), auto_pad="SAME_UPPER", strides=[2, 2]),
    "conv-same-lower": lambda: _conv((1, 2, 6, 5), (3, 2, 3, 2), auto_pad="SAME_LOWER", strides=[2, 2]),
    "conv-1x1": lambda: _conv((1, 16, 3, 3), (8, 16, 1, 1), True),
    # few outputs, long sums: split over input channels (plan/lower.py:conv_slices), 8 even slices
    "conv-split-deep": lambda: _conv((1, 64, 4, 4), (32, 64, 3, 3), True, pads=[1, 1, 1, 1]),
    # 7 channels in 2 slices of 4 and 3, grouped
    "conv-split-ragged-grouped": lambda: _conv((1, 14, 6, 6), (6, 7, 5, 5), True, group=2, pads=[2, 2, 2, 2]),
    "residual-block": _residual_block,
    "conv-output-and-relu": _conv_and_relu_outputs,
    "residual-block-split": lambda: _residual_block(64, 4),
    "maxpool-3x3-stride2-pad1": lambda: _model("MaxPool", {"X": (1, 3, 9, 8)}, {}, 1, 12, kernel_shape=[3, 3],
                                               strides=[2, 2], pads=[1, 1, 1, 1]),
    "maxpool-ceil-dilated": lambda: _model("MaxPool", {"X": (2, 2, 7, 8)}, {}, 1, 12, kernel_shape=[2, 3],
                                           strides=[2, 2], dilations=[2, 1], ceil_mode=1),
    "avgpool-include-pad-ceil": lambda: _model("AveragePool", {"X": (1, 3, 7, 6)}, {}, 1, 19, kernel_shape=[3, 3],
                                               strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1, ceil_mode=1),
    "avgpool-exclude-pad-same": lambda: _model("AveragePool", {"X": (1, 2, 5, 5)}, {}, 1, 19, kernel_shape=[2, 2],
                                               auto_pad="SAME_UPPER"),
    "reduce-mean-axes-input": lambda: _model("ReduceMean", {"X": (2, 5, 3, 4)}, {"ax": np.array([2, 3])}, 1, 18),
    "reduce-mean-no-keepdims": lambda: _model("ReduceMean", {"X": (2, 5, 6)}, {}, 1, 13, axes=[-1], keepdims=0),
    "global-average-pool": lambda: _model("GlobalAveragePool", {"X": (1, 7, 5, 3)}, {}, 1, 13),
    "split-last-axis-input": lambda: _model("Split", {"X": (2, 5, 12)}, {"sp": np.array([4, 4, 4])}, 3, 13, axis=-1),
    "split-middle-uneven": lambda: _model("Split", {"X": (3, 7, 2)}, {"sp": np.array([2, 5])}, 2, 13, axis=1),
    "split-num-outputs-ragged": lambda: _model("Split", {"X": (10, 3)}, {}, 3, 18, axis=0, num_outputs=3),
    "split-equal-attr-free": lambda: _model("Split", {"X": (2, 6)}, {}, 2, 13, axis=1),
    "expand-heads": lambda: _model("Expand", {"X": (1, 2, 1, 4, 3)}, {"sh": np.array([1, 2, 3, 4, 3])}, 1, 13),
    "expand-rank-up": lambda: _model("Expand", {"X": (3, 1)}, {"sh": np.array([2, 1, 3, 5])}, 1, 13),
    "rotary-4d": lambda: _rotary((2, 3, 5, 8), (2, 5, 4)),
    "rotary-4d-cache-batch1-interleaved": lambda: _rotary((2, 3, 5, 8), (1, 5, 4), interleaved=1),
    "rotary-4d-partial": lambda: _rotary((1, 2, 4, 8), (1, 4, 2), rotary_embedding_dim=4),
    "rotary-3d": lambda: _rotary((2, 4, 3 * 6), (2, 4, 3), num_heads=3),
    "rotary-3d-partial-interleaved": lambda: _rotary((1, 4, 2 * 8), (1, 4, 2), num_heads=2, rotary_embedding_dim=4,
                                                     interleaved=1),
}


def feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out
