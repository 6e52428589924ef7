"""The CUDA plugin's fused kernels (RMSNormalization, LayerNormalization on long rows, SkipLayerNormalization,
BiasGelu, FusedMatMul, RotaryEmbedding, Attention) against the ONNX reference evaluator or NumPy definitions.

Float32 normalisations rtol 1e-4 (sums in another order); GEMM-based ones (FusedMatMul, Attention) use the
plain-FP32 cuBLAS handle and rtol/atol 1e-4, float16 rtol/atol 2e-2 (float16 products and an 11-bit mantissa
on P before the second GEMM). Fused kernels are also captured in a CUDA graph in thread-local capture mode
(any cudaMalloc or synchronising call fails the capture), then replayed on new input values written into the
same buffers: the replay must compute the new answer, not the captured one.
"""

from __future__ import annotations

import numpy as np
import pytest

from plugin_cuda import kernels
from tests.plugin_cuda.test_kernels import (
    BF16,
    BOTH,
    F16,
    F32,
    GEMM_TOL,
    I64,
    FakeContext,
    bools,
    check,
    rand,
    reference,
    run_kernel,
)

gpu = pytest.mark.gpu
FUSED_TOL = {np.dtype(F32): dict(rtol=1e-4, atol=1e-5), np.dtype(F16): dict(rtol=1e-2, atol=1e-2),
             np.dtype(BF16): dict(rtol=2e-2, atol=2e-2)}

# ---------------------------------------------------------------------------------------------
# Fused kernels


