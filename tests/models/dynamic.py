"""Dynamic-axes models built by hand, with the shape subgraphs torch.onnx's exporters emit.

torch is not installed on the CPU machine, so these are written with onnx.helper: the TorchScript
exporter's pattern for a reshape to heads (Shape -> Gather -> Unsqueeze -> Concat -> Reshape), the
position ids (Shape -> Gather -> Range -> Unsqueeze), ViT's class token (Shape -> Slice -> Concat ->
Expand), the dynamo exporter's symbolic value_info ("2*s0" dims), and a small BERT-like encoder with
dynamic batch and sequence (`bert_like`) for tests and bench/dynamic_shapes.py.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def _model(nodes, inputs, outputs, inits, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "dynamic", inputs, outputs, inits, value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10  # what every onnxruntime the suites meet reads (a newer onnx writes a newer one)
    return model


def _dims_of(x: str, prefix: str, axes) -> list:
    """Shape(x) -> one Gather per axis -> Unsqueeze: the exporter's 1-element dim vectors."""
    nodes = [helper.make_node("Shape", [x], [f"{prefix}_shape"])]
    for a in axes:
        nodes += [helper.make_node("Gather", [f"{prefix}_shape", f"c_i{a}"], [f"{prefix}_d{a}"], axis=0),
                  helper.make_node("Unsqueeze", [f"{prefix}_d{a}", "c_axes0"], [f"{prefix}_u{a}"])]
    return nodes


def _index_consts() -> list[onnx.TensorProto]:
    return [_ints(f"c_i{a}", a) for a in range(4)] + [_ints("c_axes0", [0])]


def reshape_heads(heads: int = 2, width: int = 8) -> onnx.ModelProto:
    """X[batch, seq, width] -> [batch, seq, heads, width/heads] -> transposed, reshaped back."""
    hd = width // heads
    nodes = _dims_of("X", "x", (0, 1))
    nodes += [helper.make_node("Concat", ["x_u0", "x_u1", "c_heads", "c_hd"], ["split_shape"], axis=0),
              helper.make_node("Reshape", ["X", "split_shape"], ["split"]),
              helper.make_node("Transpose", ["split"], ["t"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["t"], ["back"], perm=[0, 2, 1, 3]),
              helper.make_node("Concat", ["x_u0", "x_u1", "c_width"], ["merge_shape"], axis=0),
              helper.make_node("Reshape", ["back", "merge_shape"], ["Y"])]
    inits = _index_consts() + [_ints("c_heads", [heads]), _ints("c_hd", [hd]), _ints("c_width", [width])]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", width])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", width])
    return _model(nodes, [x], [y], inits)


def class_token(width: int = 8) -> onnx.ModelProto:
    """ViT's class token: Expand(cls[1,1,W], Concat(Slice(Shape(X), 0, 1), [1, W])), then Concat with X."""
    nodes = [helper.make_node("Shape", ["X"], ["xs"]),
             helper.make_node("Slice", ["xs", "c_start", "c_end"], ["batch"]),
             helper.make_node("Concat", ["batch", "c_one_w"], ["cls_shape"], axis=0),
             helper.make_node("Expand", ["cls", "cls_shape"], ["cls_b"]),
             helper.make_node("Concat", ["cls_b", "X"], ["Y"], axis=1)]
    cls = numpy_helper.from_array(np.linspace(-1, 1, width, dtype=np.float32).reshape(1, 1, width), "cls")
    inits = [_ints("c_start", [0]), _ints("c_end", [1]), _ints("c_one_w", [1, width]), cls]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "tokens", width])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "tokens_1", width])
    return _model(nodes, [x], [y], inits)


