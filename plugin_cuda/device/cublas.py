"""cuBLAS owned by the CUDA plugin, called through cffi in ABI mode.

CuPy refuses every cuBLAS call while a stream is capturing (its own guard raises
NotImplementedError), yet cuBLAS itself captures fine when the handle's stream is set before
capture and the handle has a user workspace (cublasSetWorkspace), so that cuBLAS allocates nothing
while capturing. So the plugin owns its handles here: one handle per stream, used by one thread at
a time (cuBLAS handles are not thread-safe).

Everything here that runs per call (matmul, gemm) is capturable: no host synchronisation, no
allocation except through CuPy's current (stream-aware) memory pool, no CuPy cuBLAS.
"""

from __future__ import annotations

import ctypes.util
import functools
import itertools
import threading
import weakref

import numpy as np

from abi import outofline
from abi.dtypes import BFLOAT16_DTYPE
from plugin_cuda.device import cdefs
from plugin_cuda.device.streams import stream_scope
from plugin_cuda.semantics import shapes

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy (or a broken CUDA install) means zero devices, not a crash
    cupy = None

__all__ = [
    "ONE",
    "ZERO",
    "CublasError",
    "CublasHandle",
    "MatmulPlan",
    "check",
    "gemm",
    "gemm_shape",
    "gemm_types",
    "load_library",
    "matmul",
    "matmul_plan",
    "matmul_shape",
    "open_first",
    "void_ptr",
]

# Enum values from cublas_api.h / library_types.h (stable since CUDA 11).
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH = 0
CUBLAS_TF32_TENSOR_OP_MATH = 3

CUBLAS_STATUS_SUCCESS = 0
STATUS_NAMES = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}
_STATUS_HINTS = {
    1: "the handle was not created or was already destroyed",
    3: "cuBLAS could not allocate device memory",
    7: "an argument is out of range (sizes, leading dimensions, enum values)",
    8: "the GPU lacks a feature this call needs",
    13: "the kernel failed to launch: check the stream, the device and any capture in progress",
    14: "an internal cuBLAS operation failed, often a CUDA error on the stream",
    15: "the combination of types, compute type or algorithm is not supported",
}


ffi = outofline.ffi_of("_ephost_cublas", cdefs.CUBLAS)  # parsed once, at build (abi/outofline.py)

# Host-side scalars for alpha/beta (host pointer mode: cuBLAS reads them when the call is made, so
# a captured graph holds their values, not these addresses).
ONE = ffi.new("float *", 1.0)
ZERO = ffi.new("float *", 0.0)
_NULL = ffi.NULL

_INT32_MAX = 2**31 - 1


class CublasError(RuntimeError):
    """A cuBLAS call failed, or cuBLAS could not be loaded."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def status_name(status: int) -> str:
    """Symbolic name of a cublasStatus_t value."""
    name = STATUS_NAMES.get(status)
    if name is None and _lib is not None:
        # Newer cuBLAS versions may add codes; ask the library when it can tell.
        try:
            raw = _lib.cublasGetStatusName(status)
            if raw != _NULL:
                name = ffi.string(raw).decode("ascii", "replace")
        except AttributeError:
            pass
    return name or f"CUBLAS_STATUS_UNKNOWN_{status}"


def check(status: int, what: str) -> None:
    """The single error funnel: raise CublasError naming the status and what was being done."""
    if status == CUBLAS_STATUS_SUCCESS:
        return
    hint = _STATUS_HINTS.get(status)
    message = f"{what} failed: {status_name(status)} ({status})"
    if hint:
        message += f"; {hint}"
    raise CublasError(message, status)


# ---------------------------------------------------------------------------------------------
# Library loading

_lib = None
_lib_path: str | None = None
_lib_lock = threading.Lock()
_SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so")


def _pathfinder_candidate():
    """Where cuda-pathfinder finds cuBLAS (the way CuPy itself locates it): a path or a handle."""
    from cuda import pathfinder  # cuda-pathfinder; CuPy 14 depends on it

    loaded = pathfinder.load_nvidia_dynamic_lib("cublas")
    # cuda-pathfinder >= 1.0 names it abs_path; earlier releases used other names.
    for attr in ("abs_path", "abspath", "path"):
        path = getattr(loaded, attr, None)
        if path:
            return str(path)
    handle = getattr(loaded, "_handle_uint", None) or getattr(loaded, "handle", None)
    if handle:
        # Already loaded by someone else and its path is unknown: reuse the open handle.
        return ffi.cast("void *", int(handle))
    return None


def _find_library_candidate():
    return ctypes.util.find_library("cublas")


def open_first(lib_ffi, candidates, symbol: str, tried: list):
    """(library, candidate) for the first candidate that dlopens and has `symbol` (a library that
    is not the one asked for fails early); None when none does, each failure added to `tried`."""
    for candidate in candidates:
        try:
            lib = lib_ffi.dlopen(candidate)
            getattr(lib, symbol)
        except (OSError, AttributeError) as e:
            tried.append(f"{candidate}: {e}")
            continue
        return lib, candidate
    return None


def load_library():
    """Load libcublas once per process and keep it alive; raise CublasError when it cannot be found."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried: list[str] = []
        candidates = []
        try:
            found = _pathfinder_candidate()
            if found is not None:
                candidates.append(found)
            else:
                tried.append("cuda.pathfinder: no path in its answer")
        except Exception as e:  # noqa: BLE001 - any failure here just moves on to the fallbacks
            tried.append(f"cuda.pathfinder: {type(e).__name__}: {e}")
        found = _find_library_candidate()
        if found:
            candidates.append(found)
        else:
            tried.append("ctypes.util.find_library('cublas'): not found")
        candidates.extend(_SONAMES)
        found = open_first(ffi, candidates, "cublasCreate_v2", tried)
        if found is not None:
            _lib, candidate = found
            _lib_path = candidate if isinstance(candidate, str) else "<handle from cuda.pathfinder>"
            return _lib
        raise CublasError(
            "cannot load cuBLAS: install the CUDA toolkit or the nvidia-cublas wheel matching CuPy's "
            "CUDA version; tried: " + "; ".join(tried)
        )


