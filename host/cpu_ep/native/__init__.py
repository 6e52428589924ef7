"""The CPU EP's compiled kernels (kernels.c beside this file), opened in cffi ABI mode.

The library carries the hash of the source it was built from; this module opens the first build
whose hash matches kernels.c (a stale build is never called), looking in order at: the package's own
(`_kernels.<ext suffix>` beside this file, compiled by `pip install .` / the wheel build), a checkout's
build/lib/libephost_cpu_kernels.so (`python build.py`), and the per-user cache (`ephost build`).
Without one, `LIB` is None and every kernel keeps its NumPy path. The kernels call `LIB` only for
the cases they checked (float32, C-contiguous, shapes that fit), so a missing library changes speed,
never results or errors. docs/install.md says how each build is made.

`EPHOST_CPU_NATIVE=0` in the environment turns the library off; `EPHOST_CPU_KERNELS=/path/lib.so`
opens that build only. Tests switch it with `use(None)` / `use(load())`: kernels read `LIB` per call.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path

import cffi
import numpy as np

from host.cpu_ep.native import build_info

SOURCE = build_info.SOURCE
LIB_NAME = build_info.LIB_NAME
DEFAULT_PATH = Path(__file__).resolve().parents[3] / "build" / "lib" / LIB_NAME  # a checkout's build.py output

# The convolutions' geometry (kernels.c's ConvGeom: 14 ints) crosses as an int[14] (`conv_geometry`): a
# struct type of one FFI instance is refused by the functions of another (the API module has its own).
CDEF = """
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
                 const int64_t *vs, const int64_t *ys, const int64_t *ms, float scale, int causal, int threads);
void ep_rotary_halves(const void *x, const int64_t *xs, const void *cos_c, const void *sin_c, void *y,
                      const int64_t *ys, int B, int H, int S, int D, int64_t cs_batch);
int ep_depthwise2d(const void *x, const void *w, const void *bias, void *y, const void *g, unsigned prog,
                    const void *res, float alpha, float beta);
int ep_conv2d(const void *x, const void *w, const void *wt, const void *bias, void *y, const void *g, unsigned prog,
              const void *res, float alpha, float beta);
int ep_gemm_stack(int layers, const void *x, void *y, int rows, const int *k, const int *n, const int64_t *w,
                  const int64_t *bias, const unsigned *prog);
int64_t ep_packed_b_size(int K, int N);
void ep_pack_b(const void *B, void *Bp, int K, int N, int64_t sk, int64_t sn);
void ep_gemm_packed(const void *A, const void *Bp, const void *bias, void *C, int M, int K, int N, unsigned prog,
                    const void *res, float alpha, float beta, int threads);
int ep_pool_workers(void);
int ep_pool_skip(void);
void ep_pool_note(long long claimed_ns, long long waited_ns);
void ep_quantize(const void *x, void *y, int64_t n, int op, float scale, float zero_point, float lo, float hi,
                 int kind);
int ep_dynamic_qmatmul(const void *a, int64_t M, int K, const void *bc, int N, const void *b_scale, const void *bias,
                       void *y);
int ep_qlinear_matmul(const void *a, int a_kind, int64_t M, int K, int32_t a_zp, const void *bc, int N,
                      const void *mult, float y_zp, float lo, float hi, int y_kind, void *y);
void ep_qlinear_add(const void *a, int a_kind, int64_t n, const void *b, int b_kind, int64_t b_period, float ratio_a,
                    float ratio_b, float fixed, float lo, float hi, int y_kind, void *y);
int ep_qlinear_softmax(const void *x, int x_kind, int64_t rows, int64_t n, const void *table, float steps,
                       float y_zp, float lo, float hi, int y_kind, void *y);
int ep_quant_chain(const void *prog, const void *fprog, int n_ops, const void *in0, const void *in1,
                   const void *in2, const void *in3, void *out, void *scratch);
int ep_matmul_batched(const void *A, const void *B, void *C, int batch, int inner, int M, int K, int N, int64_t sa1,
                      int64_t sa2, int64_t lda, int64_t sb1, int64_t sb2, int64_t bk, int64_t bn);
