"""fuse.k_major_weights: under TF32 a plan's cuBLAS GEMMs read their constant weights stored (N, K) and
transposed by the call (PyTorch's Linear layout, whose TF32 kernels are faster), without changing the
program a variant with generated GEMMs reads. CPU checks of the steps; the last test runs
the GEMMs on the GPU against onnx.reference."""

from __future__ import annotations

import numpy as np
import pytest

from host.cli import zoo
from plugin_cuda.plan import fuse, lower
from plugin_cuda.plan.onnx_spec import spec_from_onnx


def _prog(model):
    return lower.lower(spec_from_onnx(model))


def _gemms(steps) -> list:
    return [s.op for s in steps if s.kind == "gemm"]


def test_cublas_gemms_read_a_transposed_copy_of_their_weights():
    prog = _prog(zoo.mlp(layers=2, hidden=512, batch=512))  # cuBLASLt GEMMs with RELU_BIAS epilogues
    before = [op.inputs[1] for op in prog.ops if op.kind == "gemm"]
    gemms = _gemms(fuse.build_steps(prog, tiled=False, k_major=True))
    assert len(gemms) == 2 and all(op.attrs["trans_b"] and not op.attrs["trans_a"] for op in gemms)
    assert [op.attrs["epilogue"] for op in gemms] == ["relu_bias", "relu_bias"]  # the epilogues stay
    for op, b in zip(gemms, before):
        stored = prog.values[op.inputs[1]]
        np.testing.assert_array_equal(stored.const, np.asarray(prog.values[b].const).T)
        assert stored.shape == prog.values[b].shape[::-1] and stored.const.flags["C_CONTIGUOUS"]
    # the program itself is unchanged: another variant still reads the weights as they were
    assert [op.inputs[1] for op in prog.ops if op.kind == "gemm"] == before
    assert not any(op.attrs["trans_b"] for op in prog.ops if op.kind == "gemm")


def test_without_k_major_or_on_generated_gemms_nothing_changes():
    prog = _prog(zoo.mlp(layers=2, hidden=512, batch=512))
    assert not any(op.attrs["trans_b"] for op in _gemms(fuse.build_steps(prog, tiled=False)))
    small = _prog(zoo.mlp(layers=2, hidden=64, batch=4))  # generated GEMV kernels read B row-major
    steps = fuse.build_steps(small, tiled=True, k_major=True)
    assert not _gemms(steps) and not any(op.attrs.get("trans_b") for op in small.ops if op.kind == "gemm")


def test_one_copy_per_weight_and_none_for_computed_operands():
    # a transformer block: projections over constant weights, attention products over computed values
    prog = _prog(zoo.transformer_block(seq=128, hidden=256, heads=4, ffn=512))
    steps = fuse.build_steps(prog, tiled=False, k_major=True)
    gemms = _gemms(steps)
    assert gemms and all(op.attrs["trans_b"] == (prog.values[op.inputs[1]].const is not None) for op in gemms)
    copies = [op.inputs[1] for op in gemms if op.attrs["trans_b"]]
    assert len(set(copies)) == len(copies)  # each weight read by one GEMM: one copy each
    again = fuse.build_steps(prog, tiled=False, k_major=True)  # a second variant: its own copies, same contents
    for a, b in zip(_gemms(steps), _gemms(again)):
        np.testing.assert_array_equal(prog.values[a.inputs[1]].const, prog.values[b.inputs[1]].const)


def test_the_plans_of_a_partition_share_one_copy_of_each_weight():
    # signatures.specialize shares the constant arrays: every signature's plan must find the same copy (the
    # ConstantStore then hits by identity); a weight that dies takes its copy with it
    import gc

    prog = _prog(zoo.mlp(layers=2, hidden=512, batch=512))
    first = _gemms(fuse.build_steps(prog, tiled=False, k_major=True))
    second = _gemms(fuse.build_steps(prog, tiled=False, k_major=True))
    for a, b in zip(first, second):
        assert prog.values[a.inputs[1]].const is prog.values[b.inputs[1]].const
    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    copy = fuse.transposed_copy(weight)
    assert fuse.transposed_copy(weight) is copy and copy.tolist() == weight.T.tolist()
    key = id(weight)
    del weight
    gc.collect()
    assert key not in fuse._TRANSPOSED


# TF32 rounds each operand to a 10-bit mantissa: a dot product over K terms is within about 1e-3 of its
# terms' magnitude, far inside this bound; a weight read in the wrong layout is off by O(1).
TF32_TOL = dict(rtol=2e-2, atol=2e-2)


def _projection():
    """x[3, 20, 64] @ W[64, 48] -> Tanh: a GEMM with no bias to fuse, so cublasGemmEx over a 3-D A."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Tanh", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "proj", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 20, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 20, 48])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlp-2x512-b512", "mlp-gemm-2x512-b512", "transformer", "projection"])
def test_tf32_plans_with_k_major_weights_match_the_reference(cp, name):
    """The plan's cuBLASLt epilogue GEMMs (bias and ReLU; Gemm's C as the bias) and its plain cuBLAS GEMM
    (projection) read their transposed weight copies on the GPU, and compute what onnx.reference does."""
    from tests.plugin_cuda.test_plan import MODELS, Runner, build, feeds_for, reference

    model = _projection() if name == "projection" else MODELS[name]()
    feeds = feeds_for(model)
    with build(model, use_tf32=True, capture=True) as plan:
        assert any(s.kind == "gemm" and s.op.attrs.get("trans_b") for s in plan.steps)
        outs = Runner(cp, plan)([feeds[n] for n in plan.input_names])
        for got, want in zip(outs, reference(model, feeds), strict=True):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(cp.asnumpy(got) / scale, want / scale, **TF32_TOL)
