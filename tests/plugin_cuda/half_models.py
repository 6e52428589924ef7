"""Half-precision versions of the plan test models, for the compiled plans in float16 / bfloat16
(tests/plugin_cuda/test_half_plans_cpu.py and test_half_plans.py).

`retyped(model, elem)` turns every float32 value of a float32 model (inputs, outputs, value infos,
initializers, Cast targets) into `elem` (TensorProto.FLOAT16 or BFLOAT16): the models of the plan
tests whose outputs have no shape, which `ephost convert` (host/precision.py, which runs ONNX's
strict shape inference) refuses, and one-op models that the converter keeps in float32 (its op
block list). `mixed_model` is a float32 island between Casts, as the converters make."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from abi.dtypes import to_numpy
from host.cli import zoo
from tests.plugin_cuda.attention_models import CASES as ATTENTION_CASES
from tests.plugin_cuda.attention_models import attention_model
from tests.plugin_cuda.layout_models import CASES as LAYOUT_CASES
from tests.plugin_cuda.layout_models import _conv

FLOAT = TensorProto.FLOAT
HALVES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def _retype_value(vi: onnx.ValueInfoProto, elem: int) -> None:
    if vi.type.tensor_type.elem_type == FLOAT:
        vi.type.tensor_type.elem_type = elem


def retyped(model: onnx.ModelProto, elem: int) -> onnx.ModelProto:
    """A copy of float32 `model` with every float32 value, initializer and Cast target in `elem`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _retype_value(vi, elem)
    for i, t in enumerate(g.initializer):
        if t.data_type == FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(to_numpy(elem)), t.name))
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
                a.i = elem
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(to_numpy(elem)), a.t.name))
    return out


