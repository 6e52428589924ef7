"""The CUDA EP's int8 GEMM (cuBLASLt, CUBLAS_COMPUTE_32I) against a float32 GEMM of the same size.

    python -m bench.quant_gpu [--sizes 512,1024,2048,4096] [--iters 20] [--models]

Per square size M = N = K, medians over `--iters` runs timed with CUDA events on one stream:
  int8 GEMM   the cuBLASLt call alone on packed operands (plugin_cuda/device/int8gemm.py);
  MatMulInt   the MatMulInteger kernel's whole work: packing both operands to int8 with their rows of
              ones, the GEMM, the zero-point corrections (plugin_cuda/kernels/quant_gemm.py);
  QLinearMM   the same with the requantization to uint8 instead of the int32 output;
  float32     CuPy's matmul (cuBLAS sgemm) on float32 operands;
  TF32        the same with TF32 tensor cores (CUPY_TF32 semantics through cublasSetMathMode).
Prints TOPS (2 * M * N * K / time) and the ratio of float32's time to the int8 path's.

--models: the small CNN and transformer of tests/host/test_quantized.py quantized by onnxruntime's quantizer
(QOperator, QDQ, dynamic): median latency of one run (NumPy in and out) on the CUDA EP and on onnxruntime's
CPU provider, and how many nodes ran on the GPU.
"""

from __future__ import annotations

import argparse

import numpy as np


def _median_ms(cp, fn, iters: int) -> float:
    fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(iters):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def _row(cp, size: int, iters: int) -> dict:
    from plugin_cuda.device import int8gemm
    from plugin_cuda.kernels.quant_gemm import bounds, gemm, kernel, matmul, pack

    rng = np.random.default_rng(size)
    a = cp.asarray(rng.integers(0, 256, (size, size)).astype(np.uint8))
    b = cp.asarray(rng.integers(-128, 128, (size, size)).astype(np.int8))
    za, zb = cp.asarray(np.uint8(128)), cp.asarray(np.int8(0))
    scale, yz = cp.asarray(np.float32(0.01)), cp.asarray(np.uint8(128))
    rows_a, rows_b, kp = int8gemm.padded_dims(size, size, size)
    ap = pack(a, size, size, rows_a, (size * size, size, 1), 1)
    bp = pack(b, size, size, rows_b, (size * size, 1, size), 1)
    y32 = cp.empty((size, size), np.int32)
    y8 = cp.empty((size, size), np.uint8)
    lo, hi = bounds(np.uint8)

    def integer():
        product, _ = matmul(a, b)
        kernel("acc_int")(*product.args(za, zb, a.dtype, b.dtype), y32.reshape(product.p.shape))

    def qlinear():
        product, _ = matmul(a, b)
        kernel("acc_quant")(*product.args(za, zb, a.dtype, b.dtype), scale, scale, np.float32(1), scale, yz, lo, hi,
                            y8.reshape(product.p.shape))

    fa, fb = a.astype(np.float32), b.astype(np.float32)
    out = {
        "int8 GEMM": _median_ms(cp, lambda: gemm(ap, bp, size, size, size), iters),
        "MatMulInt": _median_ms(cp, integer, iters),
        "QLinearMM": _median_ms(cp, qlinear, iters),
        "float32": _median_ms(cp, lambda: cp.matmul(fa, fb), iters),
    }
    try:
        from cupy_backends.cuda.libs import cublas as cupy_cublas

        handle = cp.cuda.device.get_cublas_handle()
        cupy_cublas.setMathMode(handle, 3)  # CUBLAS_TF32_TENSOR_OP_MATH
    except (ImportError, AttributeError) as exc:  # an older or newer CuPy: no TF32 column
        print(f"(no TF32 column: {type(exc).__name__}: {exc})")
        out["TF32"] = float("nan")
        return out
    try:
        out["TF32"] = _median_ms(cp, lambda: cp.matmul(fa, fb), iters)
    finally:
        cupy_cublas.setMathMode(handle, 0)
    return out


def _models(iters: int) -> None:
    import functools
    import tempfile
    import time

    import onnx
    import onnxruntime

    import build
    import host
    from host.runtime.session import InferenceSession
    from tests.host import test_quantized
    from tests.plugin_cuda.test_quant_gpu import quantized_model

    env = host.Environment()
    env.register_plugin("cuda", str(build.build_python_plugin("cuda", max(build.PYTHON_PLUGINS["cuda"].versions))))
    out_dir = tempfile.mkdtemp()

    def median_ms(fn):
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times))

    def row(name, shape, fmt):
        model = onnx.load(quantized_model(out_dir, name, fmt))
        model.ir_version = 10
        feeds = {"x": np.random.default_rng(0).random(shape, dtype=np.float32)}
        sess = InferenceSession(model, providers=[("CUDAExecutionProvider", {})], env=env)
        ort = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        placed = list(sess.node_assignment().values())
        on_gpu = sum(p == "CUDAExecutionProvider" for p in placed)
        ours = median_ms(functools.partial(sess.run, None, feeds))
        theirs = median_ms(functools.partial(ort.run, None, feeds))
        sess.close()
        return f"{ours:6.3f} ms | {theirs:6.3f} ms | {on_gpu} of {len(placed)}"

    print(f"{'model':>20} | {'CUDA EP':>9} | {'ort CPU':>9} | nodes on the GPU")
    for name, (_, shape) in test_quantized.MODELS.items():
        for fmt in ("qop", "qdq", "dynamic"):
            try:
                cells = row(name, shape, fmt)
            except Exception as exc:  # noqa: BLE001 - one failed model must not hide the others
                cells = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            print(f"{name + '/' + fmt:>20} | {cells}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="512,1024,2048,4096")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--models", action="store_true", help="also the quantized models end to end")
    args = parser.parse_args(argv)
    import cupy as cp

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    header = f"{'M=N=K':>6} | " + " | ".join(f"{k:>17}" for k in ("int8 GEMM", "MatMulInt", "QLinearMM", "float32", "TF32"))
    print(header + " | float32 / MatMulInt")
    for size in (int(s) for s in args.sizes.split(",")):
        row = _row(cp, size, args.iters)
        ops = 2.0 * size ** 3
        cells = " | ".join(f"{ms:7.3f} ms {ops / ms / 1e9:5.1f} T" for ms in row.values())
        print(f"{size:>6} | {cells} | {row['float32'] / row['MatMulInt']:.2f}x")
    from plugin_cuda.kernels.quant_gemm import stats

    print(f"GEMMs cuBLASLt refused (run by CuPy's integer matmul instead): {stats['fallbacks']}")
    if args.models:
        _models(args.iters)


if __name__ == "__main__":
    main()
