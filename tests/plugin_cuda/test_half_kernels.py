"""The CUDA plugin's per-node kernels in float16 and bfloat16 (issue 24, the per-node path).

Every op the CUDA EP claims in float32 is claimed in both half types too (checked on the registry,
without a GPU); the elementwise, reduction, normalisation, attention, rotary, GEMM and data-movement
tests of test_kernels*.py run in float32, float16 and bfloat16 (their `BOTH` parameter). This file
adds what those do not cover:

- CPU: the registry's float ops claim both half types; the half-converted fixtures (`ephost convert`
  of BERT and Llama) have every data node claimable by the CUDA kernels; cuBLAS types (FP32 compute
  on 16-bit data: tensor cores); the raw kernels' bfloat16 source;
- GPU: Cast between every pair of float32/float16/bfloat16/int/bool types (against NumPy and
  ml_dtypes' own conversions); the fused kernels on odd sizes; the fused kernels captured in a CUDA
  graph and replayed on new values in both half types; four transformer fixtures converted to float16
  and bfloat16, run node by node (compiled_plan=0) fully on the CUDA EP, outputs of the declared
  half type, close to onnxruntime CPU on the float32 model (max |diff| / max |ref| <= 2e-2, issue 24's
  goal), and captured with enable_cuda_graph=1 then replayed on new inputs.

References are float32 computations (the ONNX reference evaluator, NumPy, onnxruntime CPU) on the same
half-rounded inputs: onnxruntime's CPU provider has no bfloat16 kernels.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from plugin_cuda import kernels
from plugin_cuda.kernels import base
from tests.models import load
from tests.plugin_cuda.test_kernels import BF16, F16, F32, check, rand, run_kernel
from tests.plugin_cuda.test_kernels_fused import CAPTURED, MemoContext, layer_norm_ref, reference_any

gpu = pytest.mark.gpu
HALVES = pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
HALF_TOL = {np.dtype(F16): dict(rtol=2e-2, atol=2e-2), np.dtype(BF16): dict(rtol=4e-2, atol=4e-2)}
CUDA = "CUDAExecutionProvider"
INT64 = TensorProto.INT64
PRECISIONS = {"fp16": np.dtype(F16), "bf16": np.dtype(BF16)}

# ---------------------------------------------------------------------------------------------
# CPU: claims


def float_kernels() -> list[str]:
    """Registry keys of the kernels whose first input takes float32."""
    out = []
    for key, versions in kernels.KERNELS.items():
        types = versions[max(versions)].input_types
        if versions[max(versions)].__module__.rsplit(".", 1)[-1].startswith("quant"):
            continue  # the quantized ops: float32 data and scales only (docs/quantization_ml.md)
        if types and types[0] is not None and "float32" in types[0]:
            out.append(key)
    return sorted(out)


def test_every_float_op_takes_both_half_types():
    ops = float_kernels()
    assert len(ops) > 60, ops  # the registry, not an empty list
    for key in ops:
        for version, cls in kernels.KERNELS[key].items():
            for position, types in enumerate(cls.input_types):
                if types is not None and "float32" in types:
                    assert {"float16", "bfloat16"} <= types, f"{key} (since {version}) input {position}: {sorted(types)}"


@pytest.mark.parametrize("op_type,attrs,dtypes,opset,domain,expected", [
    ("Add", {}, [TensorProto.BFLOAT16] * 2, 14, "", True),
    ("Add", {}, [TensorProto.BFLOAT16, TensorProto.FLOAT16], 14, "", False),  # mixed types are not one T
    ("MatMul", {}, ["bfloat16"] * 2, 13, "", True),
    ("Gemm", {}, ["bfloat16"] * 3, 13, "", True),
    ("Softmax", {}, ["bfloat16"], 13, "", True),
    ("ReduceMean", {}, ["bfloat16", "int64"], 18, "", True),
    ("LayerNormalization", {}, ["bfloat16"] * 3, 17, "", True),
    ("RMSNormalization", {}, ["bfloat16"] * 2, 23, "", True),
    ("SkipLayerNormalization", {}, ["float16"] * 4, 1, "ai.ephost", True),
    ("SkipLayerNormalization", {}, ["bfloat16"] * 4, 1, "ai.ephost", True),
    ("BiasGelu", {}, ["bfloat16"] * 2, 1, "ai.ephost", True),
    ("FusedMatMul", {"activation": "GeluTanh"}, ["bfloat16"] * 3, 1, "ai.ephost", True),
    ("Attention", {}, ["bfloat16"] * 3 + ["bfloat16"], 23, "", True),
    ("Attention", {}, ["bfloat16"] * 3 + ["bool"], 23, "", True),
    ("Attention", {}, ["bfloat16", "float16", "bfloat16"], 23, "", False),
    ("RotaryEmbedding", {}, ["bfloat16"] * 3 + ["int64"], 23, "", True),
    ("Gelu", {"approximate": "tanh"}, ["bfloat16"], 20, "", True),
    ("Cast", {"to": TensorProto.BFLOAT16}, ["float16"], 19, "", True),
    ("Cast", {"to": TensorProto.FLOAT16}, ["bfloat16"], 19, "", True),
    ("Cast", {"to": TensorProto.INT64}, ["bfloat16"], 19, "", True),
    ("Cast", {"to": TensorProto.DOUBLE}, ["bfloat16"], 19, "", False),  # no float64 kernels
    ("Conv", {}, ["bfloat16"] * 3, 11, "", True),
    ("Add", {}, ["float64"] * 2, 14, "", False),
])
def test_half_claims(op_type, attrs, dtypes, opset, domain, expected):
    assert kernels.claimable(op_type, attrs, dtypes, opset, domain=domain, num_outputs=1) is expected


def test_cast_to_an_unsupported_type_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"^Cast node 'n': attribute 'to' is 11; allowed: 1 \(float\), 10 "
                                         r"\(float16\), 16 \(bfloat16\), 6 \(int32\), 7 \(int64\), 9 \(bool\)"):
        kernels.lookup("Cast", 19)({"to": TensorProto.DOUBLE}, 19, "n")


def test_half_gemms_are_fp32_compute_on_16_bit_data():
    """cublasGemmEx with CUDA_R_16F / CUDA_R_16BF data and CUBLAS_COMPUTE_32F: tensor cores, float32 sums."""
    from plugin_cuda.device import cublas

    assert cublas.gemm_types(np.dtype(F16), True) == (2, 68)  # CUDA_R_16F, CUBLAS_COMPUTE_32F
    assert cublas.gemm_types(np.dtype(BF16), True) == (14, 68)  # CUDA_R_16BF, CUBLAS_COMPUTE_32F
    with pytest.raises(ValueError, match=r"^cuBLAS GEMM got dtype float64; allowed: float32, float16, bfloat16$"):
        cublas.gemm_types(np.dtype(np.float64), False)


def test_raw_kernels_have_a_bfloat16_type():
    from plugin_cuda.kernels import attention, fused

    for body in (fused.SOURCE, attention.SOURCE):
        text = fused.source_for(body, BF16)
        assert "typedef bf16_bits T;" in text and "struct bf16_bits" in text
    assert attention.attention_plan((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), (3, 3), BF16, None, None, False,
                                    None, None, BF16).mask_kind == attention.MASK_BF16
    assert base.is_half(np.dtype(BF16)) and base.is_half(np.dtype(F16)) and not base.is_half(np.dtype(F32))
    assert base.dtype_name(TensorProto.BFLOAT16) == "bfloat16" and base.numpy_dtype("bfloat16") == np.dtype(BF16)


def converted(name: str, precision: str):
    from host.precision import convert_precision

    path, feeds, _ = load(name)
    return path, convert_precision(onnx.load(str(path)), precision), feeds


def unclaimed_data_nodes(graph) -> list[str]:
    """Nodes of a session's graph that the CUDA kernels would not claim, other than shape arithmetic
    (nodes the host evaluates, and int64 results, which capture's ALLOW_CPU_FOR_SHAPES allows)."""
    out = []
    for index, node in enumerate(graph.nodes):
        if index in graph.shape_nodes or all(graph.values[v].elem_type == INT64 for v in node.outputs if v):
            continue
        dtypes = [graph.values[v].elem_type if v else None for v in node.inputs]
        if not kernels.claimable(node.op_type, node.attrs, dtypes, node.opset, domain=node.domain,
                                 num_outputs=len(node.outputs)):
            out.append(f"{node.name} ({node.op_type}: {dtypes})")
    return out


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", ["bert_torchscript", "llama_dynamo"])
def test_converted_fixtures_are_claimed_whole(name, precision):
    """The optimized half graph (the CPU session builds the same one) has no data node the CUDA kernels
    refuse: issue 24 found float16 SkipLayerNormalization left to the CPU EP, which refuses capture."""
    from host.runtime.session import InferenceSession

    _, model, _ = converted(name, precision)
    session = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in session.graph.nodes}
    assert "SkipLayerNormalization" in ops or "RMSNormalization" in ops, ops  # the fusions happened
    assert unclaimed_data_nodes(session.graph) == []
    session.close()


