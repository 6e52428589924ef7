"""Large products over a constant weight by the compiled packed GEMM (kernels_gemm.c), not NumPy's BLAS.

native.gemm_fits bounds the small-tile GEMM (ep_gemm) to products of a few million multiply-adds; beyond
them a weight matrix (a MatMul's, FusedMatMul's or Gemm's bound initializer) is packed once into column
panels (ep_pack_b) and multiplied by ep_gemm_packed, with the bias and the epilogue program applied per
tile. Measured on one thread of the shared AVX-512 machine against onnxruntime's MLAS (its default
OpenBLAS kernels are AVX2's there, OPENBLAS_CORETYPE=Haswell in its environment): 150x768x3072 3.7 ms
(MLAS 3.2, OpenBLAS 6.0), 1024x768x3072 22 ms (MLAS 19, OpenBLAS 37). With more than one thread in the
run's bound (host/runtime/threads.py) a product is shared, in units of whole column panels, between the
calling thread and up to that many workers of a persistent pool (native/kernels_pool.c), at most one
thread per THREADED_MACS multiply-adds.

The packed copy costs the weight's size again (onnxruntime's MLAS pre-packs its weights the same way);
it is made at the first large product and kept while the weight lives (a weak reference drops it).
"""

from __future__ import annotations

import weakref

import numpy as np

from host.cpu_ep import native
from host.runtime import threads

F32 = native.F32
THREADED_MACS = 1 << 22  # below, a product runs on the calling thread (waking a worker costs some 10 us)
_WEIGHTS: set[int] = set()  # ids of arrays the kernels declared constant (bound initializers)
_PACKED: dict[int, np.ndarray] = {}


def declare_weight(b) -> None:
    """`b` (a kernel's bound initializer) stays unchanged while it lives: it may be packed once."""
    if isinstance(b, np.ndarray) and b.dtype == F32 and b.ndim == 2 and id(b) not in _WEIGHTS:
        _WEIGHTS.add(id(b))
        weakref.finalize(b, _forget, id(b))


def _forget(key: int) -> None:
    _WEIGHTS.discard(key)
    _PACKED.pop(key, None)


def serves(b: np.ndarray) -> bool:
    """Whether `b` is a declared weight (packable); the caller checked dtype, layout and shapes."""
    return id(b) in _WEIGHTS


def packed(lib, b: np.ndarray) -> np.ndarray:
    """The packed panels of weight `b` (K x N, any strides), made at the first call."""
    p = _PACKED.get(id(b))
    if p is None:
        k, n = b.shape
        p = np.empty(lib.ep_packed_b_size(k, n), dtype=F32)
        base = b if b.flags.c_contiguous else np.ascontiguousarray(b)
        lib.ep_pack_b(native.ptr(base), native.ptr(p), k, n, n, 1)
        _PACKED[id(b)] = p
    return p


def thread_count(macs: int) -> int:
    """How many threads a product of `macs` multiply-adds gets: the run's BLAS bound from threads.POOLS,
    at most one per THREADED_MACS (each thread's start must pay for itself)."""
    return max(1, min(threads.POOLS.share(), macs // THREADED_MACS))


def runner(lib, b: np.ndarray, bias, prog: int, rows: int, alpha: float = 0.0, beta: float = 0.0):
    """A function of (a, y, res) computing y = prog(a @ b + bias) (res: the epilogue's residual or None)
    for C-contiguous float32 a (rows x K) and y (rows x N)."""
    k, n = b.shape
    bp = native.ptr(packed(lib, b))
    biasp = native.NULL if bias is None else native.ptr(bias)
    ptr, null, gemm, macs = native.ptr, native.NULL, lib.ep_gemm_packed, rows * k * n

    def run(a, y, res=None):
        gemm(ptr(a), bp, biasp, ptr(y), rows, k, n, prog, null if res is None else ptr(res), alpha, beta,
             thread_count(macs))

    return run
