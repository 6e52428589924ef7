"""The CUDA EP's int8 GEMM (cuBLASLt, CUBLAS_COMPUTE_32I) against a float32 GEMM of the same size.

    python -m bench.quant_gpu [--sizes 512,1024,2048,4096] [--iters 20]

Per square size M = N = K, medians over `--iters` runs timed with CUDA events on one stream:
  int8 GEMM   the cuBLASLt call alone on packed operands (plugin_cuda/device/int8gemm.py);
  MatMulInt   the MatMulInteger kernel's whole work: packing both operands to int8 with their rows of
              ones, the GEMM, the zero-point corrections (plugin_cuda/kernels/quant_gemm.py);
  QLinearMM   the same with the requantization to uint8 instead of the int32 output;
  float32     CuPy's matmul (cuBLAS sgemm) on float32 operands;
  TF32        the same with TF32 tensor cores (CUPY_TF32 semantics through cublasSetMathMode).
Prints TOPS (2 * M * N * K / time) and the ratio of float32's time to the int8 path's.
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="512,1024,2048,4096")
    parser.add_argument("--iters", type=int, default=20)
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


if __name__ == "__main__":
    main()
