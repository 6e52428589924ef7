"""The generated one-thread-per-element kernels (strided copies, rotary, convolutions whole or split
with their epilogues, pools, mean, elementwise, transpose) run on
the CPU: their CUDA C is compiled by g++ behind a small shim (grid and block loops instead of a
launch), so the index arithmetic of the compiled plans is checked against onnx.reference in CI,
which has no GPU. Kernels with shared memory or warp shuffles (softmax, norms, tiled GEMMs) are GPU
tests only (tests/plugin_cuda/test_plan.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from plugin_cuda.plan import codegen, fuse, lower
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from tests.plugin_cuda.layout_models import CASES, feeds

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed: cannot build the shim")

SHIM = r"""
#include <math.h>
#include <string.h>
struct ep_dim3 { int x, y, z; };
static ep_dim3 blockIdx, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, sizeof f); return f; }
""" + codegen.SCALAR_PRELUDE
CPU_KINDS = {"copy", "place", "rotary", "transpose", "ew", "conv_partial", "mean", "pool"}


def run_on_cpu(model, inputs: dict, tmp_path) -> list:
    prog = lower.lower(spec_from_onnx(model))
    steps = fuse.build_steps(prog)
    assert {s.kind for s in steps} <= CPU_KINDS and all(s.group is None or s.group.head is None
                                                 or s.group.head.kind in fuse.HEAD_KINDS for s in steps)
    source, specs = codegen.generate(prog, steps, prelude=False)
    launches = []
    for k, spec in enumerate(specs):
        params = ", ".join(f"float* a{j}" for j in range(len(spec.params)))
        args = ", ".join(f"a{j}" for j in range(len(spec.params)))
        launches.append(f'extern "C" void launch{k}({params}) {{\n'
                        f"  for (int b = 0; b < {spec.grid[0]}; ++b) for (int t = 0; t < {spec.block[0]}; ++t) {{\n"
                        f"    blockIdx.x = b; threadIdx.x = t; {spec.name}({args});\n  }}\n}}\n")
    (tmp_path / "plan.cpp").write_text(SHIM + source + "\n".join(launches))
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "plan.so"), str(tmp_path / "plan.cpp")],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(tmp_path / "plan.so"))
    buffers = {vid: np.ascontiguousarray(inputs[prog.values[vid].name], np.float32) for vid in prog.inputs}
    buffers.update({vid: np.ascontiguousarray(v.const, np.float32) for vid, v in prog.values.items()
                    if v.const is not None})
    buffers.update({vid: np.full(prog.values[vid].shape, np.nan, np.float32) for vid in prog.outputs})
    for k, spec in enumerate(specs):
        for vid in spec.params:
            buffers.setdefault(vid, np.full(prog.values[vid].shape, np.nan, np.float32))
        getattr(lib, f"launch{k}")(*[buffers[v].ctypes.data_as(ctypes.c_void_p) for v in spec.params])
    return [buffers[v] for v in prog.outputs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_kernels_match_onnx_reference(name, tmp_path):
    from onnx.reference import ReferenceEvaluator

    model = CASES[name]()
    inputs = feeds(model)
    want = ReferenceEvaluator(model).run(None, inputs)
    got = run_on_cpu(model, inputs, tmp_path)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        # float32 sums of hundreds of products (split convolutions add in another order): an atol
        # relative to the output's magnitude
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(w).max())))


def test_cos_and_sin_keep_their_accuracy_at_large_angles(tmp_path):
    """Rotary tables take Cos/Sin of angles up to thousands of radians (position x frequency, float32
    since `ephost convert` keeps them so): the kernels use cosf/sinf with full range reduction."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cos", ["x"], ["c"]), helper.make_node("Sin", ["x"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    graph = helper.make_graph(nodes, "trig", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).uniform(-4096, 4096, (4, 64)).astype(np.float32)
    (got,) = run_on_cpu(model, {"x": x}, tmp_path)
    want = np.cos(x.astype(np.float64)) * np.sin(x.astype(np.float64))
    np.testing.assert_allclose(got, want, atol=1e-6)


def _repeated_layers(layers: int):
    """`layers` copies of tanh(transpose(x) * a + b): each copy's kernels are the others' but for
    their names, as in a transformer's repeated layers; the weights differ."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        inits += [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"a{k}"),
                  numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), f"b{k}")]
        nodes += [helper.make_node("Transpose", [x], [f"t{k}"], perm=[1, 0]),
                  helper.make_node("Mul", [f"t{k}", f"a{k}"], [f"m{k}"]),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"s{k}"]),
                  helper.make_node("Tanh", [f"s{k}"], [f"y{k}"])]
        x = f"y{k}"
    graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_repeated_layers_share_their_kernels(tmp_path):
    """The module holds each kernel body once (NVRTC's time follows the source's length); the steps
    of later layers launch the first layer's kernels on their own buffers, and the result is
    onnx.reference's."""
    from onnx.reference import ReferenceEvaluator

    model = _repeated_layers(4)
    prog = lower.lower(spec_from_onnx(model))
    steps = fuse.build_steps(prog)
    source, specs = codegen.generate(prog, steps, prelude=False)
    names = [s.name for s in specs if s is not None]
    assert len(names) >= 8 and len(set(names)) * 4 == len(names)  # each layer's kernels: the first layer's
    assert source.count("__global__") == len(set(names))
    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    (got,) = run_on_cpu(model, {"x": x}, tmp_path)
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_one_seen_table_spans_the_calls_of_one_module():
    """A second call with the first call's `seen` (a plan's graph variant) names the first call's
    kernels and adds no source for them."""
    model = _repeated_layers(2)
    prog = lower.lower(spec_from_onnx(model))
    steps = fuse.build_steps(prog)
    seen: dict = {}
    first, first_specs = codegen.generate(prog, steps, "ep_k", seen=seen)
    second, second_specs = codegen.generate(prog, steps, "ep_g", prelude=False, seen=seen)
    assert "__global__" not in second
    assert [s.name for s in second_specs if s] == [s.name for s in first_specs if s]
