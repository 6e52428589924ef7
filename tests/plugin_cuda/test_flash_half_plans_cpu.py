"""Flash attention inside float16 / bfloat16 compiled plans, without a GPU (the GPU side is
tests/plugin_cuda/test_flash_half_plans.py):

- the lowering takes the fused step for half plans (BERT-like 3-D with a padding mask, Llama-like
  GQA and causal), on tensor cores from sm_80 on and on the SIMT body before, and keeps the two
  GEMMs where the kernel does not compute the node, with the reason on the chain's first bgemm;
- the generated wrapper declares the plan's storage types and reads the mask in its own type;
- the plan modules compile with `nvcc -ptx` for sm_80 and sm_90, and a dynamic plan's source is
  shared by two shape signatures;
- the generated steps run on the CPU (g++ behind test_flash_attention_cpu.py's shim, the MMA
  emulated) in bfloat16 and match NumPy on the same rounded inputs.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from abi.dtypes import to_numpy
from plugin_cuda.kernels import flash_attention as flash
from plugin_cuda.plan import codegen, fuse, lower
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from plugin_cuda.plan.signatures import specialize
from tests.plugin_cuda.flash_half_models import bert_block, llama_block
from tests.plugin_cuda.half_models import retyped
from tests.plugin_cuda.test_flash_attention_cpu import HOST_MMA, NVCC, SHIM, needs_nvcc, numpy_attention

FP16, BF16, F32 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT
HALVES = {"fp16": FP16, "bf16": BF16}


@pytest.fixture
def sm(monkeypatch):
    """Pretend the device is sm_<n> (the lowering asks it whether half flash steps use tensor cores)."""
    def set_capability(n: int) -> None:
        monkeypatch.setattr(flash, "_capability", lambda: n)
    set_capability(90)
    return set_capability


def lowered(model: onnx.ModelProto, choice: str = "flash"):
    with flash.kernel_choice(choice):
        return lower.lower(spec_from_onnx(model))


def attention_ops(prog) -> list:
    return [op for op in prog.ops if op.kind in ("flash_attention", "bgemm", "softmax")]


def two_node_model(elem: int) -> onnx.ModelProto:
    """Two Attention nodes in one plan of type `elem`: BERT-like (3-D, a padding mask (B, 1, 1, Skv) in
    `elem`, Sq != Skv) and Llama-like (4-D, GQA 4:2, causal, a float32 mask of a mixed graph)."""
    shapes = {"Q": (2, 20, 2 * 32), "K": (2, 37, 2 * 32), "V": (2, 37, 2 * 32), "M": (2, 1, 1, 37),
              "Q4": (1, 4, 37, 32), "K4": (1, 2, 37, 32), "V4": (1, 2, 37, 32), "M4": (37, 37)}
    nodes = [helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y1"], name="bert", q_num_heads=2,
                              kv_num_heads=2),
             helper.make_node("Attention", ["Q4", "K4", "V4", "M4"], ["Y2"], name="llama", is_causal=1)]
    inputs = [helper.make_tensor_value_info(n, F32 if n == "M4" else elem, list(s)) for n, s in shapes.items()]
    outputs = [helper.make_tensor_value_info("Y1", elem, [2, 20, 64]), helper.make_tensor_value_info("Y2", elem,
                                                                                                     [1, 4, 37, 32])]
    model = helper.make_model(helper.make_graph(nodes, "two", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    return model


# ---------------------------------------------------------------------------------------------
# The lowering's choice


@pytest.mark.parametrize("precision", list(HALVES))
@pytest.mark.parametrize("block", ["bert", "llama"])
def test_half_plans_take_the_flash_step(sm, block, precision):
    model = retyped(bert_block(2, 77) if block == "bert" else llama_block(2, 77), HALVES[precision])
    for choice in ("flash", "auto"):  # auto: 77 queries and keys, over the half threshold
        ops = attention_ops(lowered(model, choice))
        assert [op.kind for op in ops] == ["flash_attention"], (choice, [op.kind for op in ops])
        assert ops[0].attrs["mma"] and not ops[0].attrs["tf32"]
    ops = attention_ops(lowered(model, "gemm"))
    assert [op.kind for op in ops] == ["bgemm", "softmax", "bgemm"]
    assert ops[0].attrs["flash_refused"] == "attention_kernel=gemm"


def test_half_plans_before_sm80_take_the_simt_body(sm):
    sm(75)
    prog = lowered(retyped(llama_block(1, 50), BF16))
    steps = [s for s in fuse.build_steps(prog) if s.kind == "flash_attention"]
    assert len(steps) == 1 and not steps[0].op.attrs["mma"]
    source, specs = codegen.generate(prog, steps)
    assert "fa_tile<fa_bf16, 64, 64>(" in source and "fa_tile_mma<" not in source
    assert specs[0].grid == (2, 8, 1)  # 32 query rows per SIMT block, 8 query heads, batch 1


def _attention(q, k, v, elems=(FP16, FP16, FP16), **attrs) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, e, list(s)) for n, e, s in zip("QKV", elems, (q, k, v))]
    graph = helper.make_graph([helper.make_node("Attention", ["Q", "K", "V"], ["Y"], name="attn", **attrs)], "a",
                              inputs, [helper.make_tensor_value_info("Y", elems[0], None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


GEMM_CASES = {  # name -> (model, option, the reason recorded)
    "head-24": (_attention((1, 2, 80, 24), (1, 2, 80, 24), (1, 2, 80, 24)), "flash",
                "head size 24; the fused kernel has 32, 64, 80, 96, 128"),
    "v-head-32": (_attention((1, 2, 80, 64), (1, 2, 80, 64), (1, 2, 80, 32)), "flash",
                  "V's head size 32 differs from Q's 64; the fused kernel keeps one"),
    "v-float32": (_attention((1, 2, 80, 64), (1, 2, 80, 64), (1, 2, 80, 64), (FP16, FP16, F32)), "flash",
                  "Q, K, V, Y of element types float16, float16, float32, float16; the fused kernel reads and "
                  "writes one type"),
    "auto-short": (_attention((1, 2, 80, 64), (1, 2, 40, 64), (1, 2, 40, 64)), "auto",
                   "attention_kernel=auto: 80 queries, 40 keys; the fused kernel from 64 queries and 64 keys"),
}


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_half_plans_keep_the_gemms_where_flash_does_not_compute_the_node(sm, case):
    model, choice, reason = GEMM_CASES[case]
    ops = attention_ops(lowered(model, choice))
    assert [op.kind for op in ops] == ["bgemm", "softmax", "bgemm"]
    assert ops[0].attrs["flash_refused"] == reason


@pytest.mark.parametrize("precision", list(HALVES))
def test_wrapper_declares_the_storage_types_and_reads_the_mask_in_its_type(sm, precision):
    prog = lowered(two_node_model(HALVES[precision]))
    steps = fuse.build_steps(prog)
    assert [s.kind for s in steps] == ["flash_attention", "flash_attention"]
    source, specs = codegen.generate(prog, steps, "ep_k")
    storage, body = ("half_bits", "fa_f16") if precision == "fp16" else ("bf16_bits", "fa_bf16")
    heads = [line for line in source.splitlines() if line.startswith('extern "C" __global__')]
    assert heads[0].count(f"const {storage}* __restrict__") == 4  # Q, K, V and the half mask
    assert heads[1].count(f"const {storage}* __restrict__") == 3 and "const float* __restrict__ p3" in heads[1]
    calls = [line for line in source.splitlines() if line.lstrip().startswith("fa_tile_mma<")]
    assert [c.split("(")[0].strip() for c in calls] == [f"fa_tile_mma<{body}, 32>"] * 2
    kinds = re.findall(r"^  fa_tile_mma<.*\n\s+(\d+),", source, re.M)
    assert kinds == ["3" if precision == "fp16" else "4", "2"]  # fa_mask kinds: the half mask, float32
    assert [s.grid for s in specs] == [(1, 2, 2), (1, 4, 1)]  # 64 query rows per tensor-core block


# ---------------------------------------------------------------------------------------------
# nvcc


def ptx(source: str, tmp_path, name: str, arch: str) -> str:
    src, out = tmp_path / f"{name}.cu", tmp_path / f"{name}.ptx"
    src.write_text(source)
    done = subprocess.run([NVCC, "-ptx", f"-arch={arch}", "-std=c++17", "-Xcicc", "-O1", str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out.read_text()


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("precision", list(HALVES))
def test_half_plan_module_compiles(sm, tmp_path, precision, arch):
    prog = lowered(two_node_model(HALVES[precision]))
    source, _ = codegen.generate(prog, fuse.build_steps(prog), "ep_k")
    text = ptx(source, tmp_path, "plan", arch)
    assert ".entry ep_k0(" in text and ".entry ep_k1(" in text
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{'f16.f16' if precision == 'fp16' else 'bf16.bf16'}.f32" in text


@needs_nvcc
@pytest.mark.parametrize("precision", list(HALVES))
def test_dynamic_half_plan_source_is_shared_by_signatures(sm, tmp_path, precision):
    """Batch and sequence as dim names: the flash step's sizes are the symbols' expressions, so two
    shape signatures give one source (one NVRTC compile), and it compiles."""
    spec = spec_from_onnx(retyped(bert_block("B", "S"), HALVES[precision]))
    ids = [spec.values.index(v) for v in spec.inputs]
    sources = []
    for b, s in ((2, 50), (3, 77)):
        with flash.kernel_choice("flash"):
            prog = lower.lower(specialize(spec, ids, [(b, s, 256), (b, 1, 1, s)]))
        steps = [st for st in fuse.build_steps(prog) if st.kind == "flash_attention"]
        assert len(steps) == 1 and steps[0].op.attrs["mma"]
        source, specs = codegen.generate(prog, steps, "ep_k")
        assert specs[0].grid == ((s + 63) // 64, 4, b)
        sources.append(source)
    assert sources[0] == sources[1] and "S1" in sources[0]
    assert ".entry ep_k0(" in ptx(sources[0], tmp_path, "dyn", "sm_80")


# ---------------------------------------------------------------------------------------------
# The generated steps on the CPU (bfloat16: float16's conversions are PTX, which the shim drops)

LAUNCH = r"""
#include <utility>
template <typename... A, std::size_t... I>
static void ep_invoke(void (*f)(A...), void** p, std::index_sequence<I...>) { f((A)p[I]...); }
extern "C" void launch(int kernel, int gx, int gy, int gz, void** p) {
  for (int z = 0; z < gz; ++z) for (int yb = 0; yb < gy; ++yb) for (int x = 0; x < gx; ++x) {
    std::barrier<> bar(128);
    ep_bar = &bar;
    std::vector<std::thread> threads;
    for (int t = 0; t < 128; ++t) threads.emplace_back([=] {
      threadIdx = {t, 0, 0}; blockIdx = {x, yb, z};
      switch (kernel) {
CASES
      }
    });
    for (auto& th : threads) th.join();
  }
}
"""


def build(prog, steps, tmp_path):
    from plugin_cuda.semantics.half import HALF_CUDA

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: cannot build the CPU shim of the flash kernel")
    source, specs = codegen.generate(prog, steps, "ep_k", prelude=False)
    cases = "\n".join(f"        case {i}: ep_invoke({s.name}, p, std::make_index_sequence<{len(s.params)}>{{}}); break;"
                      for i, s in enumerate(specs))
    (tmp_path / "plan.cpp").write_text(SHIM + HALF_CUDA + HOST_MMA + source + LAUNCH.replace("CASES", cases))
    done = subprocess.run([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o",
                           str(tmp_path / "plan.so"), str(tmp_path / "plan.cpp")], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 and "barrier" in done.stderr:
        pytest.skip(f"g++ lacks C++20 std::barrier: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(tmp_path / "plan.so")), specs


def feeds_for(prog, seed: int = 0) -> dict:
    """Normal Q, K, V; additive masks in (-2, 1) with the first key always kept and -inf entries."""
    rng = np.random.default_rng(seed)
    out = {}
    for vid in prog.inputs:
        v = prog.values[vid]
        if v.name.startswith("M"):
            x = rng.uniform(-2, 1, v.shape).astype(np.float32)
            x[..., 0] = 0.0
            x[..., 2::5] = -np.inf
        else:
            x = rng.standard_normal(v.shape).astype(np.float32)
        out[v.name] = x.astype(v.dtype)
    return out


def reference(feeds: dict, q, k, v, mask, heads: int | None, kv_heads: int | None, causal: bool) -> np.ndarray:
    """NumPy attention in float64 on the same rounded values, in Q's layout."""
    f = {n: feeds[n].astype(np.float64) for n in (q, k, v, mask)}
    to4 = (lambda x, h: x) if heads is None else (lambda x, h: x.reshape(x.shape[0], x.shape[1], h, -1)
                                                  .transpose(0, 2, 1, 3))
    q4, k4, v4 = to4(f[q], heads), to4(f[k], kv_heads), to4(f[v], kv_heads)
    m = f[mask]
    bias = m.reshape((1,) * (4 - m.ndim) + m.shape)
    if causal:
        bias = bias + np.where(np.tril(np.ones(bias.shape[2:], bool)), 0.0, -np.inf)
    want = numpy_attention(q4, k4, v4, bias, 1.0 / np.sqrt(q4.shape[-1]))
    return want if heads is None else want.transpose(0, 2, 1, 3).reshape(feeds[q].shape)