def positions(width: int = 8) -> onnx.ModelProto:
    """Position ids from a Gather'ed dim: Range(0, seq, 1) -> Unsqueeze -> Gather of a table, added to
    X; the scale 1/sqrt(seq) from Cast -> Sqrt -> Reciprocal (float arithmetic on a dim)."""
    nodes = _dims_of("X", "x", (1,))
    nodes += [helper.make_node("Range", ["c_zero", "x_d1", "c_one"], ["pos"]),
              helper.make_node("Unsqueeze", ["pos", "c_axes0"], ["pos2"]),
              helper.make_node("Gather", ["table", "pos2"], ["pe"], axis=0),
              helper.make_node("Cast", ["x_d1"], ["seq_f"], to=TensorProto.FLOAT),
              helper.make_node("Sqrt", ["seq_f"], ["seq_sqrt"]),
              helper.make_node("Reciprocal", ["seq_sqrt"], ["scale"]),
              helper.make_node("Add", ["X", "pe"], ["xp"]),
              helper.make_node("Mul", ["xp", "scale"], ["Y"])]
    table = numpy_helper.from_array(np.sin(np.arange(256 * width, dtype=np.float32)).reshape(256, width), "table")
    inits = _index_consts() + [_ints("c_zero", 0), _ints("c_one", 1), table]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", width])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", width])
    return _model(nodes, [x], [y], inits)


def symbolic_value_info(width: int = 4) -> onnx.ModelProto:
    """As the dynamo exporter writes it: an intermediate whose dims are expressions of the inputs'
    ("2*s0", "s1 + 1"), read by a Shape node; the result reshapes a flat view back."""
    nodes = [helper.make_node("Concat", ["X", "X"], ["xx"], axis=0),          # [2*s0, s1, W]
             helper.make_node("Pad", ["xx", "c_pads"], ["padded"]),           # [2*s0, s1 + 1, W]
             helper.make_node("Shape", ["padded"], ["ps"]),
             helper.make_node("Flatten", ["padded"], ["flat"], axis=1),
             helper.make_node("Reshape", ["flat", "ps"], ["Y"])]
    inits = [_ints("c_pads", [0, 0, 0, 0, 1, 0])]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["s0", "s1", width])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["2*s0", "s1 + 1", width])
    vi = [helper.make_tensor_value_info("padded", TensorProto.FLOAT, ["2*s0", "s1 + 1", width])]
    return _model(nodes, [x], [y], inits, vi)


def bert_like(layers: int = 2, hidden: int = 64, heads: int = 2, inter: int = 128, vocab: int = 100,
              max_pos: int = 512, seed: int = 0) -> onnx.ModelProto:
    """A BERT-style encoder as the TorchScript exporter writes it with dynamic_axes={batch, seq}:
    input_ids and attention_mask [batch, seq] int64 -> last_hidden_state [batch, seq, hidden]. Every
    reshape to and from heads computes its shape from Shape/Gather/Unsqueeze/Concat of its own input."""
    b = _Builder(np.random.default_rng(seed))
    hd = hidden // heads
    b.weight("word", (vocab, hidden))
    b.weight("pos_table", (max_pos, hidden))
    b.weight("type_table", (2, hidden))
    b.nodes += _dims_of("input_ids", "ids", (1,))
    b.add("Range", ["c_zero", "ids_d1", "c_one"], "pos_ids")
    b.add("Unsqueeze", ["pos_ids", "c_axes0"], "pos_ids2")
    b.add("ConstantOfShape", ["ids_shape"], "type_ids", value=numpy_helper.from_array(np.zeros(1, np.int64)))
    b.add("Gather", ["word", "input_ids"], "we")
    b.add("Gather", ["pos_table", "pos_ids2"], "pe")
    b.add("Gather", ["type_table", "type_ids"], "te")
    b.add("Add", ["we", "pe"], "e1")
    b.add("Add", ["e1", "te"], "e2")
    x = b.layer_norm("e2", "emb_ln", hidden)
    b.add("Unsqueeze", ["attention_mask", "c_axes12"], "m4")
    b.add("Cast", ["m4"], "mf", to=TensorProto.FLOAT)
    b.add("Sub", ["c_onef", "mf"], "inv")
    b.add("Mul", ["inv", "c_neg"], "mask_add")
    for i in range(layers):
        x = b.encoder_layer(x, f"l{i}", hidden, heads, hd, inter)
    b.add("Identity", [x], "last_hidden_state")
    b.inits += _index_consts() + [_ints("c_zero", 0), _ints("c_one", 1), _ints("c_axes12", [1, 2]),
                                  _ints("c_heads", [heads]), _ints("c_hd", [hd]), _ints("c_hidden", [hidden]),
                                  numpy_helper.from_array(np.array(1.0, np.float32), "c_onef"),
                                  numpy_helper.from_array(np.array(-10000.0, np.float32), "c_neg"),
                                  numpy_helper.from_array(np.array(np.sqrt(hd), np.float32), "c_sqrt_hd"),
                                  numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "c_sqrt2"),
                                  numpy_helper.from_array(np.array(0.5, np.float32), "c_half")]
    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ("input_ids", "attention_mask")]
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden])
    return _model(b.nodes, ins, [out], b.inits)