def library_path() -> str | None:
    """The path cuBLAS was loaded from (None before the first handle)."""
    return _lib_path


# ---------------------------------------------------------------------------------------------
# Handles


# cuBLAS's own recommendation on Hopper (and enough for split-K on older GPUs); the plans' cuBLASLt
# epilogue GEMMs choose their algorithms for this much workspace and run in the handle's.
WORKSPACE_BYTES = 32 << 20


class _HandleState:
    """What the finalizer releases. It holds no reference to the CublasHandle."""

    __slots__ = ("lib", "handle", "workspace")

    def __init__(self, lib, handle):
        self.lib = lib
        self.handle = handle
        self.workspace = None


def _release(state: _HandleState) -> None:
    handle, state.handle = state.handle, None
    if handle is not None:
        try:
            # cublasDestroy synchronises the device, so the workspace is idle afterwards.
            state.lib.cublasDestroy_v2(handle)
        except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter exit, dead context)
            pass
    state.workspace = None


class CublasHandle:
    """A cuBLAS handle bound to one stream, with a workspace from CuPy's pool.

    Set the stream (constructor or set_stream) before any capture begins: cublasSetStream is not a
    capturable operation. close() destroys the handle (it synchronises the device): never while a
    stream is capturing.
    """

    def __init__(self, stream_ptr: int = 0, workspace_bytes: int = WORKSPACE_BYTES, use_tf32: bool = True):
        if cupy is None:
            raise CublasError("CuPy is not importable: the CUDA plugin has no device to run cuBLAS on")
        workspace_bytes = int(workspace_bytes)
        if workspace_bytes < 0:
            raise ValueError(f"workspace_bytes is {workspace_bytes}; allowed: 0 or more bytes")
        lib = load_library()
        box = ffi.new("cublasHandle_t *")
        check(lib.cublasCreate_v2(box), "cublasCreate_v2")
        self.lib = lib
        self._state = _HandleState(lib, box[0])
        self._finalizer = weakref.finalize(self, _release, self._state)
        # At interpreter exit the CUDA context may already be gone; the OS reclaims everything.
        self._finalizer.atexit = False
        self.workspace_bytes = workspace_bytes
        self.use_tf32 = bool(use_tf32)
        self._stream_ptr: int | None = None
        try:
            mode = CUBLAS_TF32_TENSOR_OP_MATH if self.use_tf32 else CUBLAS_DEFAULT_MATH
            check(lib.cublasSetMathMode(self._state.handle, mode), "cublasSetMathMode")
            self.set_stream(stream_ptr)
        except BaseException:
            self.close()
            raise

    @property
    def raw(self):
        """The cublasHandle_t (cffi cdata); CublasError once closed."""
        handle = self._state.handle
        if handle is None:
            raise CublasError("cuBLAS handle is closed; create a new CublasHandle")
        return handle

    @property
    def stream_ptr(self) -> int | None:
        return self._stream_ptr

    @property
    def workspace_ptr(self) -> int:
        """The address of the workspace bound with the stream (0 without one). cuBLASLt calls made in
        this stream's order may use it too (plan epilogue GEMMs): the stream serialises them."""
        workspace = self._state.workspace
        return int(workspace.ptr) if workspace is not None else 0

    @property
    def closed(self) -> bool:
        return self._state.handle is None

    def set_stream(self, stream_ptr: int) -> None:
        """Bind the handle to a stream; a no-op when it is already bound to it. Not during capture."""
        ptr = int(stream_ptr)
        if ptr == self._stream_ptr:
            return
        handle = self.raw
        check(self.lib.cublasSetStream_v2(handle, ffi.cast("cudaStream_t", ptr)), "cublasSetStream_v2")
        # cublasSetStream resets the workspace to cuBLAS's own pool (which would allocate lazily,
        # even during capture), so the workspace is set again after every stream change. It is
        # allocated on the new stream: once freed, CuPy's stream-aware pool reuses it only in that
        # stream's order, after any GEMM still queued there.
        workspace = None
        ws_ptr = _NULL
        if self.workspace_bytes:
            with stream_scope(ptr):
                workspace = cupy.cuda.alloc(self.workspace_bytes)
            ws_ptr = ffi.cast("void *", workspace.ptr)
        check(
            self.lib.cublasSetWorkspace_v2(handle, ws_ptr, self.workspace_bytes),
            "cublasSetWorkspace_v2",
        )
        self._state.workspace = workspace
        self._stream_ptr = ptr

    def release_workspace(self) -> None:
        """Unbind the handle from its stream and return its workspace to the pool (the stream's
        work must be done); set_stream binds it again, with a new workspace on the new stream."""
        handle = self.raw
        check(self.lib.cublasSetWorkspace_v2(handle, _NULL, 0), "cublasSetWorkspace_v2")
        self._state.workspace = None
        self._stream_ptr = None

    def close(self) -> None:
        """Destroy the handle and return its workspace to the pool; safe to call twice."""
        self._finalizer()

    def __enter__(self) -> CublasHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"stream=0x{self._stream_ptr or 0:x}"
        return f"<CublasHandle {state} tf32={self.use_tf32}>"


