"""The fused (flash) attention kernel on a machine without a GPU: its CUDA C compiles for every dtype
and head size (nvcc -ptx, sm_90), a plan module with two flash steps compiles, the choice between
the fused kernel and the two-GEMM path (option attention_kernel, the lowering), and the layouts'
strides against NumPy's own. The numbers are GPU tests: tests/plugin_cuda/test_flash_attention.py."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

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
    done = subprocess.run([NVCC, "-ptx", "-arch=sm_90", "-std=c++17", str(src), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out.read_text()


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_library_compiles_for_every_head_size(dtype, tmp_path):
    text = ptx(library_source(dtype), tmp_path, dtype)
    for d in HEAD_SIZES:
        assert f".entry ephost_flash_d{d}(" in text


def test_library_refuses_other_dtypes():
    with pytest.raises(ValueError, match="^flash attention got dtype float64; allowed: float32, float16, bfloat16$"):
        library_source("float64")


def _plan(q=(2, 4, 100, 64), k=(2, 2, 300, 64), v=None, **kw):
    v = v or k
    return attention_plan(q, k, v, kw.get("mask"), np.float32, kw.get("qh"), kw.get("kvh"), kw.get("causal", 0),
                          None, 0.0, np.float32)


def test_choice_by_option_head_size_and_length():
    long = _plan(k=(2, 2, flash.AUTO_MIN_KEYS, 64))
    short = _plan(k=(2, 2, flash.AUTO_MIN_KEYS - 1, 64))
    assert flash.choose(long, "auto") and not flash.choose(short, "auto")
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
def test_plan_module_with_two_flash_steps_compiles(tmp_path):
    """Two attention nodes in one plan: the shared body is defined once, each step's wrapper bakes
    its sizes (3-D GQA with a broadcast mask; 4-D causal)."""
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
    with flash.kernel_choice("flash"):
        prog = lower.lower(spec_from_onnx(model))
    steps = fuse.build_steps(prog)
    assert [s.kind for s in steps] == ["flash_attention", "flash_attention"]
    source, specs = codegen.generate(prog, steps, "ep_k")
    assert specs[0].grid == (2, 4, 2) and specs[1].grid == (3, 3, 1)  # (query tiles, heads, batch)
    text = ptx(source, tmp_path, "plan")
    assert ".entry ep_k0(" in text and ".entry ep_k1(" in text