def bert_feeds(batch: int, seq: int, vocab: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
    """input_ids and an attention_mask with the last quarter of each row masked."""
    rng = np.random.default_rng(seed + 1000 * batch + seq)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - seq // 4:] = 0
    return {"input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64), "attention_mask": mask}


class _Builder:
    def __init__(self, rng):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def weight(self, name: str, shape, scale: float = 0.1) -> str:
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def add(self, op: str, inputs, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=f"{op}_{len(self.nodes)}", **attrs))
        return output

    def layer_norm(self, x: str, name: str, hidden: int) -> str:
        scale = f"{name}_g"
        self.inits.append(numpy_helper.from_array((1 + self.rng.standard_normal(hidden) * 0.1).astype(np.float32), scale))
        bias = self.weight(f"{name}_b", (hidden,))
        return self.add("LayerNormalization", [x, scale, bias], f"{name}_out", axis=-1, epsilon=1e-12)

    def linear(self, x: str, name: str, n_in: int, n_out: int) -> str:
        w = self.weight(f"{name}_w", (n_in, n_out))
        bias = self.weight(f"{name}_bias", (n_out,))
        return self.add("Add", [self.add("MatMul", [x, w], f"{name}_mm"), bias], f"{name}_y")

    def to_heads(self, x: str, name: str) -> str:
        self.nodes += _dims_of(x, name, (0, 1))
        self.add("Concat", [f"{name}_u0", f"{name}_u1", "c_heads", "c_hd"], f"{name}_hshape", axis=0)
        r = self.add("Reshape", [x, f"{name}_hshape"], f"{name}_r")
        return self.add("Transpose", [r], f"{name}_t", perm=[0, 2, 1, 3])

    def encoder_layer(self, x: str, p: str, hidden: int, heads: int, hd: int, inter: int) -> str:
        q = self.to_heads(self.linear(x, f"{p}_q", hidden, hidden), f"{p}_qh")
        k = self.to_heads(self.linear(x, f"{p}_k", hidden, hidden), f"{p}_kh")
        v = self.to_heads(self.linear(x, f"{p}_v", hidden, hidden), f"{p}_vh")
        kt = self.add("Transpose", [k], f"{p}_kt", perm=[0, 1, 3, 2])
        s = self.add("Div", [self.add("MatMul", [q, kt], f"{p}_qk"), "c_sqrt_hd"], f"{p}_scaled")
        s = self.add("Add", [s, "mask_add"], f"{p}_masked")
        probs = self.add("Softmax", [s], f"{p}_probs", axis=-1)
        ctx = self.add("Transpose", [self.add("MatMul", [probs, v], f"{p}_ctx")], f"{p}_ctx_t", perm=[0, 2, 1, 3])
        self.nodes += _dims_of(ctx, f"{p}_cx", (0, 1))
        self.add("Concat", [f"{p}_cx_u0", f"{p}_cx_u1", "c_hidden"], f"{p}_mshape", axis=0)
        merged = self.add("Reshape", [ctx, f"{p}_mshape"], f"{p}_merged")
        attn = self.add("Add", [self.linear(merged, f"{p}_o", hidden, hidden), x], f"{p}_res1")
        h = self.layer_norm(attn, f"{p}_ln1", hidden)
        up = self.linear(h, f"{p}_up", hidden, inter)
        erf = self.add("Erf", [self.add("Div", [up, "c_sqrt2"], f"{p}_div2")], f"{p}_erf")
        gelu = self.add("Mul", [self.add("Mul", [up, self.add("Add", [erf, "c_onef"], f"{p}_erf1")], f"{p}_g1"),
                                "c_half"], f"{p}_gelu")
        down = self.add("Add", [self.linear(gelu, f"{p}_down", inter, hidden), h], f"{p}_res2")
        return self.layer_norm(down, f"{p}_ln2", hidden)
