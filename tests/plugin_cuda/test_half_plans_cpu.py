"""Compiled plans in float16 and bfloat16, without a GPU (issue 24 item 2; the GPU side is
tests/plugin_cuda/test_half_plans.py).

- the claim gate takes half nodes and says which types plans run otherwise;
- lowering gives every value its element type (Cast, Attention's float32 scores, derived constants);
- the memory plan and the staging sizes count each value's own element size; constants are
  uploaded in their own type;
- the generated one-thread-per-element kernels of half programs run on the CPU (g++ behind the
  shim of test_codegen_on_cpu.py, with software float16 / bfloat16 conversions) and match the ONNX
  reference on the float32 model within half-precision rounding;
- every generated CUDA C variant of the half models (eager and graph variants, symbolic sizes)
  compiles with `nvcc -ptx -arch=sm_90` (skipped where nvcc is absent, as in CI).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from abi.dtypes import to_numpy
from host.cli import zoo
from plugin_cuda.plan import codegen, fuse, lower
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from plugin_cuda.plan.program import BF16, F16, F32
from tests.plugin_cuda.half_models import (
    FLOAT_MODELS,
    HALVES,
    fused_chain,
    half_models,
    mixed_model,
    node_by_node,
    retyped,
)
from tests.plugin_cuda.layout_models import CASES as LAYOUT_CASES
from tests.plugin_cuda.layout_models import _model, feeds
from tests.plugin_cuda.test_codegen_on_cpu import CPU_KINDS, SHIM

FP16, BFLOAT16 = TensorProto.FLOAT16, TensorProto.BFLOAT16


def lowered(model: onnx.ModelProto):
    return lower.lower(spec_from_onnx(model))


def _one_node(op: str, elem: int, shape=(4, 8), **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["X"], ["Y"], name="n", **attrs)
    out = attrs.get("to", elem)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", elem, list(shape))],
                              [helper.make_tensor_value_info("Y", out, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ---------------------------------------------------------------------------------------------
# The gate and the element types


@pytest.mark.parametrize("elem", [FP16, BFLOAT16, TensorProto.FLOAT])
def test_the_gate_claims_float_nodes_of_every_plan_type(elem):
    for name in ("mlp-tiled-b32", "transformer"):
        spec = spec_from_onnx(retyped(FLOAT_MODELS[name](), elem))
        reasons = {n.name: lower.unsupported_reason(spec, n) for n in spec.nodes}
        assert reasons and all(r == "" for r in reasons.values()), reasons


def test_the_gate_names_the_types_plans_run():
    spec = spec_from_onnx(_one_node("Relu", TensorProto.DOUBLE))
    assert lower.unsupported_reason(spec, spec.nodes[0]) == \
        "input 0 has element type 11; plans run float32, float16 and bfloat16"
    spec = spec_from_onnx(_one_node("Cast", FP16, to=TensorProto.INT32))
    assert lower.unsupported_reason(spec, spec.nodes[0]) == \
        "an output has element type 6; plans run float32, float16 and bfloat16"


@pytest.mark.parametrize("elem,dtype", [(FP16, F16), (BFLOAT16, BF16)])
def test_values_carry_their_element_type(elem, dtype):
    prog = lowered(mixed_model(elem))
    by_name = {v.name: v.dtype for v in prog.values.values()}
    assert by_name["X"] == by_name["W"] == by_name["xw"] == by_name["Y"] == dtype
    assert by_name["r32"] == by_name["s"] == by_name["m"] == F32  # the float32 island between the Casts
    assert prog.values[next(v for v in prog.values if prog.values[v].name == "W")].const.dtype == dtype
    casts = [op.attrs["expr"] for op in prog.ops if op.node in ("up", "down")]
    rounding = "ep_round_f16({0})" if elem == FP16 else "ep_round_bf16({0})"
    assert casts == [rounding, rounding]  # up: the half value as it is stored; down: to the half type


def test_attention_scores_are_float32_and_probabilities_half():
    from tests.plugin_cuda.attention_models import CASES, attention_model

    prog = lowered(retyped(attention_model(*CASES["3d-bcast-mask"][:4], CASES["3d-bcast-mask"][4]), BFLOAT16))
    temps = {v.name.rsplit("/", 1)[-1]: v.dtype for v in prog.values.values() if v.name.startswith("attn/")}
    assert temps == {"scores": F32, "probs": BF16}
    assert prog.values[prog.outputs[0]].dtype == BF16


def test_cast_to_an_integer_is_refused_by_the_lowering():
    from plugin_cuda.plan.errors import PlanError
    from plugin_cuda.plan.lower_math import _cast
    from plugin_cuda.plan.lowering import LowerCtx

    spec = spec_from_onnx(_one_node("Cast", FP16, to=TensorProto.INT32))
    prog = lower.Program({i: lower._value(i, v) for i, v in enumerate(spec.values)}, [], [], [])
    with pytest.raises(PlanError, match=r"^Cast node 'n': to 6; a compiled plan casts to float32 \(1\), float16"):
        _cast(LowerCtx(prog, spec, set()), spec.nodes[0])


@pytest.mark.parametrize("elem", [FP16, BFLOAT16], ids=["fp16", "bf16"])
def test_half_gemms_on_cublas_take_their_bias_and_relu_into_the_call(elem):
    prog = lowered(retyped(FLOAT_MODELS["mlp-cublas-b256"](), elem))
    gemms = [s for s in fuse.build_steps(prog, tiled=False) if s.kind == "gemm"]
    assert [s.op.attrs.get("epilogue") for s in gemms] == ["relu_bias", "relu_bias"]
    # A float32 bias on a half GEMM (a mixed graph) stays a generated kernel: cuBLASLt reads the
    # bias in the output's type.
    for v in prog.values.values():
        if v.const is not None and v.shape == (256,):
            v.const, v.dtype = np.asarray(v.const, np.float32), F32
    assert all("epilogue" not in s.op.attrs for s in fuse.build_steps(prog, tiled=False) if s.kind == "gemm")


@pytest.mark.parametrize("precision", list(HALVES))
@pytest.mark.parametrize("name", ["cnn", "transformer", "mixed"])
def test_converted_graphs_with_casts_are_one_partition(name, precision):
    """`ephost convert` keeps some ops in float32 between Casts (bfloat16 Conv and MaxPool at opset 17
    when the opset is kept, its op block list): the Casts are fused roundings, so the graph is still one
    partition."""
    from host.precision import convert_precision
    from plugin_cuda.plan.partition import fusable_groups

    models = {"cnn": lambda: convert_precision(zoo.cnn(batch=2), precision, upgrade_opset=False),
              "transformer": lambda: convert_precision(zoo.transformer_block(seq=8, hidden=32, heads=2, ffn=64,
                                                                             opset=20), precision),
              "mixed": lambda: mixed_model(HALVES[precision])}
    spec = spec_from_onnx(models[name]())
    casts = [n for n in spec.nodes if n.op_type == "Cast"]
    if name == "mixed" or (name, precision) == ("cnn", "bf16"):
        assert len(casts) >= 2, [n.op_type for n in spec.nodes]  # a float32 island between Casts
    assert fusable_groups(spec) == [[n.index for n in spec.nodes]]


def test_batch_norm_with_statistics_from_an_input_stays_per_node():
    consts = {"s": np.ones(3, np.float32), "b": np.zeros(3, np.float32), "var": np.ones(3, np.float32)}
    model = _model("BatchNormalization", {"X": (2, 3, 4, 5), "mean": (3,)}, consts, 1, 15)
    node = model.graph.node[0]
    node.input[:] = ["X", "s", "b", "mean", "var"]
    spec = spec_from_onnx(model)
    assert lower.unsupported_reason(spec, spec.nodes[0]) == (
        "BatchNormalization node 'n': scale, bias, mean and var must be constants of 3 values (the channels of "
        "input (2, 3, 4, 5))")


def test_a_kernel_declaring_float_for_a_half_buffer_is_refused():
    """The safety net of codegen.generate: a generator that ignores the value's type (a float32
    pointer to a float16 buffer) is a PlanError, so the partition falls back to per-node kernels."""
    from types import SimpleNamespace

    from plugin_cuda.plan.errors import PlanError

    prog = lowered(mixed_model(FP16))
    x = prog.inputs[0]
    spec = codegen.KernelSpec("k", [x], (1, 1, 1), (32, 1, 1),
                              'extern "C" __global__ void k(const float* __restrict__ p0) {}', SimpleNamespace(name="mm"))
    with pytest.raises(PlanError, match=r"^kernel k \(mm\) declares p0 as float\*; value 'X' is float16 \(half_bits\)$"):
        codegen.check_pointer_types(prog, spec)
    spec.source = spec.source.replace("float*", "half_bits*")
    codegen.check_pointer_types(prog, spec)


# ---------------------------------------------------------------------------------------------
# Memory: the arena and the constants in each value's own size


def _plan_without_gpu(prog):
    from plugin_cuda.plan.plan import Plan

    plan = Plan()
    plan.prog = prog
    plan._resolve_locations()
    return plan


@pytest.mark.parametrize("elem,itemsize", [(TensorProto.FLOAT, 4), (FP16, 2), (BFLOAT16, 2)])
def test_the_memory_plan_sizes_buffers_by_element_size(elem, itemsize):
    from plugin_cuda.plan.memory_plan import align_up

    model = zoo.mlp(layers=3, hidden=300, batch=5)
    prog = lowered(model if elem == TensorProto.FLOAT else retyped(model, elem))
    plan = _plan_without_gpu(prog)
    steps = fuse.build_steps(prog, tiled=False)
    memory = plan._plan_memory(steps)
    assert memory.offsets  # intermediates between the layers live in the arena
    for vid in memory.offsets:
        assert prog.values[vid].nbytes == prog.values[vid].size * itemsize
    # Two live [5, 300] activations at most, each rounded up to the 256-byte alignment.
    assert memory.arena_bytes <= 2 * align_up(5 * 300 * itemsize, 256)
    assert memory.arena_bytes >= align_up(5 * 300 * itemsize, 256)


@pytest.mark.parametrize("elem,dtype", [(FP16, F16), (BFLOAT16, BF16)])
def test_constants_are_uploaded_in_their_own_type(elem, dtype):
    model = zoo.mlp(layers=1, hidden=16, batch=2)
    prog = lowered(retyped(model, elem))
    plan = _plan_without_gpu(prog)
    weights = [v for v in prog.values if prog.values[v].const is not None and prog.values[v].size > 1]
    assert weights
    for vid in weights:
        arr = plan._const_array(vid)
        assert arr.dtype == dtype and arr.nbytes == prog.values[vid].size * 2
        np.testing.assert_array_equal(arr.view(np.uint16), np.asarray(prog.values[vid].const).view(np.uint16))


# ---------------------------------------------------------------------------------------------
# The one-thread-per-element kernels, run on the CPU

# float16 through g++'s _Float16 (round to nearest even), bfloat16 through the plan's own bit code.
HALF_SHIM = r"""
typedef long long i64;
typedef unsigned short half_bits;
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, sizeof u); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline float to_f(float v) { return v; }
static inline float to_f(half_bits h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline void put(float* p, i64 i, float v) { p[i] = v; }
static inline void put(half_bits* p, i64 i, float v) { _Float16 f = (_Float16)v; memcpy(p + i, &f, 2); }
"""


def _half_shim() -> str:
    bf16 = codegen.HALF_PRELUDE[codegen.HALF_PRELUDE.index("struct bf16_bits"):]
    return SHIM + HALF_SHIM + bf16


def _cast_chain(elem: int) -> onnx.ModelProto:
    """Y = Cast(Cast(X, float32) * 3 + B, elem) then Z = Cast(Y, float32): ew kernels with
    conversions both ways, a float32 output of a half graph and a half constant."""
    half = to_numpy(elem)
    nodes = [helper.make_node("Cast", ["X"], ["x32"], name="up", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x32", "three"], ["m"], name="mul"),
             helper.make_node("Cast", ["m"], ["mh"], name="down", to=elem),
             helper.make_node("Add", ["mh", "B"], ["Y"], name="add"),
             helper.make_node("Cast", ["Y"], ["Z"], name="out32", to=TensorProto.FLOAT)]
    inits = [numpy_helper.from_array(np.array(3.0, np.float32), "three"),
             numpy_helper.from_array(np.linspace(-2, 2, 8).astype(half), "B")]
    graph = helper.make_graph(nodes, "casts", [helper.make_tensor_value_info("X", elem, [5, 8])],
                              [helper.make_tensor_value_info("Y", elem, [5, 8]),
                               helper.make_tensor_value_info("Z", TensorProto.FLOAT, [5, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _batch_norm() -> onnx.ModelProto:
    rng = np.random.default_rng(4)
    consts = {"s": rng.uniform(0.5, 2, 3).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32),
              "mean": rng.standard_normal(3).astype(np.float32), "var": rng.uniform(0.5, 2, 3).astype(np.float32)}
    return _model("BatchNormalization", {"X": (2, 3, 4, 5)}, consts, 1, 15, epsilon=1e-3)


CPU_CASES = {**{f"layout-{k}": v for k, v in LAYOUT_CASES.items()}, "batch-norm": _batch_norm}


def run_half_on_cpu(model: onnx.ModelProto, inputs: dict, tmp_path) -> list:
    """The plan's generated kernels of `model` compiled with g++ and run on `inputs` (arrays of the
    model's input types); the outputs in their own types."""
    prog = lowered(model)
    steps = fuse.build_steps(prog)
    assert {s.kind for s in steps} <= CPU_KINDS
    source, specs = codegen.generate(prog, steps, prelude=False)
    launches = []
    for k, spec in enumerate(specs):
        params = ", ".join(f"{codegen.ctype(prog, v)}* a{j}" for j, v in enumerate(spec.params))
        args = ", ".join(f"a{j}" for j in range(len(spec.params)))
        launches.append(f'extern "C" void launch{k}({params}) {{\n'
                        f"  for (int b = 0; b < {spec.grid[0]}; ++b) for (int t = 0; t < {spec.block[0]}; ++t) {{\n"
                        f"    blockIdx.x = b; threadIdx.x = t; {spec.name}({args});\n  }}\n}}\n")
    (tmp_path / "plan.cpp").write_text(_half_shim() + source + "\n".join(launches))
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "plan.so"), str(tmp_path / "plan.cpp")],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(tmp_path / "plan.so"))
    values = prog.values
    buffers = {vid: np.ascontiguousarray(inputs[values[vid].name], values[vid].dtype) for vid in prog.inputs}
    buffers.update({vid: np.ascontiguousarray(np.asarray(v.const).astype(v.dtype)) for vid, v in values.items()
                    if v.const is not None})
    for k, spec in enumerate(specs):
        for vid in spec.params:
            buffers.setdefault(vid, np.full(values[vid].shape, np.nan, values[vid].dtype))
        getattr(lib, f"launch{k}")(*[buffers[v].ctypes.data_as(ctypes.c_void_p) for v in spec.params])
    return [buffers[v] for v in prog.outputs]


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed: cannot build the shim")
# The outputs are rounded to the half type once more than the float32 reference: its relative step.
HALF_TOL = {FP16: 2e-3, BFLOAT16: 1.6e-2}


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


