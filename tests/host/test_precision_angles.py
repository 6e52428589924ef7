"""`convert_precision` keeps a rotary table's angle in float32.

A rotary position table is cos/sin(position x frequency). In bfloat16 the product keeps 8 bits, so at
position 127 the angle is off by up to 0.25 rad and the cosines by as much: the bfloat16 Llama of issue
24 was 2.4e-2 from the float32 model where PyTorch's bfloat16 run was 1.5e-2 (H200). transformers
computes these tables in float32 and rounds only the sines and cosines; so does the converter now, for a
Sin/Cos whose input derives from integers and constants alone. Reference: NumPy in float64; the CPU EP
runs the converted model rounding every node's result to its declared type (EPHOST_HALF_ROUNDING=node).
"""

from __future__ import annotations

import collections
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from host.precision import convert_precision
from host.runtime.options import SessionOptions
from host.runtime.session import InferenceSession

DIM = 16
INV_FREQ = (1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32)


def rotary_model() -> onnx.ModelProto:
    """cos/sin tables from Range(0, len(x)) x inv_freq, as exporters write them, times x (float)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], start=0, end=1),
        helper.make_node("Squeeze", ["shape"], ["n"]),
        helper.make_node("Range", ["zero", "n", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "axis1"], ["pos_col"]),
        helper.make_node("Cast", ["pos_col"], ["pos_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["pos_f", "inv_freq"], ["angle"]),
        helper.make_node("Concat", ["angle", "angle"], ["angles"], axis=1),
        helper.make_node("Cos", ["angles"], ["cos"]),
        helper.make_node("Sin", ["angles"], ["sin"]),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Add", ["xc", "sin"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(INV_FREQ[None, :], "inv_freq")]
    graph = helper.make_graph(nodes, "rotary", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", DIM])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", DIM])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reference(x: np.ndarray) -> np.ndarray:
    angles = np.arange(len(x), dtype=np.float64)[:, None] * INV_FREQ.astype(np.float64)[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return x.astype(np.float64) * np.cos(angles) + np.sin(angles)


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    g = onnx.shape_inference.infer_shapes(model).graph
    return {vi.name: vi.type.tensor_type.elem_type for vi in (*g.value_info, *g.output)}


@pytest.mark.parametrize("precision,dtype,ulp", [("bf16", ml_dtypes.bfloat16, 2.0 ** -8),
                                                 ("fp16", np.float16, 2.0 ** -11)])
def test_a_rotary_tables_angle_is_computed_in_float32(precision, dtype, ulp, monkeypatch):
    monkeypatch.setenv("EPHOST_HALF_ROUNDING", "node")
    converted = convert_precision(rotary_model(), precision)
    ops = {n.op_type: n for n in converted.graph.node}
    types = value_types(converted)
    assert types[ops["Cos"].input[0]] == TensorProto.FLOAT  # the angle, read by Cos without a half round trip
    assert types[ops["Mul"].output[0]] in (TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16)
    x = np.ones((512, DIM), np.float32)
    got = InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.astype(dtype)})[0]
    assert got.dtype == dtype
    err = np.abs(got.astype(np.float64) - reference(x)).max()
    # cos and sin each rounded once to the half type, then the product and the sum: a few ulps of 2,
    # where a half-precision angle at position 511 is off by up to 511 * 2**-9 = 1 rad.
    assert err <= 8 * ulp, err


def test_a_chain_of_float32_nodes_passes_float32_values_between_them():
    converted = convert_precision(rotary_model(), "bf16")
    producer = {y: n for n in converted.graph.node for y in n.output}
    cos = next(n for n in converted.graph.node if n.op_type == "Cos")
    concat = producer[cos.input[0]]
    assert concat.op_type == "Concat"  # no Cast(float32 -> bf16 -> float32) between two float32 nodes
    assert producer[concat.input[0]].op_type == "Mul"
    assert {n.op_type for n in converted.graph.node}.isdisjoint({"CastLike"})


def test_a_sine_of_a_float_input_is_left_in_the_half_type():
    """Sin(x) of a float graph input is not a position table: it stays bfloat16 like any other op."""
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["a"]), helper.make_node("Sin", ["a"], ["y"])],
                              "sine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.full(4, 2.0, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    converted = convert_precision(model, "bf16")
    assert [n.op_type for n in converted.graph.node] == ["Mul", "Sin"]
    types = value_types(converted)
    assert types["a"] == TensorProto.BFLOAT16 and types["y"] == TensorProto.BFLOAT16


LLAMA_DYNAMIC = Path(__file__).resolve().parents[1] / "models" / "dynamic_hf" / "llama_ts.onnx"


def _optimized_ops(model: onnx.ModelProto, path: Path) -> collections.Counter:
    options = SessionOptions()
    options.optimized_model_filepath = str(path)
    InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.mark.parametrize("precision,dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_a_converted_llama_with_dynamic_positions_keeps_its_rotary_fusion(precision, dtype, tmp_path):
    """The dynamic Llama's tables are Cos/Sin of Range positions: converted, they are float32 and cast
    to the half type, and the optimizer still fuses RotaryEmbedding (over the casts' tables) as in the
    float32 model; the result stays within the half type's rounding of the float32 model at seq 128."""
    model32 = onnx.load(str(LLAMA_DYNAMIC))
    converted = convert_precision(model32, precision)
    want = _optimized_ops(model32, tmp_path / "fp32.onnx")
    got = _optimized_ops(converted, tmp_path / "half.onnx")
    assert want["RotaryEmbedding"] > 0
    assert got["RotaryEmbedding"] == want["RotaryEmbedding"]
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 100, (1, 128)).astype(np.int64),
             "attention_mask": np.ones((1, 128), np.int64)}
    ref = InferenceSession(model32.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out = InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert out.dtype == dtype
    assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() <= 2e-2
