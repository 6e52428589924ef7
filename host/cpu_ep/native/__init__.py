"""The CPU EP's compiled kernels (kernels.c beside this file), opened in cffi ABI mode.

`python build.py` compiles kernels.c into build/lib/libephost_cpu_kernels.so with the hash of the source
it was built from; this module opens that library when it is there and its hash matches kernels.c (a
stale build is never called), else `LIB` is None and every kernel keeps its NumPy path. The kernels
call `LIB` only for the cases they checked (float32, C-contiguous, shapes that fit), so a missing
library changes speed, never results or errors.

`EPHOST_CPU_NATIVE=0` in the environment turns the library off; `EPHOST_CPU_KERNELS=/path/lib.so`
opens another build. Tests switch it with `use(None)` / `use(load())`: kernels read `LIB` per call.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import cffi
import numpy as np

SOURCE = Path(__file__).with_name("kernels.c")
LIB_NAME = "libephost_cpu_kernels.so"
DEFAULT_PATH = Path(__file__).resolve().parents[3] / "build" / "lib" / LIB_NAME

CDEF = """
typedef struct {
    int C, H, W;
    int M, KH, KW;
    int SH, SW, PH, PW, DH, DW;
    int OH, OW;
} ConvGeom;
const char *ep_source_hash(void);
void ep_bias_act(const void *x, const void *bias, void *y, int rows, int n, unsigned prog, const void *res,
                 float alpha, float beta);
void ep_gemm(const void *A, const void *AT, const void *B, const void *bias, int bias_kind, void *C, int M, int K, int N,
             unsigned prog, const void *res, float alpha, float beta);
void ep_layernorm(const void *x, const void *skip, const void *scale, const void *bias, void *y, void *sum,
                  void *mean_out, void *inv_std_out, int rows, int n, float eps);
void ep_rmsnorm(const void *x, const void *scale, void *y, int rows, int n, float eps);
int ep_attention(const void *q, const void *k, const void *v, const void *mask, int mask_kind, void *y,
                 int B, int H, int S, int T, int D, int DV, int R, const int64_t *qs, const int64_t *ks,
                 const int64_t *vs, const int64_t *ys, const int64_t *ms, float scale, int causal);
void ep_rotary_halves(const void *x, const int64_t *xs, const void *cos_c, const void *sin_c, void *y,
                      const int64_t *ys, int B, int H, int S, int D, int64_t cs_batch);
int ep_depthwise2d(const void *x, const void *w, const void *bias, void *y, const ConvGeom *g, unsigned prog,
                    const void *res, float alpha, float beta);
int ep_conv2d(const void *x, const void *w, const void *bias, void *y, const ConvGeom *g, unsigned prog,
              const void *res, float alpha, float beta);
int ep_squeeze_excite(const void *x, void *y, int N, int C, int HW, const void *w1, const void *b1,
                      const void *w2, const void *b2, int R, unsigned gate, float alpha, float beta);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)
NULL = ffi.NULL
ptr = ffi.from_buffer  # a C-contiguous array's data pointer (the caller checked layout and dtype)

# Epilogue steps (kernels.c): a program is up to 6 steps, 4 bits each, lowest first.
RELU, GELU, GELU_TANH, HARD_SWISH, HARD_SIGMOID, SIGMOID, ADD, SILU, MUL = 1, 2, 3, 4, 5, 6, 7, 8, 9
MAX_STEPS = 6
F32 = np.dtype(np.float32)


# The compiled GEMM is a plain single-threaded tiled loop: it beats OpenBLAS's call overhead on the small
# products of small models (2-3 us at 16x64x64) and stays level up to a few million multiply-adds, but a
# large product runs 3-5x slower than multithreaded BLAS on 2 cores (worse on more), and a weight panel
# wider than L2 makes its column tiles miss the cache (1x1024x1024: 7x). Beyond these bounds the NumPy
# paths (np.dot) take the product.
GEMM_MAX_MACS = 1 << 23   # m * k * n
GEMM_MAX_PANEL = 1 << 19  # k * n floats (2 MiB) of the operand walked in column tiles