@needs_gxx
@pytest.mark.parametrize("elem", [FP16, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_half_kernels_on_cpu_match_onnx_reference(name, elem, tmp_path):
    from onnx.reference import ReferenceEvaluator

    model32 = CPU_CASES[name]()
    half = to_numpy(elem)
    inputs = {k: v.astype(half) for k, v in feeds(model32).items()}
    want = ReferenceEvaluator(model32).run(None, {k: v.astype(np.float32) for k, v in inputs.items()})
    got = run_half_on_cpu(retyped(model32, elem), inputs, tmp_path)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == half and g.shape == w.shape
        assert _relative_error(g.astype(np.float32), w) <= HALF_TOL[elem], name


@needs_gxx
@pytest.mark.parametrize("elem", [FP16, BFLOAT16], ids=["fp16", "bf16"])
def test_casts_inside_a_kernel_round_like_numpy(elem, tmp_path):
    half = to_numpy(elem)
    x = np.random.default_rng(2).standard_normal((5, 8)).astype(np.float32).astype(half)
    y, z = run_half_on_cpu(_cast_chain(elem), {"X": x}, tmp_path)
    b = np.linspace(-2, 2, 8).astype(half).astype(np.float32)
    m = (x.astype(np.float32) * np.float32(3)).astype(half)  # the Cast rounds before the Add
    want = (m.astype(np.float32) + b).astype(half)
    assert y.dtype == half and z.dtype == np.float32
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(z, want.astype(np.float32))


@needs_gxx
@pytest.mark.parametrize("elem", [FP16, BFLOAT16], ids=["fp16", "bf16"])
def test_fused_half_intermediates_round_where_their_nodes_would(elem, tmp_path, monkeypatch):
    """A plan gives the node-by-node graph's bits (issue 24's accuracy against PyTorch, which rounds
    every op's output); EPHOST_PLAN_ROUND=0 keeps the intermediates in float32, and the bits differ."""
    half = to_numpy(elem)
    model = fused_chain(elem)
    assert [s.kind for s in fuse.build_steps(lowered(model))] == ["ew"]
    x = np.random.default_rng(3).uniform(-4, 4, (8, 16)).astype(half)
    want = node_by_node(model, x)
    (got,) = run_half_on_cpu(model, {"X": x}, tmp_path)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    monkeypatch.setenv("EPHOST_PLAN_ROUND", "0")
    (tmp_path / "off").mkdir()  # a second module: the first one's library stays loaded under its name
    (unrounded,) = run_half_on_cpu(model, {"X": x}, tmp_path / "off")
    assert (unrounded.view(np.uint16) != want.view(np.uint16)).any()
    assert _relative_error(unrounded.astype(np.float32), want.astype(np.float32)) <= HALF_TOL[elem]


@needs_gxx
@pytest.mark.parametrize("case", ["rotary-4d", "rotary-4d-cache-batch1-interleaved", "rotary-4d-partial"])
@pytest.mark.parametrize("elem", [FP16, BFLOAT16], ids=["fp16", "bf16"])
def test_rotary_products_round_as_the_function_body(elem, case, tmp_path):
    """RotaryEmbedding's function body multiplies in X's type: the plan's kernel gives the reference
    evaluator's bits (NumPy half arithmetic rounds each product), not those of one rounding at the end."""
    from onnx.reference import ReferenceEvaluator

    half = to_numpy(elem)
    model = retyped(LAYOUT_CASES[case](), elem)
    inputs = {k: v.astype(half) for k, v in feeds(model).items()}
    (want,) = ReferenceEvaluator(model).run(None, inputs)
    (got,) = run_half_on_cpu(model, inputs, tmp_path)
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want, half).view(np.uint16))