# ---------------------------------------------------------------------------------------------
# GPU: Cast, odd sizes, capture


CAST_TYPES = [np.dtype(F32), np.dtype(F16), np.dtype(BF16), np.dtype(np.int32), np.dtype(np.int64),
              np.dtype(np.bool_)]
ONNX_OF = {np.dtype(F32): 1, np.dtype(F16): 10, np.dtype(BF16): 16, np.dtype(np.int32): 6,
           np.dtype(np.int64): 7, np.dtype(np.bool_): 9}


@gpu
@pytest.mark.parametrize("to", CAST_TYPES, ids=str)
@pytest.mark.parametrize("src", CAST_TYPES, ids=str)
def test_cast_between_all_types(cp, src, to):
    if src.kind == "b":
        x = np.random.default_rng(1).random(37) < 0.5
    else:
        x = np.random.default_rng(1).uniform(-100, 100, size=37).astype(F32)
        x[:4] = [0.0, -0.0, 1.5, -2.5]
        x = x.astype(src)
    got = run_kernel(cp, "Cast", [x], {"to": ONNX_OF[to]}, 19)[0]
    assert got.dtype == to
    # NumPy / ml_dtypes convert float -> int by truncation, half <-> half through float32 (exact).
    want = x.astype(F32).astype(to) if src.kind != "b" and to.kind in "fbV" else x.astype(to)
    np.testing.assert_array_equal(got.astype(F32) if to.kind == "V" else got,
                                  want.astype(F32) if to.kind == "V" else want, err_msg=f"{src} -> {to}")


