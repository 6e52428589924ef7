"""cuBLASLt through cffi (ABI mode): one GEMM with its bias (and ReLU) applied in the GEMM's own
epilogue, for the compiled plans (plugin_cuda/plan).

A compiled plan folds `Add(bias)` and `Relu` after a GEMM that runs on cuBLAS into the call
(CUBLASLT_EPILOGUE_BIAS / RELU_BIAS), so no separate epilogue kernel reads and rewrites the GEMM's
result. Everything but the stream is fixed when the plan is built: the descriptor (with the bias
address), the matrix layouts and the algorithm (the first heuristic answer for the workspace the call
will get, remembered in device/algo_cache.py, so a later process or a saved context does not ask the
heuristic again). The workspace is the caller's (a plan passes its stream's cuBLAS workspace), so a
call never allocates and is capturable. Without one, cuBLASLt cannot split K: BERT-base's FFN output
GEMM (1024 x 768 x 3072, float32) then took 174-178 us against 129 us for cuBLAS's own choice
(H200). Statuses are cublasStatus_t: cublas.check names them.

Enum values and the heuristic-result layout are those of cublasLt.h (CUDA 11 to 13).
"""

from __future__ import annotations

import ctypes.util
import functools
import threading
import weakref

from abi import outofline
from plugin_cuda.device import algo_cache, cdefs
from plugin_cuda.device.cublas import CublasError, check, open_first

ffi = outofline.ffi_of("_ephost_cublaslt", cdefs.CUBLASLT)  # parsed once, at build (abi/outofline.py)

CUDA_R_32F = 0
CUBLAS_OP_T = 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
PREF_MAX_WORKSPACE_BYTES = 1
# The plan's epilogue names -> cublasLtEpilogue_t
EPILOGUES = {"bias": 4, "relu_bias": 6}

_lib = None
_lock = threading.Lock()
_handles: dict = {}  # device id -> cublasLtHandle_t (process lifetime: a handle holds no stream)
_SONAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so")


def load_library():
    """libcublasLt, loaded once (cuda.pathfinder as CuPy finds it, then the usual sonames)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        candidates, tried = [], []
        try:
            from cuda import pathfinder

            loaded = pathfinder.load_nvidia_dynamic_lib("cublasLt")
            path = getattr(loaded, "abs_path", None)
            if path:
                candidates.append(str(path))
        except Exception as exc:  # noqa: BLE001 - the sonames below are the fallback
            tried.append(f"cuda.pathfinder: {type(exc).__name__}: {exc}")
        candidates += [c for c in (ctypes.util.find_library("cublasLt"),) if c] + list(_SONAMES)
        found = open_first(ffi, candidates, "cublasLtMatmul", tried)
        if found is not None:
            _lib = found[0]
            return _lib
        raise CublasError("cannot load cuBLASLt (libcublasLt, next to cuBLAS in the CUDA toolkit or the "
                          "nvidia-cublas wheel); tried: " + "; ".join(tried))


def handle(device_id: int):
    """The process's cuBLASLt handle for a device (created on first use, with that device current)."""
    with _lock:
        h = _handles.get(device_id)
    if h is None:
        lib = load_library()
        box = ffi.new("cublasLtHandle_t *")
        check(lib.cublasLtCreate(box), "cublasLtCreate")
        with _lock:
            h = _handles.setdefault(device_id, box[0])
    return h


@functools.cache
def compute_capability(device_id: int) -> str:
    import cupy

    return str(cupy.cuda.Device(device_id).compute_capability)


def destroy_matmul(lib, desc, layouts, pref) -> None:
    """Free a matmul descriptor, its layouts and its preference (EpilogueGemm's and int8gemm's)."""
    lib.cublasLtMatmulDescDestroy(desc)
    for layout in layouts:
        lib.cublasLtMatrixLayoutDestroy(layout)
    lib.cublasLtMatmulPreferenceDestroy(pref)