# ---------------------------------------------------------------------------------------------
# GEMM
#
# Row-major trick: cuBLAS is column-major, and a row-major (r, c) matrix read column-major is its
# transpose. So C = A @ B (row-major) is computed as C^T = B^T A^T (column-major): the first
# operand is B, the second is A, m = N, n = M, and no data moves.


def gemm_types(dtype, use_tf32: bool):
    """(cudaDataType, cublasComputeType) for an operand dtype; FP16 and BF16 accumulate in FP32 (on
    tensor cores)."""
    if dtype == np.float32:
        return CUDA_R_32F, (CUBLAS_COMPUTE_32F_FAST_TF32 if use_tf32 else CUBLAS_COMPUTE_32F)
    if dtype == np.float16:
        return CUDA_R_16F, CUBLAS_COMPUTE_32F
    if dtype == BFLOAT16_DTYPE:
        return CUDA_R_16BF, CUBLAS_COMPUTE_32F
    raise ValueError(f"cuBLAS GEMM got dtype {dtype}; allowed: float32, float16, bfloat16")


def _scalar(value: float):
    if value == 1.0:
        return ONE
    if value == 0.0:
        return ZERO
    return ffi.new("float *", value)


def _ptr(array) -> int:
    return array.data.ptr


def void_ptr(address: int):
    """A device address as the `void *` cuBLAS takes."""
    return ffi.cast("void *", address)


def matmul_shape(a_shape, b_shape) -> tuple:
    """Output shape of ONNX MatMul (numpy.matmul rules); ValueError when the shapes do not fit."""
    return matmul_plan(tuple(a_shape), tuple(b_shape)).out_shape


class MatmulPlan:
    """How one ONNX MatMul of given shapes runs on cuBLAS: sizes, batch strides, per-call offsets."""

    __slots__ = ("out_shape", "m", "n", "k", "batch", "stride_a", "stride_b", "stride_c", "offsets",
                 "empty", "k_zero")


def _batch_strides(shape2: tuple, matrix: int, batch: tuple) -> list:
    """Element strides of a C-contiguous operand's batch dims, aligned to `batch` (0 = broadcast)."""
    dims = shape2[:-2]
    strides = []
    step = matrix
    for size in reversed(dims):
        strides.append(step)
        step *= size
    strides.reverse()
    out = [0] * (len(batch) - len(dims))
    for size, stride in zip(dims, strides):
        out.append(stride if size != 1 else 0)
    return out