@gpu
@HALVES
@pytest.mark.parametrize("rows,n", [(3, 1001), (5, 769), (1, 1), (7, 4097)], ids=str)
def test_norms_and_softmax_on_odd_sizes(cp, rows, n, dtype):
    x, scale, bias = rand(rows, n, low=-3, high=5), rand(n, seed=1), rand(n, seed=2)
    tol = HALF_TOL[np.dtype(dtype)]
    xh, sh, bh = (v.astype(dtype) for v in (x, scale, bias))
    got = run_kernel(cp, "LayerNormalization", [xh, sh, bh], {"epsilon": 1e-3}, 17)[0]
    assert got.dtype == dtype
    want = layer_norm_ref(xh.astype(F32), sh.astype(F32), bh.astype(F32), -1, 1e-3)
    np.testing.assert_allclose(got.astype(F32), want, **tol, err_msg="LayerNormalization")
    got = run_kernel(cp, "RMSNormalization", [xh, sh], {"epsilon": 1e-3}, 23)[0]
    want = layer_norm_ref(xh.astype(F32), sh.astype(F32), None, -1, 1e-3, rms=True)
    np.testing.assert_allclose(got.astype(F32), want, **tol, err_msg="RMSNormalization")
    check(cp, "Softmax", [x], {"axis": -1}, 13, dtype, tol=dict(rtol=4e-2, atol=1e-3))
    check(cp, "ReduceSum", [x, np.array([1], np.int64)], {}, 13, dtype, tol=dict(rtol=4e-2, atol=0.5))


@gpu
@HALVES
@pytest.mark.parametrize("a_shape,b_shape", [((17, 33), (33, 9)), ((3, 17, 33), (33, 9)), ((2, 3, 7, 5), (2, 3, 5, 11)),
                                             ((1, 1), (1, 1)), ((129, 65), (65, 257))], ids=str)
def test_matmul_on_odd_sizes(cp, cublas_handle, a_shape, b_shape, dtype):
    a, b = rand(*a_shape, seed=1, low=-1, high=1).astype(dtype), rand(*b_shape, seed=2, low=-1, high=1).astype(dtype)
    got = run_kernel(cp, "MatMul", [a, b], {}, 13, cublas_handle)[0]
    assert got.dtype == dtype
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    # float32 sums of K products of half values: the error is the output's rounding, not K's.
    np.testing.assert_allclose(got.astype(F32), want, **HALF_TOL[np.dtype(dtype)])


@gpu
@HALVES
def test_attention_on_odd_sizes(cp, cublas_handle_fp32, dtype):
    q, k, v = rand(2, 3, 13, 24, seed=1), rand(2, 3, 29, 24, seed=2), rand(2, 3, 29, 40, seed=3)
    mask = rand(13, 29, seed=4, low=-2, high=1)
    check(cp, "Attention", [q, k, v, mask], {"is_causal": 1}, 23, dtype, handle=cublas_handle_fp32,
          tol=HALF_TOL[np.dtype(dtype)])