class EpilogueGemm:
    """out (M, N) = epilogue(alpha * A (M, K) @ B (K, N) + bias (N)), row-major, through one
    cublasLtMatmul; `epilogue` in EPILOGUES. A, B, out and the bias are of `data_type` (CUDA_R_32F,
    or CUDA_R_16F / CUDA_R_16BF with compute_type CUBLAS_COMPUTE_32F; alpha and beta are float32
    either way). The bias address is fixed; A, B and out are given per call (see __call__), the
    stream and a workspace of `workspace_bytes` (the most the algorithm may use) too. `trans_b`: B is
    stored (N, K) and read transposed (K-major, as PyTorch's Linear weights; fuse.k_major_weights)."""

    def __init__(self, device_id: int, m: int, n: int, k: int, alpha: float, bias_ptr: int, epilogue: str,
                 compute_type: int, what: str, data_type: int = CUDA_R_32F, workspace_bytes: int = 0,
                 trans_b: bool = False):
        if epilogue not in EPILOGUES:
            raise ValueError(f"{what}: epilogue {epilogue!r}; allowed: {sorted(EPILOGUES)}")
        lib = self.lib = load_library()
        self.what = what
        self.handle = handle(device_id)
        box = ffi.new("cublasLtMatmulDesc_t *")
        check(lib.cublasLtMatmulDescCreate(box, compute_type, CUDA_R_32F), f"{what}: cublasLtMatmulDescCreate")
        self.desc = box[0]
        layouts = []
        # Row-major C = A @ B is column-major C^T = B^T A^T: the first operand is B (N x K), then A. A B
        # stored (N, K) is (K x N) column-major, transposed by the call (TRANSA: the first operand's).
        for rows, cols in ((k, n) if trans_b else (n, k), (k, m), (n, m)):
            lbox = ffi.new("cublasLtMatrixLayout_t *")
            check(lib.cublasLtMatrixLayoutCreate(lbox, data_type, rows, cols, rows), f"{what}: cublasLtMatrixLayoutCreate")
            layouts.append(lbox[0])
        pbox = ffi.new("cublasLtMatmulPreference_t *")
        check(lib.cublasLtMatmulPreferenceCreate(pbox), f"{what}: cublasLtMatmulPreferenceCreate")
        self.pref = pbox[0]
        self.layouts = layouts
        self._finalizer = weakref.finalize(self, destroy_matmul, lib, self.desc, layouts, self.pref)
        self._set(DESC_EPILOGUE, ffi.new("uint32_t *", EPILOGUES[epilogue]), 4)
        if trans_b:
            self._set(DESC_TRANSA, ffi.new("int32_t *", CUBLAS_OP_T), 4)
        self._set(DESC_BIAS_POINTER, ffi.new("void **", ffi.cast("void *", bias_ptr)), ffi.sizeof("void *"))
        self.workspace_bytes = int(workspace_bytes)
        limit = ffi.new("uint64_t *", self.workspace_bytes)
        check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, limit, 8),
              f"{what}: cublasLtMatmulPreferenceSetAttribute")
        key = algo_cache.lt_key(compute_capability(device_id), m, n, k, epilogue, compute_type, data_type,
                                self.workspace_bytes, trans_b)
        saved = algo_cache.lookup(key)
        if saved is not None and len(bytes.fromhex(saved)) == ffi.sizeof("cublasLtMatmulAlgo_t"):
            # The heuristic's earlier answer for this device, shape, type and epilogue (a disk cache or context).
            self.algo = ffi.new("cublasLtMatmulAlgo_t *")
            ffi.memmove(self.algo, bytes.fromhex(saved), len(bytes.fromhex(saved)))
        else:
            found = self.heuristics(1)
            if not found:
                raise CublasError(f"{what}: cuBLASLt has no algorithm for a {m}x{k} @ {k}x{n} GEMM of data type "
                                  f"{data_type} with epilogue {epilogue!r} and {self.workspace_bytes} bytes of "
                                  "workspace")
            self.algo = found[0][0]
            algo_cache.record(key, bytes(ffi.buffer(self.algo)).hex())
        self.alpha = ffi.new("float *", float(alpha))
        self.beta = ffi.new("float *", 0.0)

    def heuristics(self, count: int) -> list:
        """cuBLASLt's first `count` answers for this GEMM, best first: (algorithm, workspace bytes it
        needs, waves) each (bench/lt_gemm_gpu.py times them)."""
        results = ffi.new("cublasLtMatmulHeuristicResult_t[]", count)
        returned = ffi.new("int *")
        b_layout, a_layout, d_layout = self.layouts
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, b_layout, a_layout, d_layout, d_layout,
                                                      self.pref, count, results, returned),
              f"{self.what}: cublasLtMatmulAlgoGetHeuristic")
        return [(ffi.new("cublasLtMatmulAlgo_t *", results[i].algo), int(results[i].workspaceSize),
                 float(results[i].wavesCount)) for i in range(returned[0]) if results[i].state == 0]

    def _set(self, attr: int, value, size: int) -> None:
        check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, value, size),
              f"{self.what}: cublasLtMatmulDescSetAttribute({attr})")

    def __call__(self, a_ptr: int, b_ptr: int, out_ptr: int, stream_ptr: int, workspace_ptr: int = 0) -> None:
        """One GEMM on `stream_ptr`; `workspace_ptr` holds workspace_bytes (0 only when that is 0),
        used in the stream's order."""
        b_layout, a_layout, d_layout = self.layouts
        out = ffi.cast("void *", out_ptr)
        status = self.lib.cublasLtMatmul(self.handle, self.desc, self.alpha, ffi.cast("void *", b_ptr), b_layout,
                                         ffi.cast("void *", a_ptr), a_layout, self.beta, out, d_layout, out, d_layout,
                                         self.algo, ffi.cast("void *", workspace_ptr),
                                         self.workspace_bytes if workspace_ptr else 0, ffi.cast("void *", stream_ptr))
        if status:
            check(status, f"cublasLtMatmul ({self.what})")

    def close(self) -> None:
        self._finalizer()