@pytest.mark.parametrize("capability", [90, 75], ids=["tensor-cores", "simt"])
def test_generated_bfloat16_steps_run_on_cpu_and_match_numpy(sm, tmp_path, capability):
    sm(capability)
    prog = lowered(two_node_model(BF16))
    steps = fuse.build_steps(prog)
    assert [s.op.attrs["mma"] for s in steps] == [capability >= 80] * 2
    lib, specs = build(prog, steps, tmp_path)
    feeds = feeds_for(prog)
    buffers = {vid: np.ascontiguousarray(feeds[prog.values[vid].name]) for vid in prog.inputs}
    buffers.update({vid: np.full(prog.values[vid].shape, np.nan, prog.values[vid].dtype) for vid in prog.outputs})
    for i, spec in enumerate(specs):
        ptrs = (ctypes.c_void_p * len(spec.params))(*(buffers[vid].ctypes.data for vid in spec.params))
        lib.launch(i, *(ctypes.c_int(g) for g in spec.grid), ptrs)
    got = [buffers[vid] for vid in prog.outputs]
    assert all(g.dtype == to_numpy(BF16) for g in got)
    wants = [reference(feeds, "Q", "K", "V", "M", 2, 2, False), reference(feeds, "Q4", "K4", "V4", "M4", None, None, True)]
    for name, g, w in zip(("bert", "llama"), got, wants):
        err = np.abs(g.astype(np.float64) - w).max()
        print(f"{name} sm_{capability}: max abs error {err:.2e}")
        # bfloat16 output (8-bit mantissa) of an O(1) average; on tensor cores P is rounded too
        assert err <= 1.6e-2, f"{name}: {err}"