def _halved(inputs, dtype):
    return [x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype == F32 else x for x in inputs]


def _upcast(inputs):
    return [x.astype(F32) if isinstance(x, np.ndarray) and x.dtype in (np.dtype(F16), np.dtype(BF16)) else x
            for x in inputs]


@gpu
@HALVES
@pytest.mark.parametrize("op_type,domain,opset,make,attrs,count", CAPTURED, ids=[c[0] + str(i)
                                                                                for i, c in enumerate(CAPTURED)])
def test_half_kernels_capture_and_replay(cp, op_type, domain, opset, make, attrs, count, dtype):
    """The fused kernels in half precision record into a CUDA graph (thread-local mode: an allocation
    or a synchronising call fails the capture) and the replay computes new values."""
    from plugin_cuda.device.cublas import CublasHandle

    stream = cp.cuda.Stream(non_blocking=True)
    cls = kernels.lookup(op_type, opset, domain)
    kernel = cls(attrs, opset, f"captured_{op_type}")
    first = _halved(make(), dtype)
    with stream:
        handle = CublasHandle(stream.ptr, use_tf32=False)
        try:
            ctx = MemoContext(cp, first, handle, count, cls.host_inputs)
            kernel.compute(ctx)
            stream.synchronize()
            stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeThreadLocal)
            try:
                kernel.compute(ctx)
            finally:
                graph = stream.end_capture()
            second = [x if not isinstance(x, np.ndarray) or x.dtype != dtype else
                      (x.astype(F32) * 0.5 - 0.25).astype(dtype) for x in first]
            for dev, new in zip(ctx.inputs, second):
                if dev is not None and not isinstance(dev, np.ndarray):
                    dev.set(np.ascontiguousarray(new))
            for out in ctx.outputs.values():
                out.fill(0)
            stream.synchronize()
            graph.launch(stream)
            stream.synchronize()
        finally:
            handle.close()
    want = reference_any(op_type, domain, _upcast(second), attrs, opset, count)
    for i in range(count):
        got = cp.asnumpy(ctx.outputs[i])
        if i == 0:
            assert got.dtype == dtype, f"{op_type}: output {got.dtype}, declared {np.dtype(dtype)}"
        np.testing.assert_allclose(got.astype(F32), np.asarray(want[i], F32), **HALF_TOL[np.dtype(dtype)],
                                   err_msg=f"{op_type} output {i} after replay")


# ---------------------------------------------------------------------------------------------
# GPU: converted transformer fixtures on the per-node kernels


MODELS = ["bert_torchscript", "gpt2_dynamo", "llama_dynamo", "vit_dynamo"]
# Issue 24's accuracy goal. The CPU EP rounding every value to its declared type, as the per-node GPU
# path does (EPHOST_HALF_ROUNDING=node), is within 1.4e-3 (float16) and 9.4e-3 (bfloat16) on these four.
MODEL_TOL = {"fp16": 2e-2, "bf16": 2e-2}
KERNELS_ONLY = {"compiled_plan": "0", "use_tf32": "0"}  # the per-node kernels (plans: test_half_plans.py)


def half_feeds(feeds: dict, dtype) -> dict:
    return {k: v.astype(dtype) if v.dtype == F32 else v for k, v in feeds.items()}


def ort_float32(path, feeds):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime CPU is the float32 reference")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def relative_error(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-12))


@gpu
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", MODELS)
def test_half_model_runs_on_cuda(cp, genv, name, precision):
    from host.runtime.session import InferenceSession
    from tests.plugin_cuda.test_real_models import off_cuda_data_nodes

    dtype = PRECISIONS[precision]
    path, model, feeds = converted(name, precision)
    feeds = half_feeds(feeds, dtype)
    want = ort_float32(path, {k: v.astype(F32) if v.dtype == dtype else v for k, v in feeds.items()})
    session = InferenceSession(model.SerializeToString(), providers=[(CUDA, KERNELS_ONLY)], env=genv)
    got = session.run(None, feeds)
    assert off_cuda_data_nodes(session) == [], f"{name} {precision}: data nodes off the CUDA EP"
    for meta, g, w in zip(session.get_outputs(), got, want):
        if np.asarray(w).dtype == F32:
            assert g.dtype == dtype, f"{meta.name}: {g.dtype}, declared {meta.type}"
            assert relative_error(g, w) <= MODEL_TOL[precision], f"{name} {precision} {meta.name}"
    session.close()


