"""CUDA C source for a plan's steps: one module per plan, one kernel per step (cuBLAS steps excepted).

Pure Python (no CuPy): the source is checked with `nvcc -ptx` on machines without a GPU.
Shapes are static, so every size, stride and scalar constant is baked into the source as a
literal and a kernel's only parameters are its buffers' device pointers: launching it needs no
per-call argument packing beyond those pointers.

Element types: every pointer has its value's C type (program.C_TYPES); float32 buffers are read
and written directly, float16 / bfloat16 ones through `to_f` / `put` (semantics/half.py, in the
module's prelude when the program has half values), so the arithmetic is float32 throughout. A fused
group's intermediate whose value is float16 / bfloat16 in the graph is rounded to that type where its
node would have stored it (`round_intermediates`), so a plan gives the node-by-node graph's result;
`EPHOST_PLAN_ROUND=0` keeps them in float32.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import numpy as np

from plugin_cuda.plan.errors import PlanError
from plugin_cuda.plan.fuse import SMALL_GEMM_MAX_ROWS, Step
from plugin_cuda.plan.program import C_TYPES, F32, ROUNDINGS, Program, f32_literal, strides
from plugin_cuda.plan.symint import SymInt
from plugin_cuda.plan.templates import TILED_GEMM
from plugin_cuda.semantics import GELU_CUDA
from plugin_cuda.semantics.half import HALF_CUDA

EW_BLOCK = 256
INT32_MAX = 2**31 - 1

# Scalar helpers (plain C: the CPU test shim compiles them with g++ too), then warp and block ones.
SCALAR_PRELUDE = r"""
#define EP_INF __int_as_float(0x7f800000)
__device__ __forceinline__ float ep_relu(float a) { return a < 0.0f ? 0.0f : a; }
__device__ __forceinline__ float ep_max(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ float ep_min(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float ep_sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }
""" + GELU_CUDA
PRELUDE = SCALAR_PRELUDE + r"""
__device__ __forceinline__ float ep_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float ep_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
/* Block-wide sum / max; blockDim.x is a multiple of 32. Every warp reduces the per-warp partials
   itself, so all threads get the result without another broadcast. */
__device__ float ep_block_sum(float v, float* sh) {
  v = ep_warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  return ep_warp_sum(lane < nw ? sh[lane] : 0.0f);
}
__device__ float ep_block_max(float v, float* sh) {
  v = ep_warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  return ep_warp_max(lane < nw ? sh[lane] : -EP_INF);
}
"""
# With half values: the storage types and conversions, and the roundings of a Cast (lower_math).
HALF_PRELUDE = HALF_CUDA + r"""
__device__ __forceinline__ float ep_round_f16(float v) { half_bits h; put(&h, 0, v); return to_f(h); }
__device__ __forceinline__ float ep_round_bf16(float v) { bf16_bits h; put(&h, 0, v); return to_f(h); }
"""


def ctype(prog: Program, vid: int) -> str:
    """The C element type of value `vid`'s buffer."""
    return C_TYPES[prog.values[vid].dtype or F32]


def load(prog: Program, vid: int, ref: str) -> str:
    """A float expression reading element `ref` (e.g. "p0[i]") of value `vid`'s buffer."""
    return ref if ctype(prog, vid) == "float" else f"to_f({ref})"


def store(prog: Program, vid: int, ptr: str, index: str, val: str) -> str:
    """A statement writing float `val` at ptr[index] in value `vid`'s type (rounded to nearest even)."""
    return f"{ptr}[{index}] = {val};" if ctype(prog, vid) == "float" else f"put({ptr}, {index}, {val});"


def move(prog: Program, src: int, src_ref: str, dst: int, ptr: str, index: str) -> str:
    """A statement copying one element: the bits as they are when both types are the same."""
    if ctype(prog, src) == ctype(prog, dst):
        return f"{ptr}[{index}] = {src_ref};"
    return store(prog, dst, ptr, index, load(prog, src, src_ref))


def decl(prog: Program, vid: int, name: str, const: bool) -> str:
    """A kernel parameter: the typed restrict pointer to value `vid`'s buffer."""
    return f"{'const ' if const else ''}{ctype(prog, vid)}* __restrict__ {name}"


@dataclass
class KernelSpec:
    """One generated kernel: its name in the module, pointer parameters (value ids), launch shape."""

    name: str
    params: list
    grid: tuple
    block: tuple
    source: str
    step: Step


def _literal_one(d) -> bool:
    """A dim that is 1 for every signature: a literal 1 (a symbolic size of 1 this time is not)."""
    return type(d) is int and d == 1


def _same_dims(a: tuple, b: tuple) -> bool:
    """Equal for every signature: equal values, and each pair both literal or both symbolic."""
    return len(a) == len(b) and all(x == y and (type(x) is int) == (type(y) is int) for x, y in zip(a, b))


def index_expr(out_shape: tuple, leaf_shape: tuple, i: str = "i") -> str:
    """The flat index into a leaf broadcast against `out_shape`, for flat output index `i`.

    Symbolic sizes (plan/symint.py) that are 1 this time are not taken for broadcasts, so the
    expression holds for every size they take."""
    r = len(out_shape)
    if len(leaf_shape) > r:
        raise PlanError(f"leaf shape {leaf_shape} has a higher rank than its output {out_shape}")
    leaf = (1,) * (r - len(leaf_shape)) + tuple(leaf_shape)
    if all(_literal_one(d) for d in leaf):
        return "0"
    if _same_dims(leaf, tuple(out_shape)):
        return i
    # A suffix of the output's dims (a bias over the last axis): a plain modulo.
    for j in range(r):
        if all(_literal_one(leaf[d]) for d in range(j)) and _same_dims(leaf[j:], tuple(out_shape[j:])):
            return f"({i} % {math.prod(out_shape[j:])})"
    ostr, lstr = strides(tuple(out_shape)), strides(leaf)
    terms = []
    for d in range(r):
        lo, od = leaf[d], out_shape[d]
        if lo != od:
            if lo != 1:
                raise PlanError(f"leaf shape {leaf_shape} does not broadcast to {out_shape}")
            continue  # broadcast along d
        if not (_literal_one(lo) or _literal_one(od)):
            terms.append(f"(({i} / {ostr[d]}) % {od}) * {lstr[d]}")
    return "(" + " + ".join(terms) + ")" if terms else "0"


def _check_size(prog: Program, vids) -> None:
    for v in vids:
        if prog.values[v].size > INT32_MAX:
            raise PlanError(f"tensor '{prog.values[v].name}' has {prog.values[v].size} elements; "
                            f"a compiled plan indexes with int32 (up to {INT32_MAX})")


def _inline_scalar(prog: Program, vid: int) -> str | None:
    c = prog.values[vid].const
    if c is not None and np.asarray(c).size == 1:
        return f32_literal(float(np.asarray(c, np.float32).reshape(-1)[0]))
    return None


class _Body:
    """Assembles a kernel's parameter list and statements."""

    def __init__(self, prog: Program):
        self.prog = prog
        self.params: list = []  # value ids
        self.decls: list = []
        self.names: dict = {}

    def pointer(self, vid: int, const: bool) -> str:
        name = f"p{len(self.params)}"
        self.params.append(vid)
        self.decls.append(decl(self.prog, vid, name, const))
        return name


def round_intermediates() -> bool:
    """Whether fused half-precision intermediates are rounded to their type (EPHOST_PLAN_ROUND=0: no).

    Rounding where each node would store its result keeps a plan's result that of the graph run node by
    node, and close to a framework's eager run in the same type (PyTorch rounds every op's output); in
    float32 the intermediates are more precise but drift from both.
    """
    return os.environ.get("EPHOST_PLAN_ROUND", "1") != "0"


def rounded(prog: Program, vid: int, expr: str) -> str:
    """`expr` (a float32 C expression computing value `vid`) rounded to the value's half type, if it has one
    and round_intermediates()."""
    dtype = prog.values[vid].dtype or F32
    if dtype == F32 or not round_intermediates():
        return expr
    return ROUNDINGS[dtype].format(expr)


def _epilogue(prog: Program, body: _Body, group, shape: tuple, i: str, first: str | None) -> list:
    """Statements computing a group's members at flat index `i` and writing its exports.

    `first`: the C variable already holding the head's result (None without a head).
    """
    lines = []
    var: dict = {}
    if group.head is not None:
        head = group.head.outputs[0]
        value = rounded(prog, head, first)
        var[head] = first
        if value != first:  # a half head: rounded once, read by every member
            lines.append(f"const float h0 = {value};")
            var[head] = "h0"
    for k, leaf in enumerate(group.leaves):
        lit = _inline_scalar(prog, leaf)
        if lit is not None:
            var[leaf] = lit
            continue
        p = body.pointer(leaf, const=True)
        ref = f"{p}[{index_expr(shape, prog.values[leaf].shape, i)}]"
        lines.append(f"const float a{k} = {load(prog, leaf, ref)};")
        var[leaf] = f"a{k}"
    for k, m in enumerate(group.members):
        args = [var[v] for v in m.inputs]
        lines.append(f"const float v{k} = {rounded(prog, m.outputs[0], m.attrs['expr'].format(*args))};")
        var[m.outputs[0]] = f"v{k}"
    for v in group.exports:
        p = body.pointer(v, const=False)
        lines.append(store(prog, v, p, i, var[v]))
    return lines


def ew_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    g = step.group
    if g.head is not None:
        return gemm_kernel(prog, step, name) if g.head.kind == "gemm" else head_kernel(prog, step, name)
    shape = g.shape
    n = math.prod(shape)
    _check_size(prog, g.leaves + g.exports)
    body = _Body(prog)
    lines = _epilogue(prog, body, g, shape, "i", None)
    src = (f'extern "C" __global__ void __launch_bounds__({EW_BLOCK}) {name}({", ".join(body.decls)}) {{\n'
           f"  const int i = blockIdx.x * {EW_BLOCK} + threadIdx.x;\n"
           f"  if (i >= {n}) return;\n  " + "\n  ".join(lines) + "\n}\n")
    return KernelSpec(name, body.params, (max(1, -(-n // EW_BLOCK)), 1, 1), (EW_BLOCK, 1, 1), src, step)


def gemm_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    op = step.group.head
    a_shape = prog.values[op.inputs[0]].shape
    rows = math.prod(a_shape[:-1]) if len(a_shape) > 1 else 1
    return gemv_kernel(prog, step, name) if rows <= SMALL_GEMM_MAX_ROWS else tiled_gemm_kernel(prog, step, name)


# Output tiles of the generated GEMM: 64x64 (4x4 per thread) when that gives enough blocks to fill
# the GPU, else 32x32 (2x2 per thread): four times the blocks for the small GEMMs of batch-1 models.
TILE_BLOCKS_WANTED = 96


def tile_size(m_dim: int, n_dim: int) -> int:
    blocks64 = -(-m_dim // 64) * -(-n_dim // 64)
    return 64 if blocks64 >= TILE_BLOCKS_WANTED else 32


def tiled_gemm_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """out[m, n] = epilogue(alpha * A @ B): T x T output tiles (T = 64 or 32), 16-deep k slices
    staged in shared memory (the next one prefetched into registers while this one is used), 256
    threads computing R x R outputs each (R = T / 16; rows ty + 16 r, columns tx + 16 c)."""
    g = step.group
    op = g.head
    a_shape, b_shape = prog.values[op.inputs[0]].shape, prog.values[op.inputs[1]].shape
    k_dim, n_dim = b_shape
    m_dim = math.prod(a_shape[:-1])
    alpha = float(op.attrs.get("alpha", 1.0))
    _check_size(prog, list(op.inputs) + g.leaves + g.exports)
    if max(m_dim * k_dim, k_dim * n_dim, m_dim * n_dim) > INT32_MAX:
        raise PlanError(f"GEMM in '{step.name}' is too large for int32 indexing")
    t = tile_size(m_dim, n_dim)
    r_ = t // 16  # outputs per thread along each axis, and loads per thread per tile
    shift = t.bit_length() - 1  # e / t as a shift
    body = _Body(prog)
    pa = body.pointer(op.inputs[0], const=True)
    pb = body.pointer(op.inputs[1], const=True)
    scaled = "acc[r][c]" if alpha == 1.0 else f"(acc[r][c] * {f32_literal(alpha)})"
    lines = _epilogue(prog, body, g, g.shape, "i", "g0")
    cva, cvb = ("" if ctype(prog, v) == "float" else "to_f" for v in op.inputs[:2])
    src = TILED_GEMM.format(name=name, decls=", ".join(body.decls), t=t, t4=t + 4, tmask=t - 1, r_=r_, shift=shift,
                            m_dim=m_dim, n_dim=n_dim, k_dim=k_dim, pa=pa, pb=pb, cva=cva, cvb=cvb, scaled=scaled,
                            epilogue=(chr(10) + "        ").join(lines))
    grid = (-(-n_dim // t), -(-m_dim // t), 1)
    return KernelSpec(name, body.params, grid, (256, 1, 1), src, step)


def gemv_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """out[m, n] = epilogue(alpha * sum_k A[m, k] B[k, n]) for M <= 8 rows: 32 columns per block,
    `ks` k-slices per column reduced through shared memory, one row finalised per k-slice thread."""
    g = step.group
    op = g.head
    a_shape, b_shape = prog.values[op.inputs[0]].shape, prog.values[op.inputs[1]].shape
    k_dim, n_dim = b_shape
    m_dim = int(math.prod(a_shape[:-1]) if len(a_shape) > 1 else 1)  # sizes register and shared arrays
    ks = 32 if k_dim >= 128 else 8
    alpha = float(op.attrs.get("alpha", 1.0))
    _check_size(prog, list(op.inputs) + g.leaves + g.exports)
    body = _Body(prog)
    pa = body.pointer(op.inputs[0], const=True)
    pb = body.pointer(op.inputs[1], const=True)
    scaled = "s" if alpha == 1.0 else f"(s * {f32_literal(alpha)})"
    lines = _epilogue(prog, body, g, g.shape, "i", "g0")
    src = f"""extern "C" __global__ void __launch_bounds__({32 * ks}) {name}({", ".join(body.decls)}) {{
  __shared__ float red[{ks * m_dim * 33}];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * 32 + tx;
  float acc[{m_dim}];
#pragma unroll
  for (int m = 0; m < {m_dim}; ++m) acc[m] = 0.0f;
  if (col < {n_dim}) {{
#pragma unroll 4
    for (int k = ty; k < {k_dim}; k += {ks}) {{
      const float b = {load(prog, op.inputs[1], f"{pb}[k * {n_dim} + col]")};
#pragma unroll
      for (int m = 0; m < {m_dim}; ++m) acc[m] += {load(prog, op.inputs[0], f"{pa}[m * {k_dim} + k]")} * b;
    }}
  }}
#pragma unroll
  for (int m = 0; m < {m_dim}; ++m) red[(ty * {m_dim} + m) * 33 + tx] = acc[m];
  __syncthreads();
  if (ty < {m_dim} && col < {n_dim}) {{
    float s = 0.0f;
#pragma unroll 8
    for (int j = 0; j < {ks}; ++j) s += red[(j * {m_dim} + ty) * 33 + tx];
    const int i = ty * {n_dim} + col;
    const float g0 = {scaled};
    {(chr(10) + "    ").join(lines)}
  }}
}}
"""
    if k_dim * n_dim > INT32_MAX:
        raise PlanError(f"GEMM in '{step.name}' has {k_dim}x{n_dim} weights; int32 indexing allows {INT32_MAX}")
    return KernelSpec(name, body.params, (-(-n_dim // 32), 1, 1), (32, ks, 1), src, step)


SYMBOLIC_ROW_BLOCK = 128


def _row_block(cols: int) -> int:
    """Threads per row (a launch bound: a literal). A row length that is symbolic (an attention
    row over the sequence) gets one block size for every length, so its source does not change
    with the shape; the kernels loop over the row in steps of the block either way."""
    if isinstance(cols, SymInt):
        return SYMBOLIC_ROW_BLOCK
    return int(min(256, max(32, -(-cols // 32) * 32)))


def _ll(x) -> str:
    """`x` as a 64-bit C operand: a literal with LL, or a symbolic size's expression cast."""
    return f"(long long){x}" if isinstance(x, SymInt) else f"{x}LL"


def _u(x) -> str:
    """`x` as a 32-bit unsigned C operand: a literal with u, or a symbolic size's expression cast."""
    return f"(unsigned)({x})" if isinstance(x, SymInt) else f"{int(x)}u"


def _softmax_logit(prog: Program, op) -> tuple[str, str, list]:
    """(row set-up, logit of column c, extra pointer params) of a softmax step on row `row`; with an
    attention mask (Attention's additive float attn_mask), the mask row is found from the row's (b, h, i)
    and the mask's broadcast strides; columns past the mask's length are masked (padding)."""
    x = load(prog, op.inputs[0], "xr[c]")
    if "mask_strides" not in op.attrs:
        return "", x, []
    mb, mh, mi = op.attrs["mask_strides"]
    q_len, heads = op.attrs["q_len"], op.attrs["heads"]
    # 32-bit quotients (a plan's tensors have at most INT32_MAX elements, so has its row count): 64-bit
    # division is a long software sequence per row.
    setup = (f"  const unsigned ri = (unsigned)row % {_u(q_len)}, rbh = (unsigned)row / {_u(q_len)};\n"
             f"  const {ctype(prog, op.inputs[1])}* mr = p2 + (rbh / {_u(heads)}) * {_ll(mb)} + (rbh % {_u(heads)}) * {_ll(mh)}"
             f" + ri * {_ll(mi)};\n")
    mask = load(prog, op.inputs[1], "mr[c]")
    return setup, f"(c < {op.attrs['mask_len']} ? {x} + {mask} : -EP_INF)", [op.inputs[1]]


# Row kernels (softmax, norms): a row of at most this many columns (a literal) is one warp's, held in
# registers (WARP_ROWS_PER_BLOCK rows to a block): no barrier, one read; longer literal rows take a block
# each. Symbolic softmax rows (attention over the sequence) take a warp too, in passes over memory.
WARP_ROW_COLS = 1024
WARP_ROWS_PER_BLOCK = 4


def softmax_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """Softmax / LogSoftmax over the last axis (Attention's scores with their scale, mask and causal
    limit). A warp per row where the row is short or symbolic: attention rows (a sequence long) then
    need no barrier, and a literal row is read once, into registers. BERT-base's 12,288 rows of 128 at
    batch 8 took 20 us a layer as a block per row against 4 us for PyTorch's softmax (H200)."""
    op = step.op
    shape = prog.values[op.inputs[0]].shape
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    _check_size(prog, op.inputs + op.outputs)
    setup, logit, extra = _softmax_logit(prog, op)
    x, y = op.inputs[0], op.outputs[0]
    params = [x, y] + extra
    head = (", ".join([decl(prog, x, "p0", True), decl(prog, y, "p1", False)]
                      + ([decl(prog, extra[0], "p2", True)] if extra else [])) + ") {\n"
            f"  const int C = {cols};\n")
    # Causal attention: row r is query i = r % q_len, which sees keys 0..i (the rest weigh 0).
    limit = f"  const int L = {'(int)((unsigned)row % ' + _u(op.attrs['q_len']) + ') + 1' if op.attrs.get('causal') else 'C'};\n"
    if isinstance(cols, SymInt) or cols <= WARP_ROW_COLS:
        block = 32 * WARP_ROWS_PER_BLOCK
        row = f"  const long long R = {_ll(rows)};\n" + _warp_rows()
        make = _softmax_warp_registers if not isinstance(cols, SymInt) else _softmax_warp_loops
        body = make(prog, op, logit, bool(extra), cols)
        grid = -(-max(rows, 1) // WARP_ROWS_PER_BLOCK)
    else:
        block = _row_block(cols)
        row = f"  constexpr int B = {block};\n  __shared__ float sh[32];\n  const long long row = blockIdx.x;\n"
        body = _softmax_block(prog, op, logit, bool(extra))
        grid = max(rows, 1)
    pointers = (f"  const {ctype(prog, x)}* xr = p0 + row * C;\n"
                f"  {ctype(prog, y)}* yr = p1 + row * C;\n")
    src = (f'extern "C" __global__ void __launch_bounds__({block}) {name}(' + head + row + pointers + setup
           + limit + body + "}\n")
    return KernelSpec(name, params, (grid, 1, 1), (block, 1, 1), src, step)


def _softmax_zeros(prog: Program, y: int, loop: str) -> str:
    """A row whose every key is masked has no defined softmax: zeros, as the per-node kernel and the
    ONNX reference give."""
    return f"  if (m == -EP_INF) {{ {loop} {store(prog, y, 'yr', 'c', '0.0f')} return; }}\n"


def _softmax_warp_registers(prog: Program, op, logit: str, masked: bool, cols: int) -> str:
    """One warp per literal row of at most WARP_ROW_COLS: column lane + 32 j in v[j]."""
    y = op.outputs[0]
    n = max(1, -(-int(cols) // 32))
    each = f"#pragma unroll\n  for (int j = 0; j < {n}; ++j) {{ const int c = lane + 32 * j; "
    text = (f"  float v[{n}];\n  float m = -EP_INF;\n"
            + each + f"v[j] = c < L ? {logit} : -EP_INF; m = fmaxf(m, v[j]); }}\n"
            "  m = ep_warp_max(m);\n"
            + (_softmax_zeros(prog, y, "for (int c = lane; c < C; c += 32)") if masked else "")
            + "  float s = 0.0f;\n")
    if op.attrs["log"]:
        return (text + each + "if (c < L) s += expf(v[j] - m); }\n"
                "  const float ls = logf(ep_warp_sum(s));\n"
                + each + f"if (c < C) {store(prog, y, 'yr', 'c', 'v[j] - m - ls')} }}\n")
    return (text + each + "v[j] = c < L ? expf(v[j] - m) : 0.0f; s += v[j]; }\n"
            "  s = ep_warp_sum(s);\n"
            + each + f"if (c < C) {store(prog, y, 'yr', 'c', 'v[j] / s')} }}\n")


def _softmax_warp_loops(prog: Program, op, logit: str, masked: bool, cols) -> str:
    """One warp per row of symbolic length (the source is the same for every length): three passes."""
    return _softmax_passes(prog, op, logit, masked, "for (int c = lane; c < {end}; c += 32)",
                           "ep_warp_max(m)", "ep_warp_sum(s)")


def _softmax_block(prog: Program, op, logit: str, masked: bool) -> str:
    """One block per (long, literal) row: three passes, block-wide reductions."""
    return _softmax_passes(prog, op, logit, masked, "for (int c = threadIdx.x; c < {end}; c += B)",
                           "ep_block_max(m, sh)", "ep_block_sum(s, sh)")


def _softmax_passes(prog: Program, op, logit: str, masked: bool, loop: str, reduce_max: str, reduce_sum: str) -> str:
    """Maximum, sum of exponentials, then the outputs, each a pass over the row (`loop` with {end})."""
    x, y = op.inputs[0], op.outputs[0]
    up_to_l, up_to_c = loop.format(end="L"), loop.format(end="C")
    if op.attrs["log"]:
        finish = ("  const float ls = logf(s);\n  " + up_to_c + " "
                  + store(prog, y, "yr", "c", f"{load(prog, x, 'xr[c]')} - m - ls") + "\n")
    else:
        finish = f"  {up_to_c} " + store(prog, y, "yr", "c", f"c < L ? expf({logit} - m) / s : 0.0f") + "\n"
    # (the all-masked check follows the max's reduction, whose barriers precede every write)
    return ("  float m = -EP_INF;\n"
            f"  {up_to_l} m = fmaxf(m, {logit});\n"
            f"  m = {reduce_max};\n"
            + (_softmax_zeros(prog, y, up_to_c) if masked else "")
            + "  float s = 0.0f;\n"
            f"  {up_to_l} s += expf({logit} - m);\n"
            f"  s = {reduce_sum};\n" + finish)


def _warp_rows() -> str:
    """The prologue of a kernel with one warp per row (WARP_ROWS_PER_BLOCK rows to a block): `row`, whose
    warps past the last row leave together (their shuffles need no partner), and `lane`."""
    return (f"  const long long row = (long long)blockIdx.x * {WARP_ROWS_PER_BLOCK} + (threadIdx.x >> 5);\n"
            "  if (row >= R) return;\n  const int lane = threadIdx.x & 31;\n")


def norm_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """LayerNorm / RMSNorm of one row; the statistics in float32 whatever the types. A row of up to
    WARP_ROW_COLS literal columns is one warp's, read once into registers (BERT-base's 768: 24 a lane);
    a longer or symbolic one a block's, in passes over memory."""
    op = step.op
    cols = op.attrs["cols"]
    # the shape's product, not Value.size (a plain int): a symbolic row count stays an expression, so the
    # source (which bounds the warps by it) is the same for every signature
    rows = math.prod(prog.values[op.inputs[0]].shape) // max(cols, 1)
    _check_size(prog, op.inputs + op.outputs)
    eps = f32_literal(op.attrs["eps"])
    has_bias = len(op.inputs) > 2
    params = [op.inputs[0], op.inputs[1]] + ([op.inputs[2]] if has_bias else []) + [op.outputs[0]]
    out = f"p{len(params) - 1}"
    decls = [decl(prog, v, f"p{k}", k < len(params) - 1) for k, v in enumerate(params)]
    x, y = op.inputs[0], op.outputs[0]
    warp = not isinstance(cols, SymInt) and cols <= WARP_ROW_COLS
    if warp:
        block, grid = 32 * WARP_ROWS_PER_BLOCK, -(-max(rows, 1) // WARP_ROWS_PER_BLOCK)
        start = f"  const long long R = {_ll(rows)};\n" + _warp_rows()
        body = _norm_warp(prog, op, eps, has_bias, -(-int(cols) // 32))
    else:
        block, grid = _row_block(cols), max(rows, 1)
        start = f"  constexpr int B = {block};\n  __shared__ float sh[32];\n  const long long row = blockIdx.x;\n"
        body = _norm_block(prog, op, eps, has_bias)
    head = (f'extern "C" __global__ void __launch_bounds__({block}) {name}({", ".join(decls)}) {{\n'
            f"  const int C = {cols};\n" + start +
            f"  const {ctype(prog, x)}* xr = p0 + row * C;\n"
            f"  {ctype(prog, y)}* yr = {out} + row * C;\n")
    return KernelSpec(name, params, (grid, 1, 1), (block, 1, 1), head + body + "}\n", step)


def _norm_block(prog: Program, op, eps: str, has_bias: bool) -> str:
    x, y = op.inputs[0], op.outputs[0]
    xc, scale = load(prog, x, "xr[c]"), load(prog, op.inputs[1], "p1[c]")
    if op.attrs["kind"] == "rms":
        # RMSNormalization's function body casts the normalised value to X's type before the scale
        # (so does PyTorch's Llama RMSNorm): one rounding more than x * r * scale in half plans.
        normalised = rounded(prog, x, f"{xc} * r")
        return ("  float q = 0.0f;\n"
                f"  for (int c = threadIdx.x; c < C; c += B) {{ const float v = {xc}; q += v * v; }}\n"
                f"  const float r = 1.0f / sqrtf(ep_block_sum(q, sh) / (float)C + {eps});\n"
                f"  for (int c = threadIdx.x; c < C; c += B) {store(prog, y, 'yr', 'c', f'{normalised} * {scale}')}\n")
    affine = f" + {load(prog, op.inputs[2], 'p2[c]')}" if has_bias else ""
    return ("  float s = 0.0f;\n"
            f"  for (int c = threadIdx.x; c < C; c += B) s += {xc};\n"
            "  const float mean = ep_block_sum(s, sh) / (float)C;\n"
            "  float q = 0.0f;\n"
            f"  for (int c = threadIdx.x; c < C; c += B) {{ const float d = {xc} - mean; q += d * d; }}\n"
            f"  const float r = 1.0f / sqrtf(ep_block_sum(q, sh) / (float)C + {eps});\n"
            f"  for (int c = threadIdx.x; c < C; c += B) "
            f"{store(prog, y, 'yr', 'c', f'({xc} - mean) * r * {scale}{affine}')}\n")


def _norm_warp(prog: Program, op, eps: str, has_bias: bool, n: int) -> str:
    """The row's column lane + 32 j in v[j] (0 past the row); the same statistics as _norm_block."""
    x, y = op.inputs[0], op.outputs[0]
    scale = load(prog, op.inputs[1], "p1[c]")
    each = f"#pragma unroll\n  for (int j = 0; j < {n}; ++j) {{ const int c = lane + 32 * j; "
    text = (f"  float v[{n}];\n" + each + f"v[j] = c < C ? {load(prog, x, 'xr[c]')} : 0.0f; }}\n")
    if op.attrs["kind"] == "rms":
        normalised = rounded(prog, x, "v[j] * r")  # as _norm_block: the normalised value in X's type
        return (text + "  float q = 0.0f;\n" + each + "q += v[j] * v[j]; }\n"
                f"  const float r = 1.0f / sqrtf(ep_warp_sum(q) / (float)C + {eps});\n"
                + each + f"if (c < C) {store(prog, y, 'yr', 'c', f'{normalised} * {scale}')} }}\n")
    affine = f" + {load(prog, op.inputs[2], 'p2[c]')}" if has_bias else ""
    return (text + "  float s = 0.0f;\n" + each + "s += v[j]; }\n"
            "  const float mean = ep_warp_sum(s) / (float)C;\n"
            "  float q = 0.0f;\n" + each + "if (c < C) { const float d = v[j] - mean; q += d * d; } }\n"
            f"  const float r = 1.0f / sqrtf(ep_warp_sum(q) / (float)C + {eps});\n"
            + each + f"if (c < C) {store(prog, y, 'yr', 'c', f'(v[j] - mean) * r * {scale}{affine}')} }}\n")


def transpose_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    op = step.op
    in_shape = prog.values[op.inputs[0]].shape
    perm = op.attrs["perm"]
    out_shape = tuple(in_shape[p] for p in perm)
    n = math.prod(out_shape)
    _check_size(prog, op.inputs + op.outputs)
    ostr, istr = strides(out_shape), strides(in_shape)
    terms = [f"((i / {ostr[d]}) % {out_shape[d]}) * {istr[perm[d]]}" for d in range(len(perm))
             if not _literal_one(out_shape[d])]
    src_index = " + ".join(terms) if terms else "0"
    line = "  " + move(prog, op.inputs[0], f"p0[{src_index}]", op.outputs[0], "p1", "i") + "\n"
    return _elementwise_spec(prog, name, [op.inputs[0], op.outputs[0]], n, line, step)


def count(prog: Program, vid: int) -> int:
    """Value `vid`'s element count as its shape's product: with symbolic dims a SymInt whose source is
    an expression of them, where Value.size is the signature's plain number. A bound written from
    Value.size made the source, hence the module, differ per shape: the Llama plan's RotaryEmbedding
    compiled once more at every new (batch, seq)."""
    return math.prod(prog.values[vid].shape)


def _elementwise_spec(prog: Program, name: str, params: list, n: int, body: str, step: Step,
                      consts: int = 1) -> KernelSpec:
    """A one-thread-per-output-element kernel: `consts` read-only pointers then the output p{consts},
    each of its value's type (params: the value ids)."""
    decls = [decl(prog, v, f"p{k}", k < consts) for k, v in enumerate(params)]
    src = (f'extern "C" __global__ void __launch_bounds__({EW_BLOCK}) {name}({", ".join(decls)}) {{\n'
           f"  const int i = blockIdx.x * {EW_BLOCK} + threadIdx.x;\n"
           f"  if (i >= {n}) return;\n" + body + "}\n")
    return KernelSpec(name, params, (max(1, -(-n // EW_BLOCK)), 1, 1), (EW_BLOCK, 1, 1), src, step)


def _strided_copy(prog: Program, step: Step, name: str, shape: tuple, other: list, gather: bool) -> KernelSpec:
    """One thread per element of `shape` (the contiguous side); `other` holds the strided side's
    stride per dimension, from attrs["offset"]: a read from it (gather) or a write into it."""
    op = step.op
    _check_size(prog, op.inputs + op.outputs)
    own = strides(shape)
    index = " + ".join([str(op.attrs["offset"])] + [f"((i / {own[d]}) % {shape[d]}) * {other[d]}"
                                                    for d in range(len(shape)) if not _literal_one(shape[d])])
    x, y = op.inputs[0], op.outputs[0]
    line = "  " + (move(prog, x, f"p0[{index}]", y, "p1", "i") if gather else move(prog, x, "p0[i]", y, "p1", index)) + "\n"
    return _elementwise_spec(prog, name, [x, y], math.prod(shape), line, step)


def copy_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    out_shape = prog.values[step.op.outputs[0]].shape
    return _strided_copy(prog, step, name, out_shape, step.op.attrs["in_strides"], gather=True)


def place_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    in_shape = prog.values[step.op.inputs[0]].shape
    return _strided_copy(prog, step, name, in_shape, step.op.attrs["out_strides"], gather=False)


def rotary_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """RotaryEmbedding: element d < rot of a head is rotated with its partner (d +- rot/2, or its
    neighbour when interleaved) by the cos/sin of its token; the rest is copied."""
    op, a = step.op, step.op.attrs
    n = count(prog, op.outputs[0])
    _check_size(prog, op.inputs + op.outputs)
    size, seq, rot, half = a["size"], a["seq"], a["rot"], a["rot"] // 2
    row = f"{a['heads'] * size}" if a["seq_major"] else f"{size}"  # elements between two tokens of a head
    per_batch = seq * a["heads"] * size
    xv, y = op.inputs[0], op.outputs[0]

    def x_at(ref: str) -> str:
        return load(prog, xv, f"p0[{ref}]")

    def rotated(sign: str, other: str) -> str:
        # RotaryEmbedding's function body multiplies in X's type: each product is rounded to it.
        return f"{rounded(prog, y, 'x * c')} {sign} {rounded(prog, y, f'{x_at(other)} * s')}"

    if a["interleaved"]:
        j, partner = "(d >> 1)", f"((d & 1) ? {rotated('+', 'i - 1')} : {rotated('-', 'i + 1')})"
    else:
        j = f"(d < {half} ? d : d - {half})"
        partner = f"(d < {half} ? {rotated('-', f'i + {half}')} : {rotated('+', f'i - {half}')})"
    body = (f"  const int d = i % {size}, t = (i / {row}) % {seq}, b = i / {per_batch};\n"
            f"  const float x = {x_at('i')};\n"
            f"  if (d >= {rot}) {{ {store(prog, y, 'p3', 'i', 'x')} return; }}\n"
            f"  const int k = b * {a['cache_batch']} + t * {half} + {j};\n"
            f"  const float c = {load(prog, op.inputs[1], 'p1[k]')}, s = {load(prog, op.inputs[2], 'p2[k]')};\n"
            f"  {store(prog, y, 'p3', 'i', partner)}\n")
    return _elementwise_spec(prog, name, list(op.inputs) + [y], n, body, step, consts=3)


def _conv_sum(prog: Program, op, x: str, w: str, i: str, channels: tuple) -> list:
    """Statements leaving in `acc` the products of output element `i` of convolution `op` over its
    group's input channels [channels[0], channels[1]) (C expressions) and the whole kernel window."""
    a = op.attrs
    n_, cin, h, w_ = prog.values[op.inputs[0]].shape
    cout, cpg, kh, kw = prog.values[op.inputs[1]].shape
    oh, ow = prog.values[op.outputs[0]].shape[-2:]
    (sh, sw), (dh, dw), (ph, pw) = a["strides"], a["dilations"], a["pads"]
    per_group = cout // a["group"]
    return [f"const int ox = {i} % {ow}, oy = ({i} / {ow}) % {oh}, co = ({i} / {ow * oh}) % {cout}, "
            f"b = {i} / {ow * oh * cout};",
            f"const {ctype(prog, op.inputs[0])}* xb = {x} + ((long long)b * {cin} + (co / {per_group}) * {cpg}) * {h * w_};",
            f"const {ctype(prog, op.inputs[1])}* wb = {w} + (long long)co * {cpg * kh * kw};",
            "float acc = 0.0f;",
            f"for (int c = {channels[0]}; c < {channels[1]}; ++c) {{",
            f"  for (int ky = 0; ky < {kh}; ++ky) {{",
            f"    const int iy = oy * {sh} - {ph} + ky * {dh};",
            f"    if (iy < 0 || iy >= {h}) continue;",
            f"    for (int kx = 0; kx < {kw}; ++kx) {{",
            f"      const int ix = ox * {sw} - {pw} + kx * {dw};",
            f"      if (ix >= 0 && ix < {w_}) acc += {load(prog, op.inputs[0], f'xb[(c * {h} + iy) * {w_} + ix]')} * "
            f"{load(prog, op.inputs[1], f'wb[(c * {kh} + ky) * {kw} + kx]')};",
            "    }", "  }", "}"]


def _head_sum(prog: Program, op, ptrs: list) -> list:
    """Statements leaving a head's value at flat output index i in `acc`: a whole convolution
    (direct, one thread per output element; no im2col buffer) or the sum of a split one's slices."""
    shape = prog.values[op.outputs[0]].shape
    if op.kind == "conv":
        lines = _conv_sum(prog, op, ptrs[0], ptrs[1], "i", (0, prog.values[op.inputs[1]].shape[1]))
    else:  # slice_sum: the partial sums of conv_partial, slice-major
        n = math.prod(shape)
        lines = [f"const int co = (i / {math.prod(shape[2:])}) % {shape[1]};", "float acc = 0.0f;",
                 f"for (int s = 0; s < {op.attrs['slices']}; ++s) acc += {load(prog, op.inputs[0], f'{ptrs[0]}[s * {n} + i]')};"]
    if len(ptrs) > (2 if op.kind == "conv" else 1):
        lines.append(f"acc += {load(prog, op.inputs[-1], f'{ptrs[-1]}[co]')};")  # the bias
    return lines


def head_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """A convolution head then its group's elementwise epilogue (bias, activation, residual add),
    one thread per output element."""
    g = step.group
    n = math.prod(g.shape)
    _check_size(prog, list(g.head.inputs) + g.leaves + g.exports)
    body = _Body(prog)
    ptrs = [body.pointer(v, const=True) for v in g.head.inputs]
    lines = _head_sum(prog, g.head, ptrs) + _epilogue(prog, body, g, g.shape, "i", "acc")
    src = (f'extern "C" __global__ void __launch_bounds__({EW_BLOCK}) {name}({", ".join(body.decls)}) {{\n'
           f"  const int i = blockIdx.x * {EW_BLOCK} + threadIdx.x;\n"
           f"  if (i >= {n}) return;\n  " + "\n  ".join(lines) + "\n}\n")
    return KernelSpec(name, body.params, (max(1, -(-n // EW_BLOCK)), 1, 1), (EW_BLOCK, 1, 1), src, step)


def conv_partial_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """Slice s of a split convolution: the products over input channels [s * chunk, (s + 1) * chunk)
    of its group, for every output element (slice-major output; slice_sum adds them)."""
    op = step.op
    slices = op.attrs["slices"]
    n = count(prog, op.outputs[0]) // slices
    cpg = prog.values[op.inputs[1]].shape[1]
    chunk = -(-cpg // slices)
    _check_size(prog, op.inputs + op.outputs)
    lines = [f"const int s = i / {n}, j = i % {n};"]
    lines += _conv_sum(prog, op, "p0", "p1", "j", (f"s * {chunk}", f"((s + 1) * {chunk} < {cpg} ? (s + 1) * {chunk} : {cpg})"))
    lines.append(store(prog, op.outputs[0], "p2", "i", "acc"))
    return _elementwise_spec(prog, name, list(op.inputs) + [op.outputs[0]], n * slices,
                             "  " + "\n  ".join(lines) + "\n", step, consts=2)


def pool_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """MaxPool / AveragePool, one thread per output element; taps on padding are skipped (an
    average counts them when count_include_pad, up to the end padding), as the per-node kernels do."""
    op, a = step.op, step.op.attrs
    _, _, h, w = prog.values[op.inputs[0]].shape
    oh, ow = prog.values[op.outputs[0]].shape[-2:]
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = a["kernel"], a["strides"], a["dilations"], a["pads"]
    peh, pew = a["pads_end"]
    if a["average"]:
        init, inside = "float acc = 0.0f; int taps = 0;", "{ acc += v; ++taps; }"
        outside = f"if (iy >= {-ph} && iy < {h + peh} && ix >= {-pw} && ix < {w + pew}) ++taps;" if a["include_pad"] else ""
        result = "taps > 0 ? acc / (float)taps : 0.0f"
    else:
        init, inside, outside, result = "float acc = -3.402823466e+38f;", "{ if (v > acc) acc = v; }", "", "acc"
    body = (f"  const int ox = i % {ow}, oy = (i / {ow}) % {oh};\n"
            f"  const {ctype(prog, op.inputs[0])}* xb = p0 + (long long)(i / {ow * oh}) * {h * w};\n"
            f"  {init}\n"
            f"  for (int ky = 0; ky < {kh}; ++ky) {{\n"
            f"    const int iy = oy * {sh} - {ph} + ky * {dh};\n"
            f"    for (int kx = 0; kx < {kw}; ++kx) {{\n"
            f"      const int ix = ox * {sw} - {pw} + kx * {dw};\n"
            f"      if (iy >= 0 && iy < {h} && ix >= 0 && ix < {w}) {{ const float v = {load(prog, op.inputs[0], f'xb[iy * {w} + ix]')}; {inside} }}\n"
            + (f"      else {outside}\n" if outside else "")
            + "    }\n  }\n"
            f"  {store(prog, op.outputs[0], 'p1', 'i', result)}\n")
    return _elementwise_spec(prog, name, [op.inputs[0], op.outputs[0]], count(prog, op.outputs[0]), body, step)


def mean_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    op = step.op
    inner = op.attrs["inner"]
    _check_size(prog, op.inputs + op.outputs)
    body = (f"  const {ctype(prog, op.inputs[0])}* xr = p0 + (long long)i * {inner};\n"
            f"  float s = 0.0f;\n  for (int k = 0; k < {inner}; ++k) s += {load(prog, op.inputs[0], 'xr[k]')};\n"
            f"  {store(prog, op.outputs[0], 'p1', 'i', f's * {f32_literal(1.0 / inner)}')}\n")
    return _elementwise_spec(prog, name, [op.inputs[0], op.outputs[0]], count(prog, op.outputs[0]), body, step)


def flash_attention_kernel(prog: Program, step: Step, name: str) -> KernelSpec:
    """A fused attention step: plan/flash_step.py (imported here: it needs the kernels package)."""
    from plugin_cuda.plan import flash_step

    return flash_step.kernel(prog, step, name)


GENERATORS = {"ew": ew_kernel, "softmax": softmax_kernel, "norm": norm_kernel, "transpose": transpose_kernel,
              "copy": copy_kernel, "rotary": rotary_kernel, "conv_partial": conv_partial_kernel,
              "mean": mean_kernel, "pool": pool_kernel, "place": place_kernel,
              "flash_attention": flash_attention_kernel}


def _take_symbols(spec: KernelSpec, symbols: list) -> None:
    """Declare the plan's symbols S0, S1, ... as the kernel's first parameters (every kernel of a
    symbolic plan takes them, used or not: one argument layout for all its launches)."""
    head = f"{spec.name}("
    at = spec.source.index(head) + len(head)
    decls = ", ".join(f"const int {s.expr}" for s in symbols)
    spec.source = f"{spec.source[:at]}{decls}, {spec.source[at:]}"


_POINTER = re.compile(r"(\w+)\* __restrict__ (p\d+)\b")


def check_pointer_types(prog: Program, spec: KernelSpec) -> None:
    """PlanError unless each pointer parameter of the kernel has its value's C type: a generator that
    declares `float*` for a float16 buffer would read garbage, and the partition then falls back to
    per-node kernels instead (the host's handling of a failed Compile)."""
    head = spec.source[spec.source.index(f"{spec.name}("):]
    declared = dict((name, ctype_) for ctype_, name in _POINTER.findall(head[:head.index("{")]))
    for k, vid in enumerate(spec.params):
        got, want = declared.get(f"p{k}"), ctype(prog, vid)
        if got is not None and got != want:
            raise PlanError(f"kernel {spec.name} ({spec.step.name}) declares p{k} as {got}*; value "
                            f"'{prog.values[vid].name}' is {prog.values[vid].dtype} ({want})")


def _reuse(spec: KernelSpec, seen: dict) -> bool:
    """True when a kernel with `spec`'s body is already in the module: `spec` then names that one."""
    body = spec.source.replace(spec.name, "\0")
    first = seen.setdefault(body, spec.name)
    if first == spec.name:
        return False
    spec.name, spec.source = first, body.replace("\0", first)
    return True


def generate(prog: Program, steps: list, prefix: str = "ep_k", prelude: bool = True,
             seen: dict | None = None) -> tuple[str, list]:
    """(module source, one KernelSpec per generated step, None for cuBLAS steps) for `steps`;
    kernels are named `prefix` + step index.

    A step whose kernel is another's but for its name (a model's repeated layers: BERT-base's twelve
    give each body twelve times) launches the first one, and its source is left out: NVRTC's time
    is proportional to the source. `seen` (body -> kernel name) carries this across calls that
    build one module (a plan's eager and graph variants)."""
    seen = {} if seen is None else seen
    specs = []
    parts = [PRELUDE + (HALF_PRELUDE if prog.has_half() else "")] if prelude else []
    for i, step in enumerate(steps):
        gen = GENERATORS.get(step.kind)
        if gen is None:
            specs.append(None)
            continue
        spec = gen(prog, step, f"{prefix}{i}")
        check_pointer_types(prog, spec)
        if prog.symbols:
            _take_symbols(spec, prog.symbols)
        if not _reuse(spec, seen):
            parts.append(f"/* {step.name} */\n" + spec.source)
        specs.append(spec)
    return "\n".join(parts), specs