void ep_softmax(const void *x, void *y, int64_t rows, int n, int log_form);
int ep_f16_to_f32(const void *src, void *dst, int64_t n);
int ep_f32_to_f16(const void *src, void *dst, int64_t n);
void ep_tree_leaves(const void *x, int64_t rows, int64_t width, const void *feature, const void *threshold,
                    const void *mode, const void *true_next, const void *false_next, const void *missing_true,
                    const void *roots, const void *depths, int64_t trees, void *leaves, int threads);
void ep_tree_sums(const void *x, int64_t rows, int64_t width, const void *feature, const void *threshold,
                  const void *mode, const void *true_next, const void *false_next, const void *missing_true,
                  const void *roots, const void *depths, int64_t trees, const void *weights, int64_t targets,
                  void *sums, int threads);
void ep_tree_class0(const void *x, int64_t rows, int64_t width, const void *feature, const void *threshold,
                    const void *mode, const void *true_next, const void *false_next, const void *missing_true,
                    const void *roots, const void *depths, int64_t trees, const void *weights, const void *base,
                    int all_positive, const void *labels, void *scores, void *label_out, int threads);
int ep_ml_linear(const void *x, int64_t rows, int k, const void *offset, int offset_step, const void *scale,
                 int scale_step, const void *coef, const void *intercepts, int n, int64_t block, int mode,
                 const void *labels, void *scores, void *label_out);
void ep_ml_logistic_labels(void *e, int64_t rows, int n, const void *labels, void *label_out);
int ep_squeeze_excite(const void *x, void *y, int N, int C, int HW, const void *w1, const void *b1,
                      const void *w2, const void *b2, int R, unsigned gate, float alpha, float beta);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)
NULL = ffi.NULL
ptr = ffi.from_buffer  # a C-contiguous array's data pointer (the caller checked layout and dtype)
# An API-mode module's own ffi.from_buffer, by its lib: a builtin, where cffi.FFI's is a Python wrapper
# around the same call (0.33 against 0.21 us; a MobileNetV3 run makes about 100 of them).
_MODULE_PTRS: dict[int, object] = {}

GEOMETRY = ("C", "H", "W", "M", "KH", "KW", "SH", "SW", "PH", "PW", "DH", "DW", "OH", "OW")  # ConvGeom's fields


def conv_geometry(**fields):
    """kernels.c's ConvGeom (every field of GEOMETRY, by name) for ep_conv2d / ep_depthwise2d."""
    return ffi.new("int[14]", [fields[name] for name in GEOMETRY])


# Epilogue steps (kernels.c): a program is up to 6 steps, 4 bits each, lowest first.
RELU, GELU, GELU_TANH, HARD_SWISH, HARD_SIGMOID, SIGMOID, ADD, SILU, MUL = 1, 2, 3, 4, 5, 6, 7, 8, 9
MAX_STEPS = 6
F32 = np.dtype(np.float32)


# The compiled GEMM is a plain single-threaded tiled loop: it beats OpenBLAS's call overhead on the small
# products of small models (2-3 us at 16x64x64) and stays level up to a few million multiply-adds, but a
# large product runs 3-5x slower than multithreaded BLAS on 2 cores (worse on more), and a weight panel
# wider than L2 makes its column tiles miss the cache (1x1024x1024: 7x). Beyond these bounds the packed
# GEMM takes a product over a declared weight (packed_gemm.py), the NumPy paths (np.dot) any other. The
# bound is packed_gemm.THREADED_MACS: from there a product is worth sharing with the worker pool, which the
# packed GEMM does and this one does not (the zoo transformer's 128x256x256 products: 8% of its run).
GEMM_MAX_MACS = 1 << 22   # m * k * n
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
    """The hash every build compiles into the library, of kernels.c as it is now."""
    return build_info.hash_of(SOURCE)


LOAD_ERROR: str | None = None  # why LIB is None, for `ephost` diagnostics and tests
LOADED_FROM: Path | None = None  # the build the last successful load() opened
API_MODULE: Path | None = None  # and its API-mode module, when that is what it opened (faster calls)
HOW_TO_BUILD = "reinstall ephost (`pip install .` compiles them), or run `ephost build` or `python build.py`"


