"""Float32 attention blocks shaped like the models people run in half precision, for the flash
attention step of float16 / bfloat16 compiled plans (tests/plugin_cuda/test_flash_half_plans*.py):
the half models are these through half_models.retyped.

- `bert_block`: BERT's embedding LayerNorm then a post-norm layer's attention: N = LayerNorm(X),
  Y = LayerNorm(N + Wo(Attention(N Wq, N Wk, N Wv, M))) with Attention-23 in its 3-D form, every head
  its own K/V, and an additive padding mask M (B, 1, 1, S) (0 kept, -10000 padded, as BERT exports
  build it), or of `mask_shape`;
- `llama_block`: pre-norm Llama layer's attention: Y = X + Wo(Attention(RMSNorm(X) Wq, .. Wk, .. Wv))
  with grouped-query heads (q_heads a multiple of kv_heads), causal, no mask.
Batch and sequence may be dim names (dynamic shapes)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HEAD = 64


def _weights(rng, shapes: dict) -> list:
    return [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32), n)
            for n, s in shapes.items()]


def _model(nodes, inputs: dict, inits: list, out_shape: list, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                            for n, s in inputs.items()],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10  # the GPU machine's onnxruntime refuses newer IRs
    onnx.checker.check_model(model)
    return model


def bert_block(batch=2, seq=50, heads=4, mask_shape=None, seed=0) -> onnx.ModelProto:
    hidden = heads * HEAD
    rng = np.random.default_rng(seed)
    inits = _weights(rng, {f"W{n}": (hidden, hidden) for n in "qkvo"})
    inits += [numpy_helper.from_array(np.ones(hidden, np.float32), "g"),
              numpy_helper.from_array(np.zeros(hidden, np.float32), "b")]
    nodes = [helper.make_node("LayerNormalization", ["X", "g", "b"], ["N"], name="embed_norm", axis=-1),
             *(helper.make_node("MatMul", ["N", f"W{n}"], [n.upper()], name=f"proj_{n}") for n in "qkv"),
             helper.make_node("Attention", ["Q", "K", "V", "M"], ["A"], name="attn", q_num_heads=heads,
                              kv_num_heads=heads),
             helper.make_node("MatMul", ["A", "Wo"], ["O"], name="proj_o"),
             helper.make_node("Add", ["N", "O"], ["R"], name="residual"),
             helper.make_node("LayerNormalization", ["R", "g", "b"], ["Y"], name="norm", axis=-1)]
    inputs = {"X": [batch, seq, hidden], "M": list(mask_shape or (batch, 1, 1, seq))}
    return _model(nodes, inputs, inits, [batch, seq, hidden], "bert_attention")


def llama_block(batch=2, seq=50, q_heads=8, kv_heads=2, seed=0) -> onnx.ModelProto:
    hidden, kv = q_heads * HEAD, kv_heads * HEAD
    rng = np.random.default_rng(seed)
    inits = _weights(rng, {"Wq": (hidden, hidden), "Wk": (hidden, kv), "Wv": (hidden, kv), "Wo": (hidden, hidden)})
    inits.append(numpy_helper.from_array(np.ones(hidden, np.float32), "g"))
    nodes = [helper.make_node("RMSNormalization", ["X", "g"], ["N"], name="norm", axis=-1),
             *(helper.make_node("MatMul", ["N", f"W{n}"], [n.upper()], name=f"proj_{n}") for n in "qkv"),
             helper.make_node("Attention", ["Q", "K", "V"], ["A"], name="attn", q_num_heads=q_heads,
                              kv_num_heads=kv_heads, is_causal=1),
             helper.make_node("MatMul", ["A", "Wo"], ["O"], name="proj_o"),
             helper.make_node("Add", ["X", "O"], ["Y"], name="residual")]
    return _model(nodes, {"X": [batch, seq, hidden]}, inits, [batch, seq, hidden], "llama_attention")


def padding_mask(batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """BERT's additive mask (B, 1, 1, S): each sequence keeps a random prefix (at least one key)."""
    rng = np.random.default_rng(seed)
    keep = rng.integers(1, seq + 1, batch)
    keep[0] = seq  # one full row
    return np.where(np.arange(seq)[None, :] < keep[:, None], 0.0, -10000.0).astype(np.float32).reshape(batch, 1, 1, seq)


def block_feeds(model: onnx.ModelProto, seed: int = 0) -> dict:
    """X normal; M (when the model takes one) the padding mask, broadcast to M's declared shape."""
    x = model.graph.input[0].type.tensor_type.shape.dim
    shape = [d.dim_value for d in x]
    feeds = {"X": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}
    if len(model.graph.input) > 1:
        m = [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
        feeds["M"] = np.ascontiguousarray(np.broadcast_to(padding_mask(shape[0], shape[1], seed), m))
    return feeds
