"""int8 GEMMs on the tensor cores through cuBLASLt (CUBLAS_COMPUTE_32I, CUDA_R_8I inputs, CUDA_R_32I
result), for the quantized kernels (plugin_cuda/kernels/quant*.py).

The quantized ops multiply (a - a_zero_point) by (b - b_zero_point). Those differences do not fit int8
(-255..255), so the GEMM runs on the raw codes, shifted to int8 (uint8 u becomes u - 128, its zero point
too), and the zero points are applied afterwards through row and column sums:

    sum_k (a'_mk - za')(b'_kn - zb') = P_mn - zb'_n * rowsum(a')_m - za'_m * colsum(b')_n + K * za'_m * zb'_n

with P = a' @ b'. The sums come out of the same GEMM: the packed A gets one more row of ones (its
product row is colsum(b')) and the packed B^T one more row of ones (its product column is rowsum(a')).

cuBLASLt's int8 tensor-core kernels want the "TN" form with m and k multiples of 4, leading
dimensions multiples of 4 and 4-byte aligned pointers (cublasLtMatmul's documentation, "regular data
ordering"). Row-major C (M, N) = A (M, K) @ B (K, N) is column-major C^T = B^T A^T, so:
  Lt's A  = the packed B^T, (Np, Kp) row-major = column-major Kp x Np, transposed (m = Np);
  Lt's B  = the packed A, (Mp, Kp) row-major = column-major Kp x Mp (n = Mp);
  Lt's D  = (Mp, Np) int32 row-major = column-major Np x Mp.
Kp is K rounded up to 4 (zero columns add nothing), Mp and Np are M + 1 and N + 1 rounded up to 4 (zero
rows).

Everything but the pointers and the stream is fixed when a plan is made: descriptor, layouts and the
algorithm (first heuristic answer, no workspace, so a call allocates nothing and is capturable).
"""

from __future__ import annotations

import threading
import weakref

from plugin_cuda.device.cublas import CublasError, check

CUBLAS_COMPUTE_32I = 72
CUDA_R_8I = 3
CUDA_R_32I = 10
CUBLAS_OP_T = 1
DESC_TRANSA = 3
PREF_MAX_WORKSPACE_BYTES = 1
ALIGN = 4  # the multiple cuBLASLt's int8 tensor-core kernels need for m, k and the leading dimensions

_plans: dict = {}
_plans_lock = threading.Lock()
_PLAN_LIMIT = 512


def round_up(value: int, multiple: int = ALIGN) -> int:
    return -(-value // multiple) * multiple


def padded_dims(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(rows of the packed A, rows of the packed B^T, padded K) for a (m, k) @ (k, n) product: each
    operand gets its row of ones, and every dimension of the GEMM is padded to a multiple of 4 (cuBLASLt
    asks it of m and k; n too keeps every row of the result 16-byte aligned)."""
    return round_up(m + 1), round_up(n + 1), round_up(max(k, 1))


class Int8Gemm:
    """D (rows_a, rows_b) int32 = packed A (rows_a, kp) int8 @ packed B^T (rows_b, kp) int8 transposed,
    row-major, one cublasLtMatmul. rows_b and kp must be multiples of 4 (padded_dims makes them so)."""

    def __init__(self, device_id: int, rows_a: int, rows_b: int, kp: int):
        from plugin_cuda.device import cublaslt

        if rows_b % ALIGN or kp % ALIGN:
            raise ValueError(f"int8 GEMM: rows of B^T {rows_b} and K {kp} must be multiples of {ALIGN}")
        ffi = self.ffi = cublaslt.ffi
        lib = self.lib = cublaslt.load_library()
        self.handle = cublaslt.handle(device_id)
        self.what = f"int8 GEMM ({rows_a} x {kp}) @ ({kp} x {rows_b})"
        box = ffi.new("cublasLtMatmulDesc_t *")
        check(lib.cublasLtMatmulDescCreate(box, CUBLAS_COMPUTE_32I, CUDA_R_32I), f"{self.what}: cublasLtMatmulDescCreate")
        self.desc = box[0]
        layouts = []
        for dtype, rows, cols in ((CUDA_R_8I, kp, rows_b), (CUDA_R_8I, kp, rows_a), (CUDA_R_32I, rows_b, rows_a)):
            lbox = ffi.new("cublasLtMatrixLayout_t *")
            check(lib.cublasLtMatrixLayoutCreate(lbox, dtype, rows, cols, rows), f"{self.what}: cublasLtMatrixLayoutCreate")
            layouts.append(lbox[0])
        self.layouts = layouts
        pbox = ffi.new("cublasLtMatmulPreference_t *")
        check(lib.cublasLtMatmulPreferenceCreate(pbox), f"{self.what}: cublasLtMatmulPreferenceCreate")
        self.pref = pbox[0]
        self._finalizer = weakref.finalize(self, cublaslt.destroy_matmul, lib, self.desc, layouts, self.pref)
        trans = ffi.new("int32_t *", CUBLAS_OP_T)
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, trans, 4), f"{self.what}: set TRANSA")
        zero = ffi.new("uint64_t *", 0)  # no workspace: nothing to allocate, capturable
        check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, zero, 8),
              f"{self.what}: cublasLtMatmulPreferenceSetAttribute")
        self.algo = self._heuristic()
        self.alpha = ffi.new("int32_t *", 1)
        self.beta = ffi.new("int32_t *", 0)

    def _heuristic(self):
        ffi = self.ffi
        result = ffi.new("cublasLtMatmulHeuristicResult_t *")
        count = ffi.new("int *")
        a_layout, b_layout, d_layout = self.layouts
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a_layout, b_layout, d_layout, d_layout,
                                                      self.pref, 1, result, count),
              f"{self.what}: cublasLtMatmulAlgoGetHeuristic")
        if count[0] < 1:
            raise CublasError(f"{self.what}: cuBLASLt has no int8 algorithm (CUBLAS_COMPUTE_32I) for these sizes "
                              "without workspace")
        return ffi.new("cublasLtMatmulAlgo_t *", result[0].algo)

    def __call__(self, a_ptr: int, bt_ptr: int, d_ptr: int, stream_ptr: int) -> None:
        """D = packed A @ packed B^T^T on the stream (device pointers as ints)."""
        ffi = self.ffi
        a_layout, b_layout, d_layout = self.layouts
        d = ffi.cast("void *", d_ptr)
        status = self.lib.cublasLtMatmul(self.handle, self.desc, self.alpha, ffi.cast("void *", bt_ptr), a_layout,
                                         ffi.cast("void *", a_ptr), b_layout, self.beta, d, d_layout, d, d_layout,
                                         self.algo, ffi.NULL, 0, ffi.cast("void *", stream_ptr))
        if status:
            check(status, f"cublasLtMatmul ({self.what})")


def plan(device_id: int, rows_a: int, rows_b: int, kp: int) -> Int8Gemm:
    """The Int8Gemm of these sizes on this device, made once per process (descriptors hold no stream)."""
    key = (device_id, rows_a, rows_b, kp)
    with _plans_lock:
        found = _plans.get(key)
    if found is None:
        found = Int8Gemm(device_id, rows_a, rows_b, kp)
        with _plans_lock:
            if len(_plans) >= _PLAN_LIMIT:  # dynamic shapes must not grow this without bound
                _plans.clear()
            found = _plans.setdefault(key, found)
    return found
