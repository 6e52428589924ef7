"""The fused (flash) attention kernel on a machine without a GPU: its CUDA C compiles for every dtype
and head size (nvcc -ptx, sm_90), a plan module with two flash steps compiles, the choice between
the fused kernel and the two-GEMM path (option attention_kernel, the lowering), and the layouts'
strides against NumPy's own. The numbers are GPU tests: tests/plugin_cuda/test_flash_attention.py."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from abi.dtypes import BFLOAT16_DTYPE
from plugin_cuda.kernels import flash_attention as flash
from plugin_cuda.kernels.attention import attention_plan
from plugin_cuda.kernels.flash_source import HEAD_SIZES, library_source
from plugin_cuda.options import OptionError, parse_options
from plugin_cuda.plan import codegen, fuse, lower
from plugin_cuda.plan.onnx_spec import spec_from_onnx
from tests.plugin_cuda.attention_models import attention_model

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA C cannot be compiled here")


def ptx(source: str, tmp_path, name: str) -> str:
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    out = tmp_path / f"{name}.ptx"
    # -Xcicc -O1: the front end and PTX code generation in full, without the slow optimiser passes
    # (CI time); NVRTC compiles with full optimisation at run time.
    done = subprocess.run([NVCC, "-ptx", "-arch=sm_90", "-std=c++17", "-Xcicc", "-O1", str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out.read_text()


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_library_compiles_for_every_head_size(dtype, tmp_path):
    text = ptx(library_source(dtype), tmp_path, dtype)
    for d in HEAD_SIZES:
        assert f".entry ephost_flash_d{d}(" in text
        assert (f".entry ephost_flash_mma_d{d}(" in text) == (dtype != "float32")  # tensor cores: half types


def test_library_refuses_other_dtypes():
    with pytest.raises(ValueError, match="^flash attention got dtype float64; allowed: float32, float16, bfloat16$"):
        library_source("float64")


def _plan(q=(2, 4, 100, 64), k=(2, 2, 300, 64), v=None, **kw):
    v = v or k
    return attention_plan(q, k, v, kw.get("mask"), np.float32, kw.get("qh"), kw.get("kvh"), kw.get("causal", 0),
                          None, 0.0, np.float32)


def test_choice_by_option_head_size_and_length():
    simt, tensor = flash.AUTO_MIN_KEYS["simt"], flash.AUTO_MIN_KEYS["tf32"]
    long = _plan(k=(2, 2, simt, 64))
    short = _plan(k=(2, 2, simt - 1, 64))
    assert flash.choose(long, "auto") and not flash.choose(short, "auto")
    # float32 under TF32, and the half types, run on tensor cores: their own threshold
    assert flash.choose(_plan(k=(2, 2, tensor, 64)), "auto", tf32=True)
    assert not flash.choose(_plan(k=(2, 2, tensor - 1, 64)), "auto", tf32=True)
    half_keys = flash.AUTO_MIN_KEYS["half"]
    half = attention_plan((1, 2, 64, 64), (1, 2, half_keys, 64), (1, 2, half_keys, 64), None, None, None, None, 0,
                          None, 0.0, np.float16)
    assert flash.choose(half, "auto") and flash.auto_kind(half) == "half"
    # one query (decoding) against many keys: auto keeps the GEMMs, flash is still allowed
    decode = _plan(q=(2, 4, flash.AUTO_MIN_QUERIES - 1, 64), k=(2, 2, 4 * simt, 64))
    assert not flash.choose(decode, "auto") and flash.choose(decode, "flash")
    assert flash.choose(short, "flash") and not flash.choose(long, "gemm")
    for d in (16, 48, 256):  # head sizes without an instantiation: the two GEMMs, whatever the option
        assert not flash.choose(_plan(q=(1, 2, 8, d), k=(1, 2, 4096, d)), "flash")
    for d in HEAD_SIZES:
        assert flash.choose(_plan(q=(1, 2, 8, d), k=(1, 2, 8, d)), "flash")
    # V's head size differs from Q's: the fused kernel keeps one head size
    assert not flash.choose(_plan(q=(1, 2, 8, 64), k=(1, 2, 4096, 64), v=(1, 2, 4096, 32)), "flash")
    with pytest.raises(ValueError, match="^attention_kernel 'fast'; allowed: auto, flash, gemm$"):
        flash.choose(long, "fast")


def test_option_parses_and_refuses():
    assert parse_options({}, 1).attention_kernel == "auto"
    assert parse_options({"ep.cuda.attention_kernel": "FLASH"}, 1).attention_kernel == "flash"
    with pytest.raises(OptionError, match="^option attention_kernel='fast': expected an attention kernel; "
                                          "allowed: auto, flash, gemm$"):
        parse_options({"attention_kernel": "fast"}, 1)


@pytest.mark.parametrize("seq_major", [False, True])
def test_strides_address_numpy_layouts(seq_major):
    b, hq, hkv, sq, skv, d = 2, 6, 3, 5, 7, 32
    if seq_major:
        plan = attention_plan((b, sq, hq * d), (b, skv, hkv * d), (b, skv, hkv * d), None, None, hq, hkv, 0, None,
                              0.0, np.float32)
        q = np.arange(b * sq * hq * d).reshape(b, sq, hq, d).transpose(0, 2, 1, 3)
        k = np.arange(b * skv * hkv * d).reshape(b, skv, hkv, d).transpose(0, 2, 1, 3)
    else:
        plan = _plan(q=(b, hq, sq, d), k=(b, hkv, skv, d))
        q = np.arange(b * hq * sq * d).reshape(b, hq, sq, d)
        k = np.arange(b * hkv * skv * d).reshape(b, hkv, skv, d)
    q_st, kv_st, y_st = flash.strides(plan)
    assert y_st == q_st  # Y has Q's layout
    for arr, (sb, sh, ss) in ((q, q_st), (k, kv_st)):
        for idx in [(0, 0, 0, 0), (1, 2, 3, 5), (1, arr.shape[1] - 1, arr.shape[2] - 1, d - 1)]:
            bb, hh, ii, dd = idx
            assert bb * sb + hh * sh + ii * ss + dd == arr[idx]


def lowered_kinds(model, choice: str) -> list:
    with flash.kernel_choice(choice):
        prog = lower.lower(spec_from_onnx(model))
    return [op.kind for op in prog.ops]


def test_lowering_follows_the_choice():
    model = attention_model((1, 2, 40, 32), (1, 2, 50, 32), (1, 2, 50, 32), (40, 50), {"is_causal": 1})
    assert lowered_kinds(model, "flash") == ["flash_attention"]
    assert lowered_kinds(model, "gemm") == ["bgemm", "softmax", "bgemm"]
    assert lowered_kinds(model, "auto") == ["bgemm", "softmax", "bgemm"]  # 50 keys: below AUTO_MIN_KEYS
    odd = attention_model((1, 2, 4, 24), (1, 2, 5, 24), (1, 2, 5, 24))  # head size 24: no instantiation
    assert lowered_kinds(odd, "flash") == ["bgemm", "softmax", "bgemm"]


@needs_nvcc
@pytest.mark.parametrize("tf32", [False, True])
def test_plan_module_with_two_flash_steps_compiles(tmp_path, monkeypatch, tf32):
    """Two attention nodes in one plan: the shared body is defined once, each step's wrapper bakes
    its sizes (3-D GQA with a broadcast mask; 4-D causal); with use_tf32 on an sm_90 device, the
    TF32 tensor-core body."""
    monkeypatch.setattr(flash, "_capability", lambda: 90)
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y1"], q_num_heads=4, kv_num_heads=2),
             helper.make_node("Attention", ["Q4", "K4", "V4"], ["Y2"], is_causal=1)]
    shapes = {"Q": (2, 33, 4 * 80), "K": (2, 47, 2 * 80), "V": (2, 47, 2 * 80), "M": (2, 1, 1, 47),
              "Q4": (1, 3, 70, 128), "K4": (1, 3, 70, 128), "V4": (1, 3, 70, 128)}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in shapes.items()]
    outputs = [helper.make_tensor_value_info("Y1", TensorProto.FLOAT, [2, 33, 320]),
               helper.make_tensor_value_info("Y2", TensorProto.FLOAT, [1, 3, 70, 128])]
    model = helper.make_model(helper.make_graph(nodes, "two", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    with flash.kernel_choice("flash", tf32):
        prog = lower.lower(spec_from_onnx(model))
    steps = fuse.build_steps(prog)
    assert [s.kind for s in steps] == ["flash_attention", "flash_attention"]
    source, specs = codegen.generate(prog, steps, "ep_k")
    # (query tiles, heads, batch): 32 query rows per SIMT block, 64 per TF32 one
    assert [spec.grid for spec in specs] == ([(1, 4, 2), (2, 3, 1)] if tf32 else [(2, 4, 2), (3, 3, 1)])
    assert source.count("fa_tile_tf32<") == (2 if tf32 else 0)  # one call per step
    text = ptx(source, tmp_path, "plan")
    assert ".entry ep_k0(" in text and ".entry ep_k1(" in text


# ---- the kernel's logic on the CPU ---------------------------------------------------------------
# The float32 library compiled by g++ behind a shim: one std::thread per CUDA thread of a block,
# std::barrier for __syncthreads and for the half-warp shuffles (every thread of a block reaches
# each of them), static arrays for __shared__. Slow, so the cases are small; the GPU tests cover
# the sizes, the half types and the speed.
SHIM = r"""
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstring>
#include <algorithm>
using std::min;
struct ep_dim3 { int x, y, z; };
static thread_local ep_dim3 threadIdx, blockIdx;
static std::barrier<>* ep_bar;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define asm(...)
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline void __syncthreads() { ep_bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
  static float buf[128];
  buf[threadIdx.x] = v; ep_bar->arrive_and_wait();
  const float r = buf[threadIdx.x ^ off]; ep_bar->arrive_and_wait();
  return r;
}
"""
HOST_MMA = r"""
// mma.sync m16n8k16 of one warp: every thread posts its fragments, then computes its 4 accumulators.
static unsigned ep_frag[128][6];
template <typename T>
static void fa_mma_host(T, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const int me = threadIdx.x, lane = me & 31, w0 = me - lane, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) ep_frag[me][i] = a[i];
  ep_frag[me][4] = b0; ep_frag[me][5] = b1;
  ep_bar->arrive_and_wait();
  auto half = [](unsigned reg, int hi) { T v; v.b = (unsigned short)(hi ? reg >> 16 : reg & 0xffffu); return fa_to_f(v); };
  for (int x = 0; x < 4; ++x) {
    const int row = g + 8 * (x >> 1), col = 2 * t + (x & 1);
    float acc = 0.0f;
    for (int kk = 0; kk < 16; ++kk) {
      const int al = w0 + (row & 7) * 4 + (kk & 7) / 2, areg = (row >= 8) + 2 * (kk >= 8);
      const int bl = w0 + col * 4 + (kk & 7) / 2, breg = 4 + (kk >= 8);
      acc += half(ep_frag[al][areg], kk & 1) * half(ep_frag[bl][breg], kk & 1);
    }
    c[x] += acc;
  }
  ep_bar->arrive_and_wait();
}
// mma.sync m16n8k8 with TF32 operands (their bits in float registers).
static void fa_mma_tf32_host(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const int me = threadIdx.x, lane = me & 31, w0 = me - lane, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) ep_frag[me][i] = a[i];
  ep_frag[me][4] = b0; ep_frag[me][5] = b1;
  ep_bar->arrive_and_wait();
  for (int x = 0; x < 4; ++x) {
    const int row = g + 8 * (x >> 1), col = 2 * t + (x & 1);
    float acc = 0.0f;
    for (int kk = 0; kk < 8; ++kk) {
      const int al = w0 + (row & 7) * 4 + (kk & 3), areg = (row >= 8) + 2 * (kk >= 4);
      const int bl = w0 + col * 4 + (kk & 3), breg = 4 + (kk >= 4);
      acc += __uint_as_float(ep_frag[al][areg]) * __uint_as_float(ep_frag[bl][breg]);
    }
    c[x] += acc;
  }
  ep_bar->arrive_and_wait();
}
"""
LAUNCH = r"""
extern "C" void launch(int kernel, int gx, int gy, int gz, const T* q, const T* k, const T* v, const void* mask,
    T* y, const fa_i64* st, int mask_kind, int mask_len, int group, int sq, int skv, int causal, float scale,
    float softcap) {
  for (int z = 0; z < gz; ++z) for (int yb = 0; yb < gy; ++yb) for (int x = 0; x < gx; ++x) {
    std::barrier<> bar(128);
    ep_bar = &bar;
    std::vector<std::thread> threads;
    for (int t = 0; t < 128; ++t) threads.emplace_back([=] {
      threadIdx = {t, 0, 0}; blockIdx = {x, yb, z};
#define EP_ARGS q, k, v, mask, y, st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9], st[10], \
    st[11], mask_kind, mask_len, group, sq, skv, causal, scale, softcap
      switch (kernel) {
CASES
      }
    });
    for (auto& th : threads) th.join();
  }
}
"""


VARIANTS = ("", "mma_", "tf32_")  # SIMT, half tensor cores, TF32 tensor cores


def kernel_index(variant: str, head: int) -> int:
    return VARIANTS.index(variant) * len(HEAD_SIZES) + HEAD_SIZES.index(head)


def build_shim(tmp, dtype: str):
    import ctypes

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: cannot build the CPU shim of the flash kernel")
    variants = ("", "tf32_") if dtype == "float32" else ("", "mma_")
    cases = "\n".join(f"        case {kernel_index(v, d)}: ephost_flash_{v}d{d}(EP_ARGS); break;"
                      for v in variants for d in HEAD_SIZES)
    source = SHIM + library_source(dtype, HOST_MMA) + LAUNCH.replace("CASES", cases)
    (tmp / f"{dtype}.cpp").write_text(source)
    done = subprocess.run([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(tmp / f"{dtype}.so"),
                           str(tmp / f"{dtype}.cpp")], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "barrier" in done.stderr:
        pytest.skip(f"g++ lacks C++20 std::barrier: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(tmp / f"{dtype}.so"))


@pytest.fixture(scope="module")
def cpu_flash(tmp_path_factory):
    """The float32 kernels: SIMT and TF32 tensor cores (MMA emulated)."""
    return build_shim(tmp_path_factory.mktemp("flash"), "float32")


@pytest.fixture(scope="module")
def cpu_flash_mma(tmp_path_factory):
    """The bfloat16 tensor-core kernels, their MMA emulated (float16's conversions are PTX)."""
    return build_shim(tmp_path_factory.mktemp("flash_mma"), "bfloat16")


def numpy_attention(q4, k4, v4, bias, scale, softcap=0.0):
    """softmax(softcap(scale Q K^T) + bias) V in float64 per (B, H); K, V heads repeated for GQA;
    rows with no key kept give zeros (the ONNX reference's rule)."""
    g = q4.shape[1] // k4.shape[1]
    k4, v4 = np.repeat(k4, g, axis=1), np.repeat(v4, g, axis=1)
    s = scale * np.einsum("bhid,bhjd->bhij", q4.astype(np.float64), k4.astype(np.float64))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = s + bias
    m = s.max(-1, keepdims=True)
    e = np.where(np.isneginf(m), 0.0, np.exp(s - np.where(np.isneginf(m), 0.0, m)))
    p = e / np.where(e.sum(-1, keepdims=True) == 0, 1.0, e.sum(-1, keepdims=True))
    return np.einsum("bhij,bhjd->bhid", p, v4.astype(np.float64))


def run_cpu(lib, plan, q, k, v, mask, variant=""):
    import ctypes

    y = np.full(plan.out_shape, np.nan, plan.dtype)
    st = np.array([s for group in flash.strides(plan) for s in group] + list(plan.mask_strides[:3]), np.int64)
    ptr = ctypes.c_void_p
    kind = plan.mask_kind if mask is not None else 0
    lib.launch(ctypes.c_int(kernel_index(variant, plan.head)), *(ctypes.c_int(g) for g in flash.grid(plan, variant != "")),
               *(ptr(a.ctypes.data) for a in (q, k, v)), ptr(mask.ctypes.data if mask is not None else 0),
               ptr(y.ctypes.data), ptr(st.ctypes.data), *(ctypes.c_int(x) for x in (
                   kind, plan.mask_len, plan.q_heads // plan.kv_heads, plan.q_len, plan.kv_len, int(plan.causal))),
               ctypes.c_float(plan.scale), ctypes.c_float(plan.softcap))
    return y.astype(np.float32)


CPU_CASES = {  # name -> (Q, K, V shapes, mask shape, mask dtype, q heads, kv heads, causal, softcap)
    "4d-causal-gqa-bool": ((1, 4, 37, 32), (1, 2, 70, 32), (1, 2, 70, 32), (1, 4, 37, 70), np.bool_, None, None, 1,
                           0.0),
    "3d-padded-float-mask": ((2, 33, 2 * 80), (2, 45, 2 * 80), (2, 45, 2 * 80), (33, 40), np.float32, 2, 2, 0, 0.0),
    "4d-d128-softcap-sq>skv": ((1, 1, 40, 128), (1, 1, 9, 128), (1, 1, 9, 128), None, None, None, None, 1, 3.0),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_kernel_logic_on_cpu_matches_numpy(cpu_flash, case):
    check_on_cpu(cpu_flash, case, np.float32, "", 1e-5)


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_tf32_kernel_logic_on_cpu_matches_numpy(cpu_flash, case):
    """float32 inputs rounded to TF32 (10-bit mantissa) in both products: a few 1e-3 of an O(1) result."""
    check_on_cpu(cpu_flash, case, np.float32, "tf32_", 5e-3)


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_tensor_core_kernel_logic_on_cpu_matches_numpy(cpu_flash_mma, case):
    """bfloat16 inputs (the reference takes the same rounded values); P is rounded to bfloat16 before
    P V, and Y on output: a few bfloat16 ulps of an O(1) result."""
    check_on_cpu(cpu_flash_mma, case, BFLOAT16_DTYPE, "mma_", 1e-2)


@pytest.mark.parametrize("variant", ["", "tf32_", "mma_"])
def test_unaligned_rows_take_the_scalar_loads(cpu_flash, cpu_flash_mma, variant):
    """Q, K, V one element past a 16-byte boundary: the tile loaders' element-wise paths."""
    lib, dtype = (cpu_flash_mma, BFLOAT16_DTYPE) if variant == "mma_" else (cpu_flash, np.float32)
    check_on_cpu(lib, "3d-padded-float-mask", dtype, variant, 1e-5 if variant == "" else 1e-2, shift=1)


def _shifted(x, shift: int):
    """`x` copied into a buffer `shift` elements past its start (an address off 16-byte alignment)."""
    buf = np.empty(x.size + shift, x.dtype)
    out = buf[shift:].reshape(x.shape)
    out[...] = x
    return out


def check_on_cpu(lib, case, dtype, variant, atol, shift=0):
    qs, ks, vs, ms, mdt, hq, hkv, causal, softcap = CPU_CASES[case]
    rng = np.random.default_rng(0)
    q, k, v = (_shifted(rng.standard_normal(s).astype(np.float32).astype(dtype), shift) for s in (qs, ks, vs))
    mask = None
    if ms is not None:
        mask = rng.random(ms) > 0.3 if mdt == np.bool_ else rng.uniform(-2, 1, ms).astype(np.float32)
        mask[..., 0] = True if mdt == np.bool_ else 0.0
    plan = attention_plan(qs, ks, vs, ms, mdt, hq, hkv, causal, None, softcap, dtype)
    got = run_cpu(lib, plan, q, k, v, mask, variant)
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    # The reference in (B, H, S, D), the bias from the mask (padded) and the causal frontier.
    to4 = (lambda x, h: x) if len(qs) == 4 else (lambda x, h: x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3))
    q4, k4, v4 = to4(q, hq), to4(k, hkv), to4(v, hkv)
    sq, skv = q4.shape[2], k4.shape[2]
    bias = np.zeros((1, 1, sq, skv))
    if mask is not None:
        m = np.where(mask, 0.0, -np.inf) if mdt == np.bool_ else mask.astype(np.float64)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        bias = bias + np.concatenate([m, np.full(m.shape[:3] + (skv - m.shape[3],), -np.inf)], axis=3)
    if causal:
        bias = bias + np.where(np.tril(np.ones((sq, skv), bool)), 0.0, -np.inf)
    want = numpy_attention(q4, k4, v4, bias, plan.scale, softcap)
    if len(qs) == 3:
        want = want.transpose(0, 2, 1, 3).reshape(plan.out_shape)
    print(f"{case} {variant or 'simt'} {np.dtype(dtype)}: max abs error {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


@needs_nvcc
def test_symbolic_plan_source_is_shared_by_signatures(tmp_path):
    """Dynamic batch and sequence: the flash step's sizes are the symbols' expressions, so two shape
    signatures give one source (one NVRTC compile), and it compiles."""
    from onnx import TensorProto, helper

    from plugin_cuda.plan.signatures import specialize

    dims = ["B", 2, "S", 64]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in ("Q", "K", "V")]
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=1)
    graph = helper.make_graph([node], "dyn", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, dims)])
    spec = spec_from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    ids = [spec.values.index(v) for v in spec.inputs]
    sources = []
    for b, s in ((2, 100), (3, 77)):
        with flash.kernel_choice("flash"):
            prog = lower.lower(specialize(spec, ids, [(b, 2, s, 64)] * 3))
        steps = fuse.build_steps(prog)
        assert [st.kind for st in steps] == ["flash_attention"]
        source, specs = codegen.generate(prog, steps, "ep_k")
        assert specs[0].grid == ((s + 31) // 32, 2, b)
        sources.append(source)
    assert sources[0] == sources[1] and "S1" in sources[0]
    assert ".entry ep_k0(" in ptx(sources[0], tmp_path, "dyn")
