"""The plugin's own cuBLAS binding: errors, handle lifetime, GEMM semantics, and capture in a CUDA graph.

float32 GEMMs run in TF32 by default (inputs rounded to a 10-bit mantissa, FP32 accumulate: the error
of a K=32 dot product of standard normals reaches ~1e-2 at the tail), hence rtol 1e-2 / atol 5e-2
against NumPy; the plain-FP32 handle is held to 1e-4.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from plugin_cuda.device import cublas
from plugin_cuda.device.cublas import CublasError, CublasHandle

gpu = pytest.mark.gpu
TF32_TOL = dict(rtol=1e-2, atol=5e-2)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# CPU-only


def test_check_passes_success():
    cublas.check(0, "cublasCreate_v2")


def test_check_names_the_status_and_the_call():
    with pytest.raises(CublasError, match=r"^cublasGemmEx \(MatMul\) failed: CUBLAS_STATUS_INVALID_VALUE \(7\); ") as e:
        cublas.check(7, "cublasGemmEx (MatMul)")
    assert e.value.status == 7


def test_check_unknown_status():
    with pytest.raises(CublasError, match=r"^cublasX failed: CUBLAS_STATUS_UNKNOWN_12345 \(12345\)$"):
        cublas.check(12345, "cublasX")


def test_missing_library_is_a_cublas_error(monkeypatch):
    def no_pathfinder():
        raise RuntimeError("pathfinder found nothing")

    monkeypatch.setattr(cublas, "_lib", None)
    monkeypatch.setattr(cublas, "_pathfinder_candidate", no_pathfinder)
    monkeypatch.setattr(cublas, "_find_library_candidate", lambda: None)
    monkeypatch.setattr(cublas, "_SONAMES", ("libephost_no_such_cublas.so.99",))
    with pytest.raises(CublasError, match=r"^cannot load cuBLAS: install the CUDA toolkit .*pathfinder found nothing"):
        cublas.load_library()


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [
    ((3, 4), (4, 5), (3, 5)),
    ((4,), (4, 5), (5,)),
    ((3, 4), (4,), (3,)),
    ((4,), (4,), ()),
    ((2, 1, 3, 4), (5, 4, 6), (2, 5, 3, 6)),
    ((7, 3, 4), (4,), (7, 3)),
])
def test_matmul_shape(a_shape, b_shape, out_shape):
    assert cublas.matmul_shape(a_shape, b_shape) == out_shape


@pytest.mark.parametrize("a_shape,b_shape,message", [
    ((3, 4), (5, 6), r"^MatMul got shapes \(3, 4\) and \(5, 6\); the inner dimensions 4 and 5 must match$"),
    ((2, 3, 4), (3, 4, 5), r"^MatMul got shapes .*; their batch dimensions do not broadcast$"),
    ((), (4,), r"^MatMul got shapes \(\) and \(4,\); allowed: rank 1 or more$"),
])
def test_matmul_shape_errors(a_shape, b_shape, message):
    with pytest.raises(ValueError, match=message):
        cublas.matmul_shape(a_shape, b_shape)


@pytest.mark.parametrize("a_shape,b_shape,batch,calls", [
    ((2, 3, 4), (4, 5), 1, 1),          # batch folded into M
    ((3, 4), (6, 4, 5), 6, 1),          # A stride 0
    ((2, 3, 3, 4), (2, 3, 4, 5), 6, 1),  # equal batches merge into one
    ((2, 1, 3, 4), (1, 5, 4, 6), 5, 2),  # irregular: loop over the outer dim
])
def test_matmul_plan_batches(a_shape, b_shape, batch, calls):
    plan = cublas.matmul_plan(a_shape, b_shape)
    assert (plan.batch, len(plan.offsets)) == (batch, calls)


def test_gemm_shape():
    assert cublas.gemm_shape((4, 3), (5, 4), True, True) == (3, 5)
    with pytest.raises(ValueError, match=r"^Gemm got shapes \(3, 4\) \(transA=0\) and \(3, 5\) \(transB=0\)"):
        cublas.gemm_shape((3, 4), (3, 5), False, False)


# ---------------------------------------------------------------------------------------------
# GPU


@gpu
def test_handle_lifecycle(cp):
    handle = CublasHandle(cp.cuda.get_current_stream().ptr)
    assert not handle.closed and handle.raw is not None
    handle.close()
    handle.close()  # idempotent
    assert handle.closed
    with pytest.raises(CublasError, match="^cuBLAS handle is closed"):
        handle.raw  # noqa: B018
    with CublasHandle(cp.cuda.get_current_stream().ptr, workspace_bytes=0, use_tf32=False) as h:
        assert h.stream_ptr == cp.cuda.get_current_stream().ptr
    assert h.closed


@gpu
def test_handle_collected_mid_use(cp):
    handle = CublasHandle(cp.cuda.get_current_stream().ptr)
    a = cp.asarray(rand(8, 8))
    out = cp.empty((8, 8), np.float32)
    cublas.matmul(handle, a, a, out)
    del handle
    gc.collect()  # the finalizer destroys the handle; nothing raises
    cp.cuda.get_current_stream().synchronize()


@gpu
def test_set_stream_rebinds(cp):
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)
    with CublasHandle(s1.ptr) as h:
        h.set_stream(s1.ptr)  # unchanged: no call
        h.set_stream(s2.ptr)
        assert h.stream_ptr == s2.ptr
        with s2:
            a, b = rand(16, 8, seed=1), rand(8, 4, seed=2)
            out = cp.empty((16, 4), np.float32)
            cublas.matmul(h, cp.asarray(a), cp.asarray(b), out)
        s2.synchronize()
        np.testing.assert_allclose(cp.asnumpy(out), a @ b, **TF32_TOL)


@gpu
@pytest.mark.parametrize("use_tf32,tol", [(True, TF32_TOL), (False, dict(rtol=1e-4, atol=1e-4))])
@pytest.mark.parametrize("a_shape,b_shape", [
    ((64, 32), (32, 48)),
    ((3, 64, 32), (32, 48)),
    ((64, 32), (3, 32, 48)),
    ((2, 1, 16, 8), (1, 3, 8, 4)),
    ((32,), (32, 8)),
], ids=str)
def test_matmul_matches_numpy(cp, use_tf32, tol, a_shape, b_shape):
    a, b = rand(*a_shape, seed=1), rand(*b_shape, seed=2)
    with CublasHandle(cp.cuda.get_current_stream().ptr, use_tf32=use_tf32) as h:
        out = cp.empty(cublas.matmul_shape(a.shape, b.shape), np.float32)
        cublas.matmul(h, cp.asarray(a), cp.asarray(b), out)
        np.testing.assert_allclose(cp.asnumpy(out), np.matmul(a.astype(np.float64), b), **tol)


@gpu
def test_matmul_float16(cp):
    a, b = rand(4, 64, 32, seed=1).astype(np.float16), rand(32, 16, seed=2).astype(np.float16)
    with CublasHandle(cp.cuda.get_current_stream().ptr) as h:
        out = cp.empty((4, 64, 16), np.float16)
        cublas.matmul(h, cp.asarray(a), cp.asarray(b), out)
        want = np.matmul(a.astype(np.float32), b.astype(np.float32))
        np.testing.assert_allclose(cp.asnumpy(out).astype(np.float32), want, rtol=1e-2, atol=5e-2)


@gpu
def test_matmul_rejects_bad_output(cp):
    with CublasHandle(cp.cuda.get_current_stream().ptr) as h:
        a = cp.asarray(rand(3, 4))
        with pytest.raises(ValueError, match=r"^MatMul output has shape \(3, 3\); expected \(3, 4\)$"):
            cublas.matmul(h, a, cp.asarray(rand(4, 4)), cp.empty((3, 3), np.float32))
        with pytest.raises(ValueError, match="^MatMul got dtypes float32, float16 -> float32"):
            cublas.matmul(h, a, cp.asarray(rand(4, 4)).astype(np.float16), cp.empty((3, 4), np.float32))


@gpu
def test_gemm_matches_numpy(cp):
    a, b, c = rand(5, 3, seed=1), rand(4, 5, seed=2), rand(4, seed=3)
    with CublasHandle(cp.cuda.get_current_stream().ptr, use_tf32=False) as h:
        out = cp.empty((3, 4), np.float32)
        cublas.gemm(h, cp.asarray(a), cp.asarray(b), cp.asarray(c), 0.5, 2.0, True, True, out)
        np.testing.assert_allclose(cp.asnumpy(out), 0.5 * a.T @ b.T + 2.0 * c, rtol=1e-4, atol=1e-4)


@gpu
def test_error_status_becomes_cublas_error(cp):
    """An invalid argument (m < 0) makes cuBLAS return CUBLAS_STATUS_INVALID_VALUE, touching nothing."""
    with CublasHandle(cp.cuda.get_current_stream().ptr) as h:
        lib = cublas.load_library()
        one = cublas.ffi.new("float *", 1.0)
        null = cublas.ffi.NULL
        status = lib.cublasSgemm_v2(h.raw, 0, 0, -1, 1, 1, one, null, 1, null, 1, one, null, 1)
        assert status == 7
        with pytest.raises(CublasError, match=r"^cublasSgemm_v2 failed: CUBLAS_STATUS_INVALID_VALUE \(7\)"):
            cublas.check(status, "cublasSgemm_v2")


@gpu
def test_gemm_captured_in_cuda_graph(cp):
    """The reason this module exists: cuBLAS GEMMs recorded by stream capture, then replayed."""
    s = cp.cuda.Stream(non_blocking=True)
    a1, b1 = rand(64, 32, seed=1), rand(32, 48, seed=2)
    ab, bb = rand(3, 16, 32, seed=3), rand(3, 32, 8, seed=4)
    ga, gb, gc = rand(16, 32, seed=5), rand(24, 32, seed=6), rand(24, seed=7)
    with s, CublasHandle(s.ptr) as h:
        a, b = cp.asarray(a1), cp.asarray(b1)
        batch_a, batch_b = cp.asarray(ab), cp.asarray(bb)
        gemm_a, gemm_b, gemm_c = cp.asarray(ga), cp.asarray(gb), cp.asarray(gc)
        out = cp.empty((64, 48), np.float32)
        batch_out = cp.empty((3, 16, 8), np.float32)
        gemm_out = cp.empty((16, 24), np.float32)

        def step():
            cublas.matmul(h, a, b, out)
            cublas.matmul(h, batch_a, batch_b, batch_out)
            cublas.gemm(h, gemm_a, gemm_b, gemm_c, 1.5, 0.5, False, True, gemm_out)

        step()  # warm-up: cuBLAS picks and loads its kernels outside capture
        s.synchronize()
        s.begin_capture()
        try:
            step()
        finally:
            graph = s.end_capture()

        # New contents in the same buffers: the replay must read them.
        a1, ab, ga = rand(64, 32, seed=11), rand(3, 16, 32, seed=12), rand(16, 32, seed=13)
        a.set(a1, stream=s)
        batch_a.set(ab, stream=s)
        gemm_a.set(ga, stream=s)
        out.fill(0)
        graph.launch(s)
        s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), a1 @ b1, **TF32_TOL)
    np.testing.assert_allclose(cp.asnumpy(batch_out), ab @ bb, **TF32_TOL)
    np.testing.assert_allclose(cp.asnumpy(gemm_out), 1.5 * ga @ gb.T + 0.5 * gc, **TF32_TOL)