@gpu
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", MODELS)
def test_half_model_captures_and_replays(cp, genv, name, precision):
    from host.runtime.session import InferenceSession
    from tests.plugin_cuda.test_real_models import new_feeds

    dtype = PRECISIONS[precision]
    _, model, feeds = converted(name, precision)
    feeds = half_feeds(feeds, dtype)
    data = model.SerializeToString()
    eager = InferenceSession(data, providers=[(CUDA, KERNELS_ONLY)], env=genv)
    names = [o.name for o in eager.get_outputs()]
    first = eager.run(None, feeds)
    second_feeds = new_feeds(feeds, seed=1)
    second = eager.run(None, second_feeds)
    graph = InferenceSession(data, providers=[(CUDA, {**KERNELS_ONLY, "enable_cuda_graph": "1"})], env=genv)
    binding = graph.io_binding()
    # CuPy arrays bound as they are: a bfloat16 one's __cuda_array_interface__ typestr is '<V2', which
    # the host reads as bfloat16 from the array's dtype (host/runtime/tensor.py).
    ins = {k: cp.asarray(v) for k, v in feeds.items()}
    outs = [cp.zeros(v.shape, v.dtype) for v in first]
    for k, arr in ins.items():
        binding.bind_input(k, arr)
    for k, arr in zip(names, outs):
        binding.bind_output(k, arr)
    cp.cuda.get_current_stream().synchronize()
    graph.run_with_iobinding(binding)
    assert graph.fallbacks["graph_captured"] == 1, f"{name} {precision}: not captured ({dict(graph.fallbacks)})"
    for k, got, want in zip(names, outs, first):
        assert relative_error(cp.asnumpy(got).astype(F32), want.astype(F32)) <= 1e-3, f"{name} capture {k}"
    for k, v in second_feeds.items():
        ins[k][...] = cp.asarray(v)
    cp.cuda.get_current_stream().synchronize()
    graph.run_with_iobinding(binding)
    for k, got, want in zip(names, outs, second):
        assert relative_error(cp.asnumpy(got).astype(F32), want.astype(F32)) <= 1e-3, f"{name} replay {k}"
    graph.close()
    eager.close()


def test_half_model_list_is_real():
    """The GPU model tests are parametrized by these fixtures: each must exist."""
    for name in MODELS:
        path, feeds, _ = load(name)
        assert path.exists() and feeds



class _CaiArray:
    """What CuPy 14 and torch expose for a bfloat16 device array: typestr '<V2' (measured on an H100)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.__cuda_array_interface__ = {"shape": (2, 3), "typestr": "<V2", "data": (4096, False), "version": 3,
                                         "strides": None}


@pytest.mark.parametrize("own,expected", [(np.dtype(BF16), np.dtype(BF16)), ("torch.bfloat16", np.dtype(BF16)),
                                          (np.dtype("V2"), np.dtype("V2"))], ids=["cupy", "torch", "void"])
def test_device_bfloat16_arrays_bind_as_bfloat16(own, expected):
    from host.runtime.tensor import as_device_tensor

    class TorchDtype:  # str() as torch's dtype prints
        def __str__(self):
            return own

    tensor = as_device_tensor(_CaiArray(own if isinstance(own, np.dtype) else TorchDtype()))
    assert tensor.dtype == expected and tensor.shape == (2, 3)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_torch_half_exports_are_claimed_whole(tmp_path, dtype_name):
    """A BERT exported by torch from `model.half()` / `model.to(torch.bfloat16)` (TorchScript exporter,
    opset 17: the export issue 24 found SkipLayerNormalization of on the CPU EP): after the optimizer,
    no data node the CUDA kernels would refuse, and the CPU EP returns the declared half type."""
    torch = pytest.importorskip("torch", reason="torch exports the model")
    pytest.importorskip("transformers", reason="the BERT module comes from transformers")
    from transformers import BertConfig, BertModel

    from host.runtime.session import InferenceSession
    from tests.models import export

    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64)
    model = export._wrap(torch, export._from_config(BertModel, config), 2).eval().to(getattr(torch, dtype_name))
    ids = np.random.default_rng(0).integers(0, 200, size=(1, 16), dtype=np.int64)
    mask = np.ones((1, 16), np.int64)
    mask[0, -3:] = 0
    path = tmp_path / "bert_half.onnx"
    torch.onnx.export(model, (torch.from_numpy(ids), torch.from_numpy(mask)), str(path), dynamo=False,
                      opset_version=17, input_names=["input_ids", "attention_mask"], output_names=["y"],
                      do_constant_folding=True)
    session = InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert "SkipLayerNormalization" in {n.op_type for n in session.graph.nodes}
    assert unclaimed_data_nodes(session.graph) == []
    (y,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
    assert y.dtype.name == dtype_name
    session.close()