def gemm_fits(m: int, k: int, n: int) -> bool:
    """Whether the compiled GEMM should take an (m x k) @ (k x n) product (see GEMM_MAX_MACS)."""
    return m * k * n <= GEMM_MAX_MACS and k * n <= GEMM_MAX_PANEL


def conv_gemm_fits(m: int, taps: int, pixels: int) -> bool:
    """gemm_fits for a convolution's (m x taps) @ (taps x pixels) GEMM; with fewer pixels than a tile's
    columns the kernel computes the transposed product, walking the (taps x m) weights instead."""
    return gemm_fits(m, taps, pixels) and (pixels >= 32 or taps * m <= GEMM_MAX_PANEL)


def first_element(x: np.ndarray):
    """A pointer to x[0, ..., 0] for a C-contiguous x, or for a permuted view of a whole C-contiguous
    array (a Transpose's output: positive strides spanning exactly the base's bytes start at the base's
    first byte); else None. ffi.from_buffer takes contiguous buffers only, and `x.ctypes.data` costs
    ten times more."""
    if x.flags.c_contiguous:
        return ptr(x)
    base = x.base
    if type(base) is not np.ndarray or not base.flags.c_contiguous or base.nbytes != x.nbytes or not x.size:
        return None
    span = 0
    for d, st in zip(x.shape, x.strides):
        if st <= 0:
            return None
        span += (d - 1) * st
    return ptr(base) if span == x.nbytes - x.itemsize else None


def cached(runs: dict, key, lib, make):
    """The function `make()` built for `key` (a kernel's per-shape closure over its bound initializers,
    doing just the compiled call), kept in `runs`; False where `make()` found the case not served. Rebuilt
    when `lib` changed (tests switch it); at most 16 kept per kernel."""
    entry = runs.get(key)
    if entry is None or (entry and entry[0] is not lib):
        if len(runs) >= 16:
            runs.clear()
        made = make()
        entry = runs[key] = (lib, made) if made else False
    return entry and entry[1]


def program(steps) -> int:
    """The epilogue program running `steps` in order."""
    steps = list(steps)
    if len(steps) > MAX_STEPS:
        raise ValueError(f"an epilogue program holds at most {MAX_STEPS} steps, got {len(steps)}")
    code = 0
    for i, s in enumerate(steps):
        code |= s << (4 * i)
    return code


def source_hash() -> str:
    """The hash build.py compiles into the library, of kernels.c as it is now."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


LOAD_ERROR: str | None = None  # why LIB is None, for `ephost` diagnostics and tests


def load(path: str | os.PathLike | None = None):
    """The library at `path` (default: $EPHOST_CPU_KERNELS, else build/lib of this checkout), or None
    when it is missing, cannot be opened or was built from another kernels.c (LOAD_ERROR says which)."""
    global LOAD_ERROR
    path = Path(path or os.environ.get("EPHOST_CPU_KERNELS") or DEFAULT_PATH)
    if not path.is_file():
        LOAD_ERROR = f"{path} not found (run `python build.py`)"
        return None
    try:
        lib = ffi.dlopen(str(path))
        built_from = ffi.string(lib.ep_source_hash()).decode()
    except (OSError, AttributeError) as exc:
        LOAD_ERROR = f"{path} could not be opened: {exc}"
        return None
    try:
        want = source_hash()
    except OSError as exc:  # an install without the C source: nothing to check a build against
        LOAD_ERROR = f"{SOURCE} cannot be read ({exc}); the compiled kernels stay off"
        return None
    if built_from != want:
        LOAD_ERROR = f"{path} was built from another kernels.c ({built_from}; now {want}): rebuild it"
        return None
    LOAD_ERROR = None
    return lib


def use(lib) -> None:
    """Make kernels call `lib` (None: the NumPy paths everywhere). For tests."""
    global LIB
    LIB = lib


LIB = None if os.environ.get("EPHOST_CPU_NATIVE", "1") == "0" else load()
if LIB is None and os.environ.get("EPHOST_CPU_NATIVE", "1") == "0":
    LOAD_ERROR = "disabled by EPHOST_CPU_NATIVE=0"