def _merged_batch_dims(batch: tuple, sa: list, sb: list, sc: list) -> list:
    """Drop size-1 dims, then merge neighbours whose strides chain for A, B and C alike, so that
    broadcasting as stride 0 or equal batches become a single strided-batched call."""
    dims = [(size, sa[i], sb[i], sc[i]) for i, size in enumerate(batch) if size != 1]
    merged: list[tuple[int, int, int, int]] = []
    for dim in dims:
        if merged:
            size0, a0, b0, c0 = merged[-1]
            size1, a1, b1, c1 = dim
            if a0 == a1 * size1 and b0 == b1 * size1 and c0 == c1 * size1:
                merged[-1] = (size0 * size1, a1, b1, c1)
                continue
        merged.append(dim)
    return merged


def _set_batches(plan: MatmulPlan, dims: list) -> None:
    """The strided-batched call over the last merged dim, a Python loop over the outer ones."""
    if not dims:
        plan.batch = 1
        plan.stride_a = plan.stride_b = plan.stride_c = 0
        plan.offsets = ((0, 0, 0),)
        return
    size, plan.stride_a, plan.stride_b, plan.stride_c = dims[-1]
    plan.batch = size
    outer = dims[:-1]
    offsets = []
    for index in itertools.product(*(range(d[0]) for d in outer)):
        offsets.append((
            sum(i * d[1] for i, d in zip(index, outer)),
            sum(i * d[2] for i, d in zip(index, outer)),
            sum(i * d[3] for i, d in zip(index, outer)),
        ))
    plan.offsets = tuple(offsets)


@functools.lru_cache(maxsize=4096)
def matmul_plan(a_shape: tuple, b_shape: tuple) -> MatmulPlan:
    """The MatmulPlan of `a_shape` @ `b_shape` (memoised); ValueError when the shapes do not fit."""
    out_shape = shapes.matmul_shape(a_shape, b_shape)  # ONNX's rule; raises OpError (a ValueError)
    a2 = (1,) + a_shape if len(a_shape) == 1 else a_shape
    b2 = b_shape + (1,) if len(b_shape) == 1 else b_shape
    m, k = a2[-2:]
    n = b2[-1]
    batch = shapes.broadcast_shape(a2[:-2], b2[:-2])
    plan = MatmulPlan()
    plan.out_shape = out_shape
    plan.empty = m == 0 or n == 0 or 0 in batch
    plan.k_zero = k == 0
    plan.m, plan.n, plan.k = m, n, k
    sa = _batch_strides(a2, m * k, batch)
    sb = _batch_strides(b2, k * n, batch)
    sc = _batch_strides((*batch, m, n), m * n, batch)
    # A is batched and contiguous while B is one matrix: fold the batch into M, one plain GEMM.
    if batch and all(s == 0 for s in sb) and a2[:-2] == batch:
        plan.m = m * int(np.prod(batch))
        _set_batches(plan, [])
    else:
        _set_batches(plan, _merged_batch_dims(batch, sa, sb, sc))
    if max(plan.m, plan.n, plan.k, plan.batch) > _INT32_MAX:
        raise ValueError(
            f"MatMul got shapes {a_shape} and {b_shape}; a GEMM dimension exceeds cuBLAS's int32 range"
        )
    return plan


def _contiguous(x):
    return x if x.flags.c_contiguous else cupy.ascontiguousarray(x)