def layer_norm_ref(x, scale, bias, axis, eps, rms=False):
    axes = tuple(range(axis % x.ndim, x.ndim))
    x64 = x.astype(np.float64)
    mean = 0.0 if rms else x64.mean(axis=axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * scale
    return y + bias if bias is not None else y


@gpu
@BOTH
@pytest.mark.parametrize("shape,axis", [((2, 3, 64), -1), ((2, 5, 6), -2), ((4, 1000), 1), ((3, 7), 0)], ids=str)
def test_rms_normalization(cp, shape, axis, dtype):
    x = rand(*shape, low=-3, high=5)
    scale = rand(*shape[axis:], seed=1)
    check(cp, "RMSNormalization", [x, scale], {"axis": axis, "epsilon": 1e-3}, 23, dtype, tol=FUSED_TOL[np.dtype(dtype)])


@gpu
@BOTH
def test_layer_normalization_long_rows_and_broadcast_scale(cp, dtype):
    # 3000 elements a row: several elements per thread; Scale over the last axis only (broadcast).
    x = rand(3, 2, 1500, low=-3, high=5)
    scale, bias = rand(1500, seed=1), rand(1500, seed=2)
    got = run_kernel(cp, "LayerNormalization", [x.astype(dtype), scale.astype(dtype), bias.astype(dtype)],
                     {"axis": 1}, 17)[0]
    want = layer_norm_ref(x.astype(dtype).astype(F32), scale.astype(dtype), bias.astype(dtype), 1, 1e-5)
    np.testing.assert_allclose(got.astype(F32), want, **FUSED_TOL[np.dtype(dtype)])


def skip_ln_ref(x, skip, scale, bias, eps):
    total = x.astype(np.float64) + skip
    return layer_norm_ref(total, scale, bias, -1, eps), total


@gpu
@BOTH
@pytest.mark.parametrize("skip_shape", [(2, 5, 32), (5, 32)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("outputs", [1, 2])
def test_skip_layer_normalization(cp, skip_shape, with_bias, outputs, dtype):
    x, skip = rand(2, 5, 32, low=-3, high=3), rand(*skip_shape, seed=1)
    scale, bias = rand(32, seed=2), rand(32, seed=3)
    inputs = [x, skip, scale] + ([bias] if with_bias else [])
    inputs = [v.astype(dtype) for v in inputs]
    got = _run_domain(cp, "SkipLayerNormalization", inputs, {"epsilon": 1e-4}, outputs)
    want = skip_ln_ref(*(v.astype(F32) for v in inputs[:3]), inputs[3].astype(F32) if with_bias else None, 1e-4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(F32), w, **FUSED_TOL[np.dtype(dtype)])


def _run_domain(cp, op_type, inputs, attrs, num_outputs=1, handle=None, opset=1):
    """run_kernel for an ai.ephost op."""
    cls = kernels.lookup(op_type, opset, kernels.EPHOST_DOMAIN)
    kernel = cls(attrs, opset, f"test_{op_type}")
    ctx = FakeContext(cp, inputs, handle, num_outputs, cls.host_inputs)
    kernel.compute(ctx)
    cp.cuda.get_current_stream().synchronize()
    return [cp.asnumpy(ctx.outputs[i]) for i in range(num_outputs)]


def gelu_ref(x, approximate):
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    from math import erf

    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


@gpu
@BOTH
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(cp, approximate, dtype):
    x, bias = rand(3, 4, 16, low=-4, high=4).astype(dtype), rand(16, seed=1).astype(dtype)
    got = _run_domain(cp, "BiasGelu", [x, bias], {"approximate": approximate})[0]
    want = gelu_ref(x.astype(F32) + bias.astype(F32), approximate)
    np.testing.assert_allclose(got.astype(F32), want, **FUSED_TOL[np.dtype(dtype)])


@gpu
@BOTH
@pytest.mark.parametrize("activation", ["", "Relu", "Gelu", "GeluTanh"])
@pytest.mark.parametrize("shapes", [((2, 3, 8), (8, 16), (16,)), ((5, 8), (8, 16), None),
                                    ((2, 3, 8), (2, 8, 16), (1, 16))], ids=str)
def test_fused_matmul(cp, cublas_handle_fp32, activation, shapes, dtype):
    a, b = rand(*shapes[0], seed=1).astype(dtype), rand(*shapes[1], seed=2).astype(dtype)
    inputs = [a, b] + ([rand(*shapes[2], seed=3).astype(dtype)] if shapes[2] is not None else [])
    got = _run_domain(cp, "FusedMatMul", inputs, {"activation": activation}, handle=cublas_handle_fp32)[0]
    y = np.matmul(a.astype(np.float64), b.astype(np.float64))
    if len(inputs) > 2:
        y = y + inputs[2].astype(np.float64)
    y = {"": y, "Relu": np.maximum(y, 0), "Gelu": gelu_ref(y, "none"), "GeluTanh": gelu_ref(y, "tanh")}[activation]
    np.testing.assert_allclose(got.astype(F32), y, **GEMM_TOL[np.dtype(dtype)])


ROTARY = [
    ("4d-pos", (2, 3, 5, 8), {}, True),
    ("4d-cache", (2, 3, 5, 8), {}, False),
    ("4d-interleaved", (1, 2, 6, 8), {"interleaved": 1}, True),
    ("4d-partial", (1, 2, 4, 12), {"rotary_embedding_dim": 8}, True),
    ("3d", (2, 5, 3 * 8), {"num_heads": 3}, True),
    ("3d-partial-interleaved", (1, 4, 2 * 12), {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}, False),
]


@gpu
@BOTH
@pytest.mark.parametrize("name,shape,attrs,with_pos", ROTARY, ids=[r[0] for r in ROTARY])
def test_rotary_embedding(cp, name, shape, attrs, with_pos, dtype):
    batch = shape[0]
    seq = shape[2] if len(shape) == 4 else shape[1]
    head = shape[3] if len(shape) == 4 else shape[2] // attrs["num_heads"]
    half = attrs.get("rotary_embedding_dim", head) // 2
    if with_pos:
        cos, sin = rand(20, half, seed=1), rand(20, half, seed=2)
        extra = [np.random.default_rng(3).integers(0, 20, size=(batch, seq)).astype(I64)]
    else:
        cos, sin = rand(batch, seq, half, seed=1), rand(batch, seq, half, seed=2)
        extra = []
    check(cp, "RotaryEmbedding", [rand(*shape), cos, sin] + extra, attrs, 23, dtype)


ATTENTION = [
    # name, q, k, v, mask (shape, dtype) or None, attrs
    ("4d", (2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6), None, {}),
    ("4d-causal-scale", (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8), None, {"is_causal": 1, "scale": 0.2}),
    ("4d-gqa-boolmask", (2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), ((2, 1, 5, 7), np.bool_), {}),
    ("4d-floatmask-padded", (1, 2, 3, 4), (1, 2, 6, 4), (1, 2, 6, 4), ((3, 4), F32), {}),
    ("4d-softcap-causal-mask", (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), ((1, 2, 4, 4), F32),
     {"softcap": 2.0, "is_causal": 1}),
    ("3d", (2, 5, 3 * 8), (2, 7, 3 * 8), (2, 7, 3 * 4), None, {"q_num_heads": 3, "kv_num_heads": 3}),
    ("3d-gqa-causal", (1, 6, 4 * 8), (1, 6, 2 * 8), (1, 6, 2 * 8), ((6, 6), np.bool_),
     {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1}),
]


def attention_inputs(q, k, v, mask, seed=0):
    inputs = [rand(*q, seed=seed), rand(*k, seed=seed + 1), rand(*v, seed=seed + 2)]
    if mask is not None:
        shape, dtype = mask
        if dtype == np.bool_:
            m = bools(*shape, seed=seed + 3, p=0.7)
            m.reshape(-1)[0] = False
        else:
            m = rand(*shape, seed=seed + 3, low=-2, high=1)
            m.reshape(-1)[0] = -np.inf
        inputs.append(m)
    return inputs


@gpu
@BOTH
@pytest.mark.parametrize("name,q,k,v,mask,attrs", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_attention(cp, cublas_handle_fp32, name, q, k, v, mask, attrs, dtype):
    inputs = attention_inputs(q, k, v, mask)
    check(cp, "Attention", inputs, attrs, 23, dtype, handle=cublas_handle_fp32, tol=GEMM_TOL[np.dtype(dtype)],
          num_outputs=3)


@gpu
def test_attention_fully_masked_row_is_zero(cp, cublas_handle_fp32):
    q, k, v = rand(1, 1, 2, 4), rand(1, 1, 3, 4, seed=1), rand(1, 1, 3, 4, seed=2)
    mask = np.array([[False, False, False], [True, False, True]])
    got = check(cp, "Attention", [q, k, v, mask], {}, 23, handle=cublas_handle_fp32, tol=GEMM_TOL[np.dtype(F32)])
    assert np.all(got[0][0, 0, 0] == 0)


# ---------------------------------------------------------------------------------------------
# Capture: the fused kernels record into a CUDA graph and replay on new inputs


class MemoContext(FakeContext):
    """Outputs allocated once, so that a warm-up run and the capture write the same buffers."""

    def output(self, index, shape, dtype):
        out = self.outputs.get(index)
        if out is None:
            out = super().output(index, shape, dtype)
        return out


CAPTURED = [
    ("LayerNormalization", "", 17, lambda: [rand(2, 3, 32), rand(32, seed=1), rand(32, seed=2)], {}, 3),
    ("RMSNormalization", "", 23, lambda: [rand(2, 3, 32), rand(32, seed=1)], {}, 1),
    ("SkipLayerNormalization", "ai.ephost", 1, lambda: [rand(2, 3, 32), rand(2, 3, 32, seed=1), rand(32, seed=2),
                                                        rand(32, seed=3)], {}, 2),
    ("BiasGelu", "ai.ephost", 1, lambda: [rand(2, 3, 32), rand(32, seed=1)], {"approximate": "tanh"}, 1),
    ("FusedMatMul", "ai.ephost", 1, lambda: [rand(2, 3, 8), rand(8, 16, seed=1), rand(16, seed=2)],
     {"activation": "Gelu"}, 1),
    ("RotaryEmbedding", "", 23, lambda: [rand(1, 2, 4, 8), rand(8, 4, seed=1), rand(8, 4, seed=2),
                                         np.array([[3, 1, 0, 7]], I64)], {}, 1),
    ("Attention", "", 23, lambda: attention_inputs((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), ((5, 7), np.bool_)),
     {"is_causal": 1}, 1),
    ("Attention", "", 23, lambda: attention_inputs((1, 5, 2 * 8), (1, 5, 2 * 8), (1, 5, 2 * 8), ((5, 5), F32)),
     {"q_num_heads": 2, "kv_num_heads": 2}, 1),
    ("Softmax", "", 13, lambda: [rand(3, 4, 50)], {}, 1),
    ("Einsum", "", 12, lambda: [rand(2, 3, 4, 5), rand(2, 3, 6, 5, seed=1)], {"equation": "bhqd,bhkd->bhqk"}, 1),
]


def reference_any(op_type, domain, inputs, attrs, opset, num_outputs):
    if domain == "ai.ephost":
        if op_type == "SkipLayerNormalization":
            return skip_ln_ref(inputs[0], inputs[1], inputs[2], inputs[3], 1e-5)
        if op_type == "BiasGelu":
            return [gelu_ref(inputs[0] + inputs[1], attrs["approximate"])]
        y = np.matmul(inputs[0].astype(np.float64), inputs[1]) + inputs[2]
        return [gelu_ref(y, "none")]
    return reference(op_type, inputs, attrs, opset, num_outputs)


@gpu
@pytest.mark.parametrize("op_type,domain,opset,make,attrs,count", CAPTURED, ids=[c[0] + str(i)
                                                                                for i, c in enumerate(CAPTURED)])
def test_fused_kernels_capture_and_replay(cp, op_type, domain, opset, make, attrs, count):
    from plugin_cuda.device.cublas import CublasHandle

    stream = cp.cuda.Stream(non_blocking=True)
    cls = kernels.lookup(op_type, opset, domain)
    kernel = cls(attrs, opset, f"captured_{op_type}")
    first = make()
    with stream:
        handle = CublasHandle(stream.ptr, use_tf32=False)
        try:
            ctx = MemoContext(cp, first, handle, count, cls.host_inputs)
            kernel.compute(ctx)  # warm-up: compiles, fills the pool, creates the outputs
            stream.synchronize()
            stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeThreadLocal)
            try:
                kernel.compute(ctx)
            finally:
                graph = stream.end_capture()
            # New values into the same device buffers, then replay.
            second = [x if not isinstance(x, np.ndarray) or x.dtype.kind != "f" else x * 0.5 - 0.25 for x in first]
            for dev, new in zip(ctx.inputs, second):
                if dev is not None and not isinstance(dev, np.ndarray):
                    dev.set(np.ascontiguousarray(new))
            for out in ctx.outputs.values():
                out.fill(np.nan if out.dtype.kind == "f" else 0)
            stream.synchronize()
            graph.launch(stream)
            stream.synchronize()
        finally:
            handle.close()
    want = reference_any(op_type, domain, second, attrs, opset, count)
    for i in range(count):
        np.testing.assert_allclose(cp.asnumpy(ctx.outputs[i]).astype(F32), np.asarray(want[i], F32),
                                   rtol=1e-4, atol=1e-4, err_msg=f"{op_type} output {i} after replay")