def packaged_paths() -> list[Path]:
    """The package's own builds (setup.py's extension module), for this interpreter's suffixes."""
    here = Path(__file__).resolve().parent
    name = build_info.MODULE.rsplit(".", 1)[1]
    return [here / f"{name}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def cache_path() -> Path:
    """Where `ephost build` puts the library: the per-user cache, one folder per kernels.c hash."""
    from abi import builder

    return builder.cache_dir() / "cpu_kernels" / source_hash() / LIB_NAME


def candidates() -> list[Path]:
    """Where load() looks, in order: $EPHOST_CPU_KERNELS alone when set, else the package's build,
    a checkout's build/lib, the per-user cache."""
    if os.environ.get("EPHOST_CPU_KERNELS"):
        return [Path(os.environ["EPHOST_CPU_KERNELS"])]
    try:
        cached = [cache_path()]
    except OSError:  # kernels.c unreadable: _open says so for the other candidates
        cached = []
    return [*packaged_paths(), DEFAULT_PATH, *cached]


def load(path: str | os.PathLike | None = None):
    """The library at `path` (default: the first API-mode module beside a candidate, else the first of
    candidates() that opens), or None when none is there, opens, or was built from this kernels.c
    (LOAD_ERROR says why)."""
    global LOAD_ERROR, LOADED_FROM, API_MODULE
    paths = [Path(path)] if path else candidates()
    existing = [p for p in paths if p.is_file()]
    if not existing:
        shown = paths[0] if len(paths) == 1 else ", ".join(map(str, paths))
        LOAD_ERROR = f"{shown} not found ({HOW_TO_BUILD})"
        return None
    errors = []
    if not path and not os.environ.get("EPHOST_CPU_KERNELS"):
        # An API module anywhere first: an editable install compiles the plain library into the package
        # too, and that one must not hide build.py's faster-to-call module in build/lib.
        for p in existing:
            lib, _ = _open_api(build_info.api_module_path(p))
            if lib is not None:
                LOAD_ERROR, LOADED_FROM, API_MODULE = None, p, build_info.api_module_path(p)
                return lib
    for p in existing:
        lib, error = _open(p)
        if lib is not None:
            LOAD_ERROR, LOADED_FROM, API_MODULE = None, p, None
            return lib
        errors.append(error)
    LOAD_ERROR = "; ".join(errors)
    return None


def _open(path: Path):
    """(library, None), or (None, why not): the library at `path` in ABI mode, when built from this kernels.c."""
    try:
        lib = ffi.dlopen(str(path))
        built_from = ffi.string(lib.ep_source_hash()).decode()
    except (OSError, AttributeError) as exc:
        return None, f"{path} could not be opened: {exc}"
    return _checked(lib, path, built_from)


def _open_api(path: Path):
    """The `lib` of the API-mode extension module at `path`, checked as _open checks a library."""
    if not path.is_file():
        return None, f"{path} not found"
    try:
        spec = importlib.util.spec_from_file_location(build_info.API_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        built_from = ffi.string(module.lib.ep_source_hash()).decode()
        declared = ffi.string(module.lib.ep_api_cdef_hash()).decode()
    except (ImportError, OSError, AttributeError) as exc:
        return None, f"{path} could not be imported: {exc}"
    if declared != build_info.cdef_hash(CDEF):
        return None, f"{path} was built from other declarations: {HOW_TO_BUILD}"
    _MODULE_PTRS[id(module.lib)] = module.ffi.from_buffer
    return _checked(module.lib, path, built_from)


def _checked(lib, path: Path, built_from: str):
    """(lib, None) when `lib` was built from this kernels.c, else (None, why not)."""
    try:
        want = source_hash()
    except OSError as exc:  # an install without the C source: nothing to check a build against
        return None, f"{SOURCE} cannot be read ({exc}); the compiled kernels stay off"
    if built_from != want:
        return None, f"{path} was built from another kernels.c ({built_from}; now {want}): {HOW_TO_BUILD}"
    return lib, None


def use(lib) -> None:
    """Make kernels call `lib` (None: the NumPy paths everywhere). For tests."""
    global LIB, ptr
    LIB = lib
    ptr = _MODULE_PTRS.get(id(lib), ffi.from_buffer)


LIB = None if os.environ.get("EPHOST_CPU_NATIVE", "1") == "0" else load()
LOADED_LIB = LIB  # what load() opened: `use` swaps LIB (tests' spies), never this
if LIB is None and os.environ.get("EPHOST_CPU_NATIVE", "1") == "0":
    LOAD_ERROR = "disabled by EPHOST_CPU_NATIVE=0"
use(LIB)
