"""CPU-side tests of the compiled plan: memory planner, lowering, fusion, partitioning, generated source.

None of these need CuPy or a GPU (the planner must import without CuPy); the generated CUDA
source is compiled with `nvcc -ptx` where nvcc exists.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin_cuda.plan import codegen, fuse, lower, lower_conv
from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.memory_plan import BufferRequest, lifetimes, overlapping_pairs, plan_memory
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from plugin_cuda.plan.partition import fusable_groups

# -- memory planner ---------------------------------------------------------------------------------


def test_planner_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import plugin_cuda.plan.memory_plan, plugin_cuda.plan.lower, plugin_cuda.plan.fuse, "
            "plugin_cuda.plan.codegen, plugin_cuda.plan.partition\n"
            "assert 'cupy' not in sys.modules or sys.modules['cupy'] is None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_disjoint_lifetimes_share_the_same_bytes():
    reqs = [BufferRequest("a", 1000, 0, 1), BufferRequest("b", 1000, 2, 3)]
    plan = plan_memory(reqs)
    assert plan.offsets["a"] == plan.offsets["b"] == 0
    assert plan.arena_bytes == 1024
    assert plan.naive_bytes == 2048


def test_overlapping_lifetimes_get_disjoint_ranges():
    reqs = [BufferRequest("a", 1000, 0, 2), BufferRequest("b", 1000, 2, 3)]  # both alive at step 2
    plan = plan_memory(reqs)
    a, b = plan.offsets["a"], plan.offsets["b"]
    assert abs(a - b) >= 1000
    assert overlapping_pairs(plan, reqs) == []


def test_offsets_are_aligned():
    reqs = [BufferRequest(i, n, 0, 0) for i, n in enumerate([1, 3, 257, 4096, 5])]
    for alignment in (1, 64, 256, 512):
        plan = plan_memory(reqs, alignment)
        assert all(off % alignment == 0 for off in plan.offsets.values())
        assert overlapping_pairs(plan, reqs) == []


def test_chain_reuses_two_buffers():
    # x0 -> x1 -> x2 -> x3: each step reads the previous buffer and writes the next one.
    steps = [([f"x{i}"], [f"x{i + 1}"]) for i in range(8)]
    spans = lifetimes([(r, w) for r, w in steps])
    reqs = [BufferRequest(k, 4096, a, b) for k, (a, b) in spans.items()]
    plan = plan_memory(reqs)
    assert plan.arena_bytes == 2 * 4096
    assert len(set(plan.offsets.values())) == 2


def test_lifetimes_and_keep():
    spans = lifetimes([([], ["a"]), (["a"], ["b"]), (["b"], ["c"]), ([], ["d"])], keep={"a"})
    assert spans == {"a": (0, 3), "b": (1, 2), "c": (2, 2), "d": (3, 3)}


@pytest.mark.parametrize(
    "reqs, alignment, match",
    [
        ([BufferRequest("a", -1, 0, 0)], 256, r"^buffer 'a' asks for -1 bytes; allowed: an integer >= 0$"),
        ([BufferRequest("a", 4, 3, 1)], 256, r"^buffer 'a' lives from step 3 to 1; allowed: integers with 0 <= "),
        ([BufferRequest("a", 4, 0, 0)], 48, r"^memory plan alignment is 48; allowed: a power of two >= 1$"),
        ([BufferRequest("a", 4, 0, 0), BufferRequest("a", 8, 1, 1)], 256, r"^memory plan got buffer 'a' twice"),
    ],
)
def test_planner_rejects_bad_requests(reqs, alignment, match):
    with pytest.raises(PlanError, match=match):
        plan_memory(reqs, alignment)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=30))
def test_random_plans_never_overlap_live_buffers(items):
    reqs = [BufferRequest(i, n, a, a + d) for i, (n, a, d) in enumerate(items)]
    plan = plan_memory(reqs, 256)
    assert overlapping_pairs(plan, reqs) == []
    assert plan.arena_bytes <= plan.naive_bytes
    peak = max(sum(-(-max(r.nbytes, 1) // 256) * 256 for r in reqs if r.first <= s <= r.last)
               for s in range(27))
    assert plan.arena_bytes >= peak  # no plan can beat the peak of live bytes
    for r in reqs:
        assert plan.offsets[r.key] + max(r.nbytes, 1) <= plan.arena_bytes


# -- lowering and fusion -------------------------------------------------------------------------------


def _zoo():
    from host.cli import zoo

    return zoo


def _program(model):
    spec = spec_from_onnx(model)
    prog = lower.lower(spec)
    return spec, prog, fuse.build_steps(prog)


def test_mlp_fuses_gemm_bias_relu_into_one_kernel_per_layer():
    spec, prog, steps = _program(_zoo().mlp(layers=8, hidden=256, batch=1))
    assert len(spec.nodes) == 24
    assert [s.kind for s in steps] == ["ew"] * 8
    assert all(s.group.head is not None and len(s.group.members) == 2 for s in steps)


def test_mid_size_gemm_is_a_tiled_kernel_with_its_epilogue():
    spec, prog, steps = _program(_zoo().mlp(layers=2, hidden=64, batch=32))
    assert [s.kind for s in steps] == ["ew", "ew"]
    assert all(s.group.head is not None and len(s.group.members) == 2 for s in steps)


def test_graph_variant_sends_mid_size_gemms_to_cublas():
    spec, prog, steps = _program(_zoo().transformer_block())
    graph_steps = fuse.build_steps(prog, tiled=False)
    assert [s.kind for s in graph_steps].count("gemm") == 8  # q, k, v, out, fc1, fc2 and attention's two
    assert [s.kind for s in steps].count("gemm") == 2
    one_row = _program(_zoo().mlp(layers=2, hidden=64, batch=1))[1]
    assert [s.kind for s in fuse.build_steps(one_row, tiled=False)] == ["ew", "ew"]  # GEMV kernels stay


def test_large_gemm_goes_to_cublas_with_fused_epilogue():
    spec, prog, steps = _program(_zoo().mlp(layers=2, hidden=512, batch=512))  # 2**27 multiply-adds each
    # cuBLASLt takes each layer's bias Add and ReLU into the GEMM (BIAS/RELU_BIAS epilogues) ...
    assert [s.kind for s in steps] == ["gemm", "gemm"]
    assert [s.op.attrs["epilogue"] for s in steps] == ["relu_bias", "relu_bias"]
    assert all(prog.values[s.op.inputs[2]].const is not None for s in steps)
    assert steps[-1].writes == prog.outputs
    # ... and without it they are one generated epilogue kernel after each cuBLAS GEMM.
    steps = fuse.build_steps(prog, cublaslt=False)
    assert [s.kind for s in steps] == ["gemm", "ew", "gemm", "ew"]
    assert [len(s.group.members) for s in steps if s.kind == "ew"] == [2, 2]


def _gemm_then(tail: list, out: str = "Y", b_shape=(64, 32), bias=None) -> onnx.ModelProto:
    """X (64, 64) @ W -> `tail` nodes (reading "mm"); inputs X, Z (64, 32), V (32,); constants W and
    a bias B (32,) unless given."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    consts = [numpy_helper.from_array(rng.standard_normal(b_shape).astype(np.float32), "W"),
              numpy_helper.from_array(rng.standard_normal(32).astype(np.float32) if bias is None else bias, "B")]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["mm"], name="mm")] + tail
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [64, 64]),
                                       helper.make_tensor_value_info("Z", TensorProto.FLOAT, [64, 32]),
                                       helper.make_tensor_value_info("V", TensorProto.FLOAT, [32])],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], consts)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _lt_epilogues(model) -> list:
    prog = lower.lower(spec_from_onnx(model))
    return [s.op.attrs.get("epilogue") for s in fuse.build_steps(prog, tiled=False) if s.kind == "gemm"]