def mixed_model(elem: int, rows: int = 4, cols: int = 48) -> onnx.ModelProto:
    """Y = Cast(Softmax(Cast(relu(X @ W + B), float32)) * 2, elem): half GEMM and bias, a float32
    island (Softmax, Mul) between the Casts a converter inserts; every node a plan can run."""
    rng = np.random.default_rng(3)
    half = to_numpy(elem)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["xw"], name="mm"),
             helper.make_node("Add", ["xw", "B"], ["h"], name="bias"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["r32"], name="up", to=FLOAT),
             helper.make_node("Softmax", ["r32"], ["s"], name="softmax", axis=-1),
             helper.make_node("Mul", ["s", "two"], ["m"], name="scale"),
             helper.make_node("Cast", ["m"], ["Y"], name="down", to=elem)]
    inits = [numpy_helper.from_array((rng.standard_normal((cols, cols)) / 7).astype(half), "W"),
             numpy_helper.from_array(rng.standard_normal(cols).astype(half), "B"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("X", elem, [rows, cols])],
                              [helper.make_tensor_value_info("Y", elem, [rows, cols])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def gelu_mlp(batch: int = 8, hidden: int = 64, layers: int = 2, opset: int = 20) -> onnx.ModelProto:
    """A float32 MLP of (MatMul, Add, Gelu) layers (ONNX Gelu, opset 20), its output of shape [batch, hidden]."""
    rng = np.random.default_rng(5)
    nodes, inits, x = [], [], "X"
    for k in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) / 8).astype(np.float32), f"W{k}"),
                  numpy_helper.from_array((rng.standard_normal(hidden) / 4).astype(np.float32), f"B{k}")]
        y = "Y" if k == layers - 1 else f"g{k}"
        nodes += [helper.make_node("MatMul", [x, f"W{k}"], [f"mm{k}"], name=f"mm{k}"),
                  helper.make_node("Add", [f"mm{k}", f"B{k}"], [f"h{k}"], name=f"bias{k}"),
                  helper.make_node("Gelu", [f"h{k}"], [y], name=f"gelu{k}")]
        x = y
    graph = helper.make_graph(nodes, "gelu_mlp", [helper.make_tensor_value_info("X", FLOAT, [batch, hidden])],
                              [helper.make_tensor_value_info("Y", FLOAT, [batch, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


# Float32 models whose half versions every compile check covers: each generated kernel kind, GEMMs
# as GEMV, tiled and cuBLAS steps, norms, masked / causal attention, the convolutions and pools.
FLOAT_MODELS = {
    "mlp-gemv-b1": lambda: zoo.mlp(layers=2, hidden=64, batch=1),
    "mlp-tiled-b32": lambda: zoo.mlp(layers=2, hidden=64, batch=32),
    "mlp-gemm-b4": lambda: zoo.mlp(layers=2, hidden=48, batch=4, in_features=20, use_gemm=True),
    "mlp-cublas-b256": lambda: zoo.mlp(layers=2, hidden=256, batch=256),  # cuBLAS in the graph variant
    "gelu-mlp": gelu_mlp,
    "transformer": lambda: zoo.transformer_block(seq=16, hidden=64, heads=4, ffn=128),
    "transformer-gelu20": lambda: zoo.transformer_block(seq=8, hidden=32, heads=2, ffn=64, opset=20),
    # 29M multiply-adds (above cudnn_step.CUDNN_MIN_MACS, 2^24): a cuDNN step on a GPU
    # (plan/cudnn_step.py), a generated kernel without cuDNN.
    "conv-cudnn": lambda: _conv((1, 64, 28, 28), (64, 64, 3, 3), bias=True, pads=[1, 1, 1, 1]),
    **{f"layout-{k}": v for k, v in LAYOUT_CASES.items()},
    **{f"attention-{k}": (lambda c=c: attention_model(*c[:4], c[4])) for k, c in ATTENTION_CASES.items()},
}


def half_models() -> dict:
    """name -> a function making the model: every FLOAT_MODELS entry retyped to each half type, and
    the mixed model."""
    out = {}
    for precision, elem in HALVES.items():
        for name, make in FLOAT_MODELS.items():
            out[f"{name}-{precision}"] = (lambda make=make, elem=elem: retyped(make(), elem))
        out[f"mixed-{precision}"] = (lambda elem=elem: mixed_model(elem))
    return out


def fused_chain(elem: int) -> onnx.ModelProto:
    """Y = (X * A + B) * C - X over half inputs: four nodes, one generated kernel, whose intermediates
    the graph declares in the half type (A, B, C are row vectors, so none is inlined as a literal)."""
    half = to_numpy(elem)
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Mul", ["X", "A"], ["xa"], name="mul"),
             helper.make_node("Add", ["xa", "B"], ["xab"], name="add"),
             helper.make_node("Mul", ["xab", "C"], ["xabc"], name="mul2"),
             helper.make_node("Sub", ["xabc", "X"], ["Y"], name="sub")]
    inits = [numpy_helper.from_array(rng.uniform(0.5, 3, 16).astype(half), name) for name in "ABC"]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("X", elem, [8, 16])],
                              [helper.make_tensor_value_info("Y", elem, [8, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def node_by_node(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """fused_chain's result with every node's output rounded to the half type (float32 arithmetic)."""
    half = x.dtype
    a, b, c = (numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer)
    step = lambda v: v.astype(half).astype(np.float32)  # noqa: E731 - the rounding of one node's output
    x32 = x.astype(np.float32)
    return step(step(step(step(x32 * a) + b) * c) - x32).astype(half)


def rms_function_body(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    """RMSNormalization-23's function body over the last axis for a half `x`: the statistics in float32,
    the normalised value cast to X's type, then the scale (a product of two half values, rounded)."""
    xf = x.astype(np.float32)
    inv = np.float32(1) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    normalised = (xf * inv).astype(x.dtype).astype(np.float32)
    return (normalised * scale.astype(np.float32)).astype(x.dtype)


def bits_differing(got: np.ndarray, want: np.ndarray) -> float:
    """The fraction of elements whose 16-bit patterns differ."""
    return float((got.view(np.uint16) != want.view(np.uint16)).mean())
