"""The CUDA plugin's kernels of issue 10 without a GPU: the registry, what the EP claims (dtypes, opsets,
attributes, outputs), attribute errors, the Attention plan's shape and mask checks and workspace, the CUDA
sources, the docs' op table, and shape arithmetic left on the host."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from plugin_cuda import kernels
from plugin_cuda.kernels import attention as attention_module
from tests.plugin_cuda.test_kernels import F16, F32

# ---------------------------------------------------------------------------------------------
# CPU-only: registry, claiming, validation


NEW_OPS = {
    "IsNaN", "IsInf", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Split", "Tile", "Pad", "Range",
    "ConstantOfShape", "Trilu", "GatherElements", "GatherND", "ScatterND", "CumSum", "ArgMax", "ArgMin", "Einsum",
    "Mish", "HardSwish", "HardSigmoid", "Softplus", "Sign", "Mod", "Sum", "Cos", "Sin", "Floor", "Ceil", "Round",
    "RMSNormalization", "RotaryEmbedding", "Attention",
    "ai.ephost.SkipLayerNormalization", "ai.ephost.BiasGelu", "ai.ephost.FusedMatMul",
}


def test_new_ops_are_registered():
    assert NEW_OPS <= set(kernels.supported_ops())


@pytest.mark.parametrize("op_type,attrs,dtypes,opset,domain,outputs,expected", [
    ("Attention", {}, ["float32"] * 3 + ["bool"], 23, "", 1, True),
    ("Attention", {}, ["float16"] * 3, 23, "", 3, True),
    ("Attention", {}, ["float32"] * 3, 23, "", 4, False),  # qk_matmul_output is not produced
    ("Attention", {}, ["float32"] * 3 + [None, "float32", "float32"], 23, "", 1, False),  # past_key/value
    ("Attention", {}, ["float32"] * 3 + [None, None, None], 23, "", 1, True),
    ("Attention", {}, ["float32"] * 3, 22, "", 1, False),
    ("Attention", {}, ["float32"] * 3, 24, "", 1, False),  # newer than the plugin knows
    ("SkipLayerNormalization", {}, ["float32"] * 4, 1, "ai.ephost", 2, True),
    ("SkipLayerNormalization", {}, ["float32"] * 4, 1, "", 1, False),  # not an ONNX op
    ("SkipLayerNormalization", {}, ["float32"] * 4, 1, "com.other", 1, False),
    ("FusedMatMul", {"activation": "Gelu"}, ["float16"] * 3, 1, "ai.ephost", 1, True),
    ("FusedMatMul", {"activation": "Swish"}, ["float32"] * 2, 1, "ai.ephost", 1, False),
    ("BiasGelu", {"approximate": "tanh"}, ["float32"] * 2, 1, "ai.ephost", 1, True),
    ("LayerNormalization", {}, ["float32"] * 3, 23, "", 3, True),
    ("RMSNormalization", {}, ["float16"] * 2, 23, "", 1, True),
    ("RotaryEmbedding", {}, ["float32"] * 3 + ["int64"], 23, "", 1, True),
    ("RotaryEmbedding", {}, ["float32"] * 3 + ["int32"], 23, "", 1, False),
    ("Cast", {"to": TensorProto.INT32}, [TensorProto.INT64], 19, "", 1, True),
    ("Add", {}, ["int64", "int64"], 14, "", 1, True),
    ("Add", {}, ["int64", "int32"], 14, "", 1, False),
    ("Where", {}, ["bool", "int64", "int64"], 16, "", 1, True),
    ("Mod", {"fmod": 0}, ["float32", "float32"], 13, "", 1, False),
    ("Mod", {"fmod": 1}, ["float32", "float32"], 13, "", 1, True),
    ("Mod", {}, ["int64", "int64"], 13, "", 1, True),
    ("Einsum", {"equation": "bij,bjk->bik"}, ["float32"] * 2, 12, "", 1, True),
    ("Einsum", {"equation": "bij,bjk->bik"}, ["float32"] * 3, 12, "", 1, False),
    ("Einsum", {"equation": "...ij,...jk"}, ["float32"] * 2, 12, "", 1, False),
    ("Einsum", {"equation": "ii->i"}, ["float32"], 12, "", 1, False),
    ("Einsum", {"equation": "ij,jk->k"}, ["float32"] * 2, 12, "", 1, False),  # i summed within one operand
    ("Split", {"axis": 1, "num_outputs": 3}, ["float16"], 18, "", 3, True),
    ("Pad", {"mode": "wrap"}, ["float32", "int64"], 18, "", 1, False),
    ("Pad", {"mode": "wrap"}, ["float32", "int64"], 19, "", 1, True),
    ("ScatterND", {"reduction": "mul"}, ["float32", "int64", "float32"], 18, "", 1, False),
    ("IsNaN", {}, ["int64"], 13, "", 1, False),
])
def test_claimable_new(op_type, attrs, dtypes, opset, domain, outputs, expected):
    assert kernels.claimable(op_type, attrs, dtypes, opset, domain=domain, num_outputs=outputs) is expected


@pytest.mark.parametrize("op_type,attrs,opset,message", [
    ("Pad", {"mode": "mirror"}, 18, r"^Pad node 'n': attribute 'mode' is 'mirror'; allowed: 'constant', "),
    ("Einsum", {"equation": "ab,bc,cd->ad"}, 12,
     r"^Einsum node 'n': attribute 'equation' is 'ab,bc,cd->ad'; allowed: one or two operands"),
    ("IsInf", {"detect_negative": 2}, 10, r"^IsInf node 'n': attribute 'detect_negative' is 2; allowed: 0 or 1$"),
    ("ConstantOfShape", {"value": np.array([1.0, 2.0], F32)}, 20,
     r"^ConstantOfShape node 'n': attribute 'value' is array\(\[1\., 2\.\]"),
    ("Attention", {"is_causal": 3}, 23, r"^Attention node 'n': attribute 'is_causal' is 3; allowed: 0 or 1$"),
])
def test_bad_attributes_new(op_type, attrs, opset, message):
    with pytest.raises(ValueError, match=message):
        kernels.lookup(op_type, opset)(attrs, opset, "n")


@pytest.mark.parametrize("shapes,message", [
    (((2, 4, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), r"^A: Q, K, V shapes \[2, 4, 5, 8\], \[2, 3, 7, 8\], .* do not fit"),
    (((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 6, 8)), r"^A: Q, K, V shapes .* do not fit"),
    (((2, 5, 8), (2, 5, 8, 1), (2, 5, 8)), r"^A: Q, K, V shapes .*; allowed: all 3-D or all 4-D$"),
])
def test_attention_plan_rejects_shapes(shapes, message):
    with pytest.raises(ValueError, match=message):
        attention_module.attention_plan(*shapes, None, None, None, None, False, None, 0.0, F32, "A")


def test_attention_plan_mask_validation():
    with pytest.raises(ValueError, match=r"^A: attn_mask has 9 keys; the keys number 7$"):
        attention_module.attention_plan((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), (5, 9), np.bool_, None, None,
                                        False, None, 0.0, F32, "A")
    with pytest.raises(ValueError, match=r"^A: attn_mask shape \[3, 5, 7\] does not broadcast to \[2, 4, 5, 7\]$"):
        attention_module.attention_plan((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), (3, 5, 7), np.bool_, None, None,
                                        False, None, 0.0, F32, "A")
    with pytest.raises(ValueError, match=r"^A: 3-D inputs need q_num_heads and kv_num_heads attributes$"):
        attention_module.attention_plan((2, 5, 8), (2, 5, 8), (2, 5, 8), None, None, None, None, False, None, 0.0,
                                        F32, "A")


def test_attention_plan_workspace():
    # float32 reuses the scores buffer for the probabilities; float16 adds a float16 copy after it.
    p32 = attention_module.attention_plan((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), None, None, None, None, False,
                                          None, 0.0, F32, "A")
    p16 = attention_module.attention_plan((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), None, None, None, None, False,
                                          None, 0.0, F16, "A")
    scores = 2 * 4 * 5 * 7
    assert p32.workspace_bytes == scores * 4 and p32.probs_offset == 0
    assert p16.probs_offset >= scores * 4 and p16.workspace_bytes == p16.probs_offset + scores * 2
    assert p32.scale == pytest.approx(1 / np.sqrt(8))
    assert p32.scores.batch == 2 * 2 and p32.scores.n == 2 * 5  # GQA: two q heads per kv-head GEMM


def test_cuda_sources_are_plain_text_for_each_dtype():
    from plugin_cuda.kernels import fused

    for dtype in (F32, F16):
        for body in (fused.SOURCE, attention_module.SOURCE):
            text = fused.source_for(body, dtype)
            assert ("typedef float T;" in text) == (dtype == F32)
    with pytest.raises(ValueError, match=r"^fused CUDA kernels got dtype float64; allowed: float32, float16, bfloat16$"):
        fused.source_for(fused.SOURCE, np.float64)


def test_docs_op_table_matches_the_registry():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cuda_ops.md").read_text()
    section = text.split("\n## Op table", 1)[1].split("\n## ", 1)[0]  # other sections have tables too
    table = [line for line in section.splitlines() if line.startswith("| ") and line.count("|") == 6
             and not line.startswith("| op |")]
    assert table == kernels.base.coverage_rows()


def test_claim_leaves_shape_arithmetic_on_the_host_and_takes_the_data_path():
    """CudaEp.claim on a small graph: shape arithmetic (from Shape, through int64 ops and constants)
    stays off the EP, integer data ops and ai.ephost ops are claimed, a Reshape whose shape is computed
    at run time and nodes of unknown domains or with unsupported outputs are not."""
    from abi.sdk import GraphSpec, NodeSpec, ValueSpec
    from plugin_cuda.plugin import CudaEp

    f32, i64, bool_ = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

    def value(name, elem, const=None):
        return ValueSpec(name, elem, None, 0, None if const is None else np.asarray(const))

    values = [value("x", f32), value("x_shape", i64), value("zero", i64, [0]), value("dim", i64),
              value("minus_one", i64, [-1]), value("new_shape", i64), value("x2", f32), value("ids", i64),
              value("one", i64, 1), value("ids1", i64), value("const_shape", i64, [2, -1]), value("x3", f32),
              value("skip", f32), value("gamma", f32), value("y", f32), value("total", f32), value("z", f32),
              value("q", f32), value("a0", f32), value("a1", f32), value("a2", f32), value("a3", f32),
              value("mask", bool_), value("mask_f", f32)]
    ix = {v.name: i for i, v in enumerate(values)}

    def node(i, op, ins, outs, domain="", opset=23, **attrs):
        return NodeSpec(i, f"n{i}", op, domain, opset, tuple(ix[n] for n in ins), tuple(ix[n] for n in outs), attrs)

    nodes = [
        node(0, "Shape", ["x"], ["x_shape"]),
        node(1, "Gather", ["x_shape", "zero"], ["dim"], axis=0),
        node(2, "Concat", ["dim", "minus_one"], ["new_shape"], axis=0),
        node(3, "Reshape", ["x", "new_shape"], ["x2"]),
        node(4, "Add", ["ids", "one"], ["ids1"]),
        node(5, "Reshape", ["x", "const_shape"], ["x3"]),
        node(6, "SkipLayerNormalization", ["x", "skip", "gamma"], ["y", "total"], domain="ai.ephost", opset=1),
        node(7, "Relu", ["x"], ["z"], domain="com.other", opset=1),
        node(8, "Attention", ["q", "q", "q"], ["a0", "a1", "a2", "a3"]),
        node(9, "Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT),
    ]
    assert CudaEp.claim(None, GraphSpec(nodes, values)) == [4, 5, 6, 9]


@pytest.mark.parametrize("flagged", [True, False])
def test_claim_takes_shape_values_that_only_device_kernels_read(flagged):
    """BERT's token-type ids, as transformers 5 exports them: a slice of a constant buffer (the host's
    shape program computes it: flagged VALUE_HOST_COMPUTED) expanded to [batch, seq] and read by an
    embedding Gather. The Expand is shape arithmetic, but only a device kernel reads its result: with
    the v7 flags the EP takes it (no CPU node, no copy per run). A shape value read at an input an op
    reads on the host (a Reshape's shape) stays on the host, and so does every shape value when the
    flags are absent (a v6 host: the shape program cannot be told apart)."""
    from abi.sdk import GraphSpec, NodeSpec, ValueSpec
    from plugin_cuda.plugin import CudaEp

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    host = 1 if flagged else 0

    def value(name, elem, const=None, flags=0):
        return ValueSpec(name, elem, None, 0, None if const is None else np.asarray(const), flags)

    values = [value("ids", i64), value("ids_shape", i64), value("target", i64, flags=host),
              value("part", i64, flags=host), value("tt", i64), value("emb", f32, np.zeros((2, 4))),
              value("out", f32), value("zero", i64, [0]), value("shape2", i64), value("x", f32), value("x2", f32),
              value("table", i64, np.zeros((1, 16), np.int64)), value("starts", i64, [0])]
    ix = {v.name: i for i, v in enumerate(values)}

    def node(i, op, ins, outs, **attrs):
        return NodeSpec(i, f"n{i}", op, "", 17, tuple(ix[n] for n in ins), tuple(ix[n] for n in outs), attrs)

    nodes = [
        node(0, "Shape", ["ids"], ["ids_shape"]),
        node(1, "Concat", ["ids_shape"], ["target"], axis=0),
        node(2, "Slice", ["table", "starts", "ids_shape"], ["part"]),
        node(3, "Expand", ["part", "target"], ["tt"]),
        node(4, "Gather", ["emb", "tt"], ["out"], axis=0),
        node(5, "Add", ["target", "zero"], ["shape2"]),
        node(6, "Reshape", ["x", "shape2"], ["x2"]),
    ]
    assert CudaEp.claim(None, GraphSpec(nodes, values)) == ([3, 4] if flagged else [4])