def test_cublaslt_epilogue_takes_only_a_constant_bias_read_once():
    from onnx import helper

    add = helper.make_node("Add", ["mm", "B"], ["Y"], name="add")
    assert _lt_epilogues(_gemm_then([add])) == ["bias"]
    assert _lt_epilogues(_gemm_then([helper.make_node("Add", ["B", "mm"], ["s"]), helper.make_node("Relu", ["s"], ["Y"])])) == ["relu_bias"]
    # a Sigmoid after the bias: the bias is folded, the Sigmoid stays a kernel
    assert _lt_epilogues(_gemm_then([helper.make_node("Add", ["mm", "B"], ["s"]), helper.make_node("Sigmoid", ["s"], ["Y"])])) == ["bias"]
    refused = {
        "the addend is a call input": [helper.make_node("Add", ["mm", "V"], ["Y"])],
        "the addend is a call input matrix": [helper.make_node("Add", ["mm", "Z"], ["Y"])],
        "the addend is a whole matrix": None,
        "the GEMM result is read twice": [helper.make_node("Add", ["mm", "B"], ["s"]), helper.make_node("Mul", ["s", "mm"], ["Y"])],
        "a Sub, not an Add": [helper.make_node("Sub", ["mm", "B"], ["Y"])],
    }
    for why, tail in refused.items():
        model = (_gemm_then([helper.make_node("Add", ["mm", "B"], ["Y"])], bias=np.ones((64, 32), np.float32))
                 if tail is None else _gemm_then(tail))
        assert _lt_epilogues(model) == [None], why
    # the ReLU is not folded when the biased value is read elsewhere too
    two = [helper.make_node("Add", ["mm", "B"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
           helper.make_node("Add", ["r", "s"], ["Y"])]
    assert _lt_epilogues(_gemm_then(two)) == ["bias"]


def test_transformer_steps_and_exports():
    spec, prog, steps = _program(_zoo().transformer_block())
    kinds = [s.kind for s in steps]
    assert kinds.count("norm") == 2 and kinds.count("softmax") == 1 and kinds.count("gemm") == 2  # q k^T, p v
    # The decomposed GELU (Div, Erf, Add, Mul, Mul) and the bias Add become one kernel.
    gelu = [s for s in steps if s.kind == "ew" and "ffn.gelu/Mul_1" in [m.node for m in s.group.members]]
    assert len(gelu) == 1 and len(gelu[0].group.members) == 6
    # Every value a step reads is written by an earlier step, or is an input or a constant.
    written = set(prog.inputs)
    alias = {op.outputs[0]: op.inputs[0] for op in prog.ops if op.kind == "alias"}

    def base(v):
        while v in alias:
            v = alias[v]
        return v

    for s in steps:
        for v in s.reads:
            assert base(v) in written or prog.values[base(v)].const is not None, (s.name, v)
        written |= {base(v) for v in s.writes}
    assert set(prog.outputs) <= written


def test_sealed_group_is_not_extended_past_an_outside_reader():
    # y = relu(x); z = y @ W (outside reader); out = y + z: the Add must not join relu's group,
    # or relu's kernel would have to wait for the GEMM that needs relu's result.
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("MatMul", ["y", "W"], ["z"], name="mm"),
             helper.make_node("Add", ["y", "z"], ["out"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 4])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [16, 4])], [w])
    spec, prog, steps = _program(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert [[m.node for m in s.group.members] for s in steps] == [["relu"], ["add"]]
    assert steps[1].group.head.node == "mm"  # the GEMM runs in the Add's kernel, after relu's


def test_lowering_rejects_an_unsupported_node_by_name():
    from onnx import TensorProto, helper

    n = helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=0)
    g = helper.make_graph([n], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    spec = spec_from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(PlanError, match=r"^Softmax node 'sm': axis 0 of rank 2; a compiled plan supports the last"):
        lower.lower(spec)


def test_dynamic_input_shape_is_refused():
    spec = spec_from_onnx(_zoo().mlp(layers=1, hidden=8, dynamic_batch=True))
    with pytest.raises(PlanError, match=r"^partition input 'input' has shape \(-1, 8\); a compiled plan needs"):
        lower.lower(spec)


# -- generated indexing, checked against NumPy broadcasting --------------------------------------------------


@pytest.mark.parametrize("out_shape, leaf_shape", [
    ((2, 3, 4), (4,)), ((2, 3, 4), (3, 1)), ((2, 3, 4), (2, 1, 4)), ((2, 3, 4), ()), ((2, 3, 4), (2, 3, 4)),
    ((5, 1, 6), (1, 1, 6)), ((3, 4), (3, 1)),
])
def test_index_expr_matches_numpy_broadcasting(out_shape, leaf_shape):
    expr = codegen.index_expr(out_shape, leaf_shape, "i").replace("/", "//")
    leaf = np.arange(max(math.prod(leaf_shape), 1)).reshape(leaf_shape)
    want = np.broadcast_to(leaf, out_shape).reshape(-1)
    got = [leaf.reshape(-1)[eval(expr, {"i": i})] for i in range(math.prod(out_shape))]  # noqa: S307 - our own text
    np.testing.assert_array_equal(got, want)


def test_transpose_index_matches_numpy():
    prog_shape, perm = (2, 3, 4), (1, 2, 0)
    out_shape = tuple(prog_shape[p] for p in perm)
    ostr, istr = codegen.strides(out_shape), codegen.strides(prog_shape)
    x = np.arange(24).reshape(prog_shape)
    got = [x.reshape(-1)[sum((i // ostr[d]) % out_shape[d] * istr[perm[d]] for d in range(3))] for i in range(24)]
    np.testing.assert_array_equal(got, np.transpose(x, perm).reshape(-1))


# -- claim_fused grouping -----------------------------------------------------------------------------------------


def test_groups_never_close_a_cycle_through_an_outside_node():
    from onnx import TensorProto, helper

    # a (plan) -> Cast (not plan: int) ... -> b (plan) reads both a and the outside node's result.
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="a"),
             helper.make_node("Cast", ["a"], ["c"], name="outside", to=TensorProto.INT32),
             helper.make_node("Cast", ["c"], ["d"], name="back", to=TensorProto.FLOAT),
             helper.make_node("Add", ["a", "d"], ["y"], name="b")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    spec = spec_from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    groups = fusable_groups(spec)
    assert sorted(groups) == [[0], [3]]


def test_connected_nodes_form_one_group():
    spec = spec_from_onnx(_zoo().transformer_block())
    groups = fusable_groups(spec)
    assert groups == [list(range(len(spec.nodes)))]


@pytest.mark.parametrize("op, inputs, consts, attrs, reason", [
    ("ReduceMean", {"X": (2, 5, 6)}, {}, {"axes": [0, 2]}, r"axes \[0, 2\] of rank 3; a compiled plan reduces trailing"),
    ("Softmax", {"X": (4, 8)}, {}, {"axis": 0}, r"axis 0 of rank 2; a compiled plan supports the last axis only"),
    ("Conv", {"X": (1, 2, 9)}, {"W": np.ones((3, 2, 3), np.float32)}, {}, r"a compiled plan runs 2-D convolutions"),
    ("MaxPool", {"X": (1, 2, 9)}, {}, {"kernel_shape": [3]}, r"kernel_shape \(3,\); a compiled plan runs 2-D pools"),
    ("AveragePool", {"X": (1, 2, 4, 4, 4)}, {}, {"kernel_shape": [2, 2, 2]}, r"a compiled plan runs 2-D pools"),
])
def test_a_node_its_lowering_refuses_is_never_claimed(op, inputs, consts, attrs, reason):
    """Claiming asks the node's lowering rule first, so a claimed group never fails to compile (and
    falls back whole) because of one node: that node alone stays on the per-node kernels."""
    from tests.plugin_cuda.layout_models import _model

    first = _model(op, inputs, consts, 1, 13, **attrs)
    relu = onnx.helper.make_node("Relu", ["Y0"], ["R"], name="relu")
    first.graph.node.append(relu)
    first.graph.output.append(onnx.helper.make_tensor_value_info("R", onnx.TensorProto.FLOAT, None))
    spec = spec_from_onnx(first)
    assert re.search(reason, lower.unsupported_reason(spec, spec.nodes[0]))
    assert fusable_groups(spec) == [[1]]


def test_maxpool_with_indices_is_not_lowered():
    from tests.plugin_cuda.layout_models import _model

    spec = spec_from_onnx(_model("MaxPool", {"X": (1, 2, 6, 6)}, {}, 2, 12, kernel_shape=[2, 2]))
    assert "the Indices output is not supported" in lower.unsupported_reason(spec, spec.nodes[0])


def test_convolution_split_and_epilogue():
    """A convolution with few outputs and long sums is split over input channels (slices of at
    least CONV_MIN_SLICE products); its bias, ReLU and residual Add run in the kernel that adds the
    slices, and an unsplit convolution opens its epilogue kernel itself."""
    from tests.plugin_cuda.layout_models import CASES

    assert lower_conv.conv_slices(1 << 16, 512, 9) == 1  # enough outputs already
    assert lower_conv.conv_slices(2048, 512, 9) == 32  # 2048 x 32 threads, 16 channels x 9 taps each
    assert lower_conv.conv_slices(16, 7, 25) == 2  # 7 channels: no slice below 64 products
    assert lower_conv.conv_slices(16, 3, 1) == 1
    for name, kinds in (("residual-block", [("ew", "conv", 1), ("ew", "conv", 2)]),
                        ("residual-block-split", [("conv_partial", None, None), ("ew", "slice_sum", 1),
                                                  ("conv_partial", None, None), ("ew", "slice_sum", 2)])):
        prog = lower.lower(spec_from_onnx(CASES[name]()))
        steps = fuse.build_steps(prog)
        assert [(s.kind, s.group.head.kind if s.group and s.group.head else None,
                 len(s.group.members) if s.group else None) for s in steps] == kinds, name


def test_masked_attention_reads_its_mask_in_the_softmax():
    from tests.plugin_cuda.attention_models import CASES, attention_model

    q, k, v, mask, attrs = CASES["3d-bcast-mask"]
    spec, prog, steps = _program(attention_model(q, k, v, mask, attrs))
    assert [s.kind for s in steps] == ["bgemm", "softmax", "bgemm"]
    soft = steps[1].op
    assert prog.values[soft.inputs[1]].name == "M"
    # mask (2, 1, 5, 7) against scores (batch 2, heads 2, q 5, kv 7): b, h (broadcast), i strides
    assert soft.attrs["mask_strides"] == (35, 0, 7) and soft.attrs["mask_len"] == 7 and soft.attrs["heads"] == 2
    spec_ = codegen.softmax_kernel(prog, steps[1], "k")
    assert spec_.params == [soft.inputs[0], soft.outputs[0], soft.inputs[1]]
    assert "xr[c] + mr[c]" in spec_.source and "(rbh / 2u) * 35LL + (rbh % 2u) * 0LL + ri * 7LL" in spec_.source


def test_attention_with_past_is_refused_by_name():
    from tests.plugin_cuda.attention_models import attention_model

    spec = spec_from_onnx(attention_model((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), past=True))
    with pytest.raises(PlanError, match=r"^Attention node 'attn': past_key/past_value inputs are not supported"):
        lower.lower(spec)


def test_attention_mask_that_does_not_broadcast_is_refused_by_name():
    from tests.plugin_cuda.attention_models import attention_model

    spec = spec_from_onnx(attention_model((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (3, 4, 4)))
    with pytest.raises(PlanError, match=r"^Attention node 'attn': attn_mask shape \[3, 4, 4\] does not broadcast"):
        lower.lower(spec)


def test_split_with_chunks_that_do_not_add_up_is_refused_by_name():
    from tests.plugin_cuda.layout_models import _model

    spec = spec_from_onnx(_model("Split", {"X": (2, 6)}, {"sp": np.array([2, 3])}, 2, 13, axis=1))
    with pytest.raises(PlanError, match=r"^Split node 'n': chunks \[2, 3\] for 2 outputs of an axis of 6; they must"):
        lower.lower(spec)


def test_rotary_with_position_ids_is_left_to_the_kernel_path():
    from tests.plugin_cuda.layout_models import _model

    model = _model("RotaryEmbedding", {"X": (1, 2, 4, 8), "C": (9, 4), "S": (9, 4)}, {"P": np.zeros((1, 4), np.int64)},
                   1, 23)
    spec = spec_from_onnx(model)
    assert "plans run float32" in lower.unsupported_reason(spec, spec.nodes[0])  # never claimed for a plan
    with pytest.raises(PlanError, match=r"^node 'n' \(RotaryEmbedding\) cannot run in a compiled plan: input 3"):
        lower.lower(spec)


# -- the generated module compiles ----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: cannot compile the generated CUDA")
def test_generated_source_compiles_with_nvcc(tmp_path):
    from tests.plugin_cuda.attention_models import CASES, attention_model
    from tests.plugin_cuda.layout_models import CASES as LAYOUT_CASES

    zoo = _zoo()
    models = [zoo.mlp(layers=2, hidden=64, batch=1), zoo.mlp(layers=2, hidden=64, batch=32, use_gemm=True),
              zoo.transformer_block(seq=16, hidden=32, heads=2, ffn=64, opset=20)]
    models += [attention_model(q, k, v, mask, attrs) for q, k, v, mask, attrs in CASES.values()]
    models += [make() for make in LAYOUT_CASES.values()]
    paths = []
    for k, model in enumerate(models):
        _, prog, steps = _program(model)
        source, _ = codegen.generate(prog, steps)
        paths.append(tmp_path / f"plan{k}.cu")
        paths[-1].write_text(source)

    def nvcc(path):
        return subprocess.run(["nvcc", "-ptx", "--std=c++17", "-arch=sm_80", "-o", str(path.with_suffix(".ptx")),
                               str(path)], capture_output=True, text=True, timeout=120)

    # ~0.5 s of nvcc per model, one process each: as many at a time as there are cores.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        failed = [(path.name, proc.stderr) for path, proc in zip(paths, pool.map(nvcc, paths)) if proc.returncode]
    assert failed == []