def matmul(handle: CublasHandle, a, b, out) -> None:
    """out = a @ b with ONNX MatMul semantics, for float32 (TF32 when the handle says so), float16 or
    bfloat16.

    `out` must be a C-contiguous CuPy array of matmul_shape(a.shape, b.shape) and the dtype of `a`.
    """
    dtype = a.dtype
    if b.dtype != dtype or out.dtype != dtype:
        raise ValueError(
            f"MatMul got dtypes {a.dtype}, {b.dtype} -> {out.dtype}; all three must be the same"
        )
    plan = matmul_plan(a.shape, b.shape)
    if out.shape != plan.out_shape:
        raise ValueError(f"MatMul output has shape {out.shape}; expected {plan.out_shape}")
    if not out.flags.c_contiguous:
        raise ValueError("MatMul output must be C-contiguous")
    if plan.empty:
        return
    if plan.k_zero:
        out.fill(0)
        return
    cuda_type, compute = gemm_types(dtype, handle.use_tf32)
    a = _contiguous(a)
    b = _contiguous(b)
    item = dtype.itemsize
    pa, pb, pc = _ptr(a), _ptr(b), _ptr(out)
    m, n, k = plan.m, plan.n, plan.k
    raw = handle.raw
    lib = handle.lib
    if plan.batch == 1:
        for oa, ob, oc in plan.offsets:
            check(lib.cublasGemmEx(
                raw, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k,
                ONE, void_ptr(pb + ob * item), cuda_type, n,
                void_ptr(pa + oa * item), cuda_type, k,
                ZERO, void_ptr(pc + oc * item), cuda_type, n,
                compute, CUBLAS_GEMM_DEFAULT,
            ), "cublasGemmEx (MatMul)")
        return
    for oa, ob, oc in plan.offsets:
        check(lib.cublasGemmStridedBatchedEx(
            raw, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k,
            ONE, void_ptr(pb + ob * item), cuda_type, n, plan.stride_b,
            void_ptr(pa + oa * item), cuda_type, k, plan.stride_a,
            ZERO, void_ptr(pc + oc * item), cuda_type, n, plan.stride_c,
            plan.batch, compute, CUBLAS_GEMM_DEFAULT,
        ), "cublasGemmStridedBatchedEx (MatMul)")


def gemm_shape(a_shape, b_shape, trans_a: bool, trans_b: bool) -> tuple:
    """Output shape (M, N) of ONNX Gemm; ValueError when the shapes do not fit."""
    return _gemm_shape(tuple(a_shape), tuple(b_shape), bool(trans_a), bool(trans_b))


@functools.lru_cache(maxsize=1024)
def _gemm_shape(a_shape: tuple, b_shape: tuple, trans_a: bool, trans_b: bool) -> tuple:
    m, n = shapes.gemm_shape(a_shape, b_shape, trans_a, trans_b)  # ONNX's rule
    k = a_shape[0] if trans_a else a_shape[1]
    if max(m, n, k) > _INT32_MAX:
        raise ValueError(f"Gemm got shapes {a_shape} and {b_shape}; a dimension exceeds cuBLAS's int32 range")
    return (m, n)


def _operand(x, trans: bool):
    """A 2-D operand as C-contiguous storage plus its transpose flag (an F-contiguous view flips)."""
    if x.flags.c_contiguous:
        return x, trans
    if x.flags.f_contiguous:
        return x.T, not trans
    return cupy.ascontiguousarray(x), trans


def gemm(handle: CublasHandle, a, b, c, alpha: float, beta: float, trans_a: bool, trans_b: bool,
         out) -> None:
    """out = alpha * op(a) @ op(b) + beta * c with ONNX Gemm semantics (c broadcasts; may be None)."""
    dtype = a.dtype
    if b.dtype != dtype or out.dtype != dtype or (c is not None and c.dtype != dtype):
        raise ValueError(
            f"Gemm got dtypes A {a.dtype}, B {b.dtype}, C {None if c is None else c.dtype} -> {out.dtype}; "
            "all must be the same"
        )
    trans_a, trans_b = bool(trans_a), bool(trans_b)
    m, n = _gemm_shape(a.shape, b.shape, trans_a, trans_b)
    if out.shape != (m, n) or not out.flags.c_contiguous:
        raise ValueError(f"Gemm output has shape {out.shape}; expected C-contiguous {(m, n)}")
    if m == 0 or n == 0:
        return
    k = a.shape[0] if trans_a else a.shape[1]
    if c is not None and beta != 0.0:
        # cuBLAS accumulates beta * out in place, so out starts as C broadcast to (M, N).
        cupy.copyto(out, c)
    else:
        beta = 0.0  # cuBLAS then never reads out, so NaN garbage in it cannot leak through
    if k == 0:
        if beta == 0.0:
            out.fill(0)
        elif beta != 1.0:
            cupy.multiply(out, beta, out=out)
        return
    cuda_type, compute = gemm_types(dtype, handle.use_tf32)
    a, trans_a = _operand(a, trans_a)
    b, trans_b = _operand(b, trans_b)
    check(handle.lib.cublasGemmEx(
        handle.raw, CUBLAS_OP_T if trans_b else CUBLAS_OP_N, CUBLAS_OP_T if trans_a else CUBLAS_OP_N,
        n, m, k,
        _scalar(float(alpha)), void_ptr(_ptr(b)), cuda_type, b.shape[1],
        void_ptr(_ptr(a)), cuda_type, a.shape[1],
        _scalar(float(beta)), void_ptr(_ptr(out)), cuda_type, n,
        compute, CUBLAS_GEMM_DEFAULT,
    ), "cublasGemmEx (Gemm)")