# ---------------------------------------------------------------------------------------------
# Every generated CUDA C variant compiles (nvcc -ptx)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc is not installed (CI has none): the CUDA C cannot be compiled here")


def _module_source(prog) -> str:
    """Both variants' kernels in one module, as Plan.build assembles them."""
    eager, _ = codegen.generate(prog, fuse.build_steps(prog, tiled=True), "ep_k")
    graph, _ = codegen.generate(prog, fuse.build_steps(prog, tiled=False), "ep_g", prelude=False)
    return eager + graph


def _nvcc(source: str, tmp_path) -> None:
    path = tmp_path / "plan.cu"
    path.write_text(source)
    done = subprocess.run(["nvcc", "-ptx", "-arch=sm_90", "--std=c++17", "-o", str(tmp_path / "plan.ptx"), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_nvcc
@pytest.mark.parametrize("name", sorted(half_models()))
def test_half_plan_source_compiles(name, tmp_path):
    prog = lowered(half_models()[name]())
    assert prog.has_half()
    source = _module_source(prog)
    assert "half_bits" in source or "bf16_bits" in source
    _nvcc(source, tmp_path)


@needs_nvcc
@pytest.mark.parametrize("precision", list(HALVES))
def test_symbolic_half_plan_source_compiles(precision, tmp_path):
    from plugin_cuda.plan.signatures import specialize

    model = retyped(zoo.transformer_block(batch=1, seq=16, hidden=64, heads=4, ffn=128, dynamic_batch=True),
                    HALVES[precision])
    spec = spec_from_onnx(model)
    ins, outs = lower.partition_io(spec)
    special = specialize(spec, ins, [(3, 16, 64)])
    prog = lower.lower(special, [special.values[i] for i in ins], [special.values[o] for o in outs])
    assert [s.expr for s in prog.symbols] == ["S0"]
    source = _module_source(prog)
    assert "const int S0, " in source
    _nvcc(source, tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_converted_llamas_float32_rotary_tables_join_a_plan(precision, tmp_path):
    """`ephost convert` keeps a dynamic Llama's rotary angles float32 and casts the tables (Cos/Sin) to
    the half type: Cos and Sin have plan lowerings, so the casts are not left as one-node partitions
    between per-node Cos/Sin kernels (34 partitions instead of 2 on an H200 before)."""
    from pathlib import Path

    import host
    from host.precision import convert_precision
    from plugin_cuda.plan.partition import fusable_groups

    source = Path(__file__).resolve().parents[1] / "models" / "dynamic_hf" / "llama_ts.onnx"
    options = host.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    host.InferenceSession(convert_precision(onnx.load(str(source)), precision).SerializeToString(), options,
                          providers=["CPUExecutionProvider"])
    spec = spec_from_onnx(onnx.load(options.optimized_model_filepath))
    trig = [n for n in spec.nodes if n.op_type in ("Cos", "Sin")]
    assert trig and all(lower.unsupported_reason(spec, n, probe=lower.PROBE_DIM) == "" for n in trig)
    groups = fusable_groups(spec, dynamic=True)
    assert all(len(g) > 1 for g in groups), [len(g) for g in groups]
    assert len(groups) <= 2
