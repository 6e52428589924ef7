"""One-node ONNX Attention-23 models (Q, K, V and the optional attn_mask as graph inputs) and their
feeds: the cases the compiled plan's masked softmax must get right, shared by the CPU lowering
tests and the GPU plan tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

# name -> (Q shape, K shape, V shape, attn_mask shape or None, attributes)
CASES = {
    "4d-square-mask": ((1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), (16, 16), {}),
    "3d-bcast-mask": ((2, 5, 2 * 8), (2, 7, 2 * 8), (2, 7, 2 * 4), (2, 1, 5, 7),
                      {"q_num_heads": 2, "kv_num_heads": 2}),
    "4d-gqa-causal-mask": ((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), (1, 4, 6, 6), {"is_causal": 1}),
    "4d-padded-mask": ((1, 2, 3, 4), (1, 2, 6, 4), (1, 2, 6, 4), (3, 4), {"scale": 0.3}),
    "4d-no-mask": ((1, 3, 5, 8), (1, 3, 5, 8), (1, 3, 5, 8), None, {}),
}


def attention_model(q, k, v, mask=None, attrs=None, past: bool = False) -> onnx.ModelProto:
    names = ["Q", "K", "V"] + (["M"] if mask is not None else [""] if past else [])
    shapes = [q, k, v] + ([mask] if mask is not None else [])
    if past:
        names += ["PK", "PV"]
        shapes += [(k[0], k[1], 2, k[3]), (v[0], v[1], 2, v[3])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip((n for n in names if n),
                                                                                           shapes)]
    node = helper.make_node("Attention", names, ["Y"], name="attn", **(attrs or {}))
    graph = helper.make_graph([node], "attention", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def attention_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Normal Q, K, V; the mask additive with a few -inf entries (never a whole row) and large
    negative ones like the exporters' finfo.min."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    if "M" in feeds:
        m = rng.uniform(-2, 1, feeds["M"].shape).astype(np.float32)
        m[..., 1] = -np.inf  # every row keeps column 0
        m.reshape(-1)[-1] = np.finfo(np.float32).min
        feeds["M"] = m
    return feeds
