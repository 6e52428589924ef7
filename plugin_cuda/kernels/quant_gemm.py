"""The CUDA code shared by the quantized kernels: quantize / dequantize / requantize element-wise
bodies and the int8 GEMM driver (packing to int8 with the rows of ones, the cuBLASLt call, the
zero-point corrections; plugin_cuda/device/int8gemm.py explains the math).

Bit-exactness with onnxruntime (and the CPU EP) rests on doing the same float32 operations in the same
order: every float operation here is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn,
__fdiv_rn), which the compiler never contracts into a fused multiply-add (a contracted a * b + c rounds
once, not twice, and would differ from MLAS in the last bit). rintf rounds half to even, as MLAS does.
"""

from __future__ import annotations

import logging

import numpy as np

from ..device import int8gemm
from ..device.cublas import CublasError
from ..device.nvrtc import elementwise_table

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

_log = logging.getLogger(__name__)
# GEMMs that cuBLASLt refused and CuPy's integer matmul ran (the GPU tests expect none)
stats = {"fallbacks": 0}
Q8 = frozenset({"int8", "uint8"})
Q16 = Q8 | {"int16", "uint16"}
F32 = np.dtype(np.float32)

PREAMBLE = r"""
__device__ __forceinline__ float q_clamp(float v, float lo, float hi) { return fminf(fmaxf(v, lo), hi); }
// round half to even, plus the zero point, saturated: the end of every quantizing kernel
__device__ __forceinline__ float q_round(float v, float zp, float lo, float hi) {
  return q_clamp(__fadd_rn(rintf(v), zp), lo, hi);
}
// the exact integer product of centered operands from the int8 GEMM's P, row sum ra and column sum cb
__device__ __forceinline__ int q_acc(int p, int ra, int cb, int za, int zb, int k) {
  return p - zb * ra - za * cb + k * za * zb;
}
"""

_ACC = "const int acc = q_acc(p, ra, cb, (int)za - sa, (int)zb - sb, k) + bias;\n"
_ACC_IN = "int32 p, int32 ra, int32 cb, A za, B zb, int32 sa, int32 sb, int32 k, int32 bias"

# name -> (in params, out params, body): CuPy ElementwiseKernels (tests compile each with nvcc -ptx).
SOURCES = {
    # y = saturate(round(x / s) + zp)
    "quantize": ("T x, float32 s, Y zp, float32 lo, float32 hi", "Y y",
                 "y = (Y)q_round(__fdiv_rn((float)x, s), (float)zp, lo, hi);"),
    # y = (x - zp) * s, the subtraction in float32 as the CPU EP and onnxruntime do it
    "dequantize": ("T x, float32 s, T zp", "float32 y",
                   "y = __fmul_rn(__fsub_rn((float)x, (float)zp), s);"),
    # DynamicQuantizeLinear's scale and zero point from the range [min(x, 0), max(x, 0)]
    "dynamic_params": ("float32 lo_, float32 hi_", "float32 s, uint8 zp",
                       """
                       const float lo = fminf(lo_, 0.f), hi = fmaxf(hi_, 0.f);
                       const float sc = __fdiv_rn(__fsub_rn(hi, lo), 255.f);
                       if (sc == 0.f) { s = 1.f; zp = 0; }
                       else { s = sc; zp = (unsigned char)q_clamp(rintf(-__fdiv_rn(lo, sc)), 0.f, 255.f); }
                       """),
    # an operand packed for the int8 GEMM: (batch, RP, Kp) rows of x (shifted to int8), its row of
    # ones at row R, zeros in the padding; x read at b * sb + r * sr + c * sc
    "pack": ("raw T x, int32 shift, int32 R, int32 K, int32 Kp, int32 RP, int64 sb, int64 sr, int64 sc",
             "int8 y",
             """
             ptrdiff_t t = i;
             const int c = (int)(t % Kp); t /= Kp;
             const int r = (int)(t % RP);
             const ptrdiff_t b = t / RP;
             int v = 0;
             if (c < K && r <= R) v = (r == R) ? 1 : (int)x[b * sb + r * sr + c * sc] - shift;
             y = (signed char)v;
             """),
    # a convolution's im2col, packed like "pack": (G, RP, Kp) int8, row r = (n, oy, ox) of group g,
    # column c = (channel in the group, ky, kx); padding reads the zero point (centered: 0)
    "im2col_q8": ("raw T x, T zp, int32 shift, int32 C, int32 Cg, int32 H, int32 W, int32 OH, int32 OW, int32 KH, "
               "int32 KW, int32 SH, int32 SW, int32 PH, int32 PW, int32 DH, int32 DW, int32 R, int32 K, int32 Kp, int32 RP",
               "int8 y",
               """
               ptrdiff_t t = i;
               const int c = (int)(t % Kp); t /= Kp;
               const int r = (int)(t % RP);
               const int g = (int)(t / RP);
               int v = 0;
               if (c < K && r == R) v = 1;
               else if (c < K && r < R) {
                 int rr = r;
                 const int ox = rr % OW; rr /= OW;
                 const int oy = rr % OH;
                 const ptrdiff_t n = rr / OH;
                 int cc = c;
                 const int kx = cc % KW; cc /= KW;
                 const int ky = cc % KH;
                 const int ch = g * Cg + cc / KH;
                 const int iy = oy * SH - PH + ky * DH, ix = ox * SW - PW + kx * DW;
                 const bool inside = iy >= 0 && iy < H && ix >= 0 && ix < W;
                 v = (inside ? (int)x[((n * C + ch) * H + iy) * W + ix] : (int)zp) - shift;
               }
               y = (signed char)v;
               """),
    # the int32 accumulator (MatMulInteger, ConvInteger)
    "acc_int": (_ACC_IN, "int32 y", _ACC + "y = acc;"),
    # requantized: saturate(round(float(acc) * (as * bs * alpha / ys)) + yzp)
    "acc_quant": (_ACC_IN + ", float32 as_, float32 bs, float32 alpha, float32 ys, Y yzp, float32 lo, float32 hi",
                  "Y y",
                  _ACC + "const float mult = __fdiv_rn(__fmul_rn(__fmul_rn(as_, bs), alpha), ys);\n"
                  "y = (Y)q_round(__fmul_rn((float)acc, mult), (float)yzp, lo, hi);"),
    # float: float(acc) * (as * bs * alpha) + fbias
    "acc_float": (_ACC_IN + ", float32 as_, float32 bs, float32 alpha, float32 fbias", "float32 y",
                  _ACC + "y = __fadd_rn(__fmul_rn((float)acc, __fmul_rn(__fmul_rn(as_, bs), alpha)), fbias);"),
    # com.microsoft QLinearGlobalAveragePool: an int32 window sum requantized by x_scale / (y_scale * size)
    "qgap": ("int32 s, A zp, int32 size, float32 xs, float32 ys, Y yzp, float32 lo, float32 hi", "Y y",
             """
             const int acc = s - (int)zp * size;
             const float scale = __fdiv_rn(xs, __fmul_rn(ys, (float)size));
             y = (Y)q_round(__fmul_rn((float)acc, scale), (float)yzp, lo, hi);
             """),
    # com.microsoft QLinearAdd in MLAS's form: zero points folded into one constant
    "qadd": ("A a, B b, float32 as_, A azp, float32 bs, B bzp, float32 cs, Y czp, float32 lo, float32 hi", "Y y",
             """
             const float ra = __fdiv_rn(as_, cs), rb = __fdiv_rn(bs, cs);
             const float fixed = __fsub_rn((float)czp, __fadd_rn(__fmul_rn(ra, (float)azp), __fmul_rn(rb, (float)bzp)));
             const float v = __fadd_rn(__fadd_rn(__fmul_rn((float)a, ra), fixed), __fmul_rn((float)b, rb));
             y = (Y)q_clamp(rintf(v), lo, hi);
             """),
    # com.microsoft QLinearMul: (a - azp) * (b - bzp) * (as * bs / cs)
    "qmul": ("A a, B b, float32 as_, A azp, float32 bs, B bzp, float32 cs, Y czp, float32 lo, float32 hi", "Y y",
             """
             const float mult = __fdiv_rn(__fmul_rn(as_, bs), cs);
             const float v = __fmul_rn(__fsub_rn((float)a, (float)azp), __fsub_rn((float)b, (float)bzp));
             y = (Y)q_round(__fmul_rn(v, mult), (float)czp, lo, hi);
             """),
}

kernel = elementwise_table(SOURCES, PREAMBLE)


def bounds(dtype) -> tuple[np.float32, np.float32]:
    """The saturation bounds of an integer type, as float32 kernel arguments."""
    info = np.iinfo(np.dtype(dtype))
    return np.float32(info.min), np.float32(info.max)


def shift(dtype) -> int:
    """What packing subtracts from a code to make it int8: 128 for uint8, 0 for int8."""
    return 128 if np.dtype(dtype) == np.uint8 else 0


_zeros: dict = {}


def zero(dtype):
    """A 0-d device zero of `dtype` (an absent zero point or bias), made once per device and dtype."""
    key = (cupy.cuda.runtime.getDevice(), np.dtype(dtype))
    z = _zeros.get(key)
    if z is None:
        z = _zeros[key] = cupy.zeros((), dtype)
    return z


def pack(x, rows: int, k: int, buffer_rows: int, strides: tuple[int, int, int], batch: int):
    """x's operand as the GEMM wants it: (batch, buffer_rows, Kp) int8, shifted, a row of ones at
    `rows`; x's element (b, r, c) is read at b * strides[0] + r * strides[1] + c * strides[2] of x's
    C-order elements."""
    kp = int8gemm.round_up(max(k, 1))
    out = cupy.empty((batch, buffer_rows, kp), np.int8)
    kernel("pack")(x, shift(x.dtype), rows, k, kp, buffer_rows, *strides, out)
    return out


class Product:
    """P, row sums and column sums of a packed integer product, as broadcastable views of D, and K."""

    __slots__ = ("p", "ra", "cb", "k")

    def __init__(self, d, m: int, n: int, k: int):
        self.p = d[..., :m, :n]
        self.ra = d[..., :m, n:n + 1]
        self.cb = d[..., m:m + 1, :n]
        self.k = k

    def args(self, a_zp, b_zp, a_dtype, b_dtype, bias=None) -> tuple:
        """The _ACC_IN arguments; zero points broadcastable to (..., m, n) or None."""
        za = zero(a_dtype) if a_zp is None else a_zp
        zb = zero(b_dtype) if b_zp is None else b_zp
        return (self.p, self.ra, self.cb, za, zb, shift(a_dtype), shift(b_dtype), self.k,
                zero(np.int32) if bias is None else bias)


def gemm(a_packed, bt_packed, m: int, n: int, k: int) -> Product:
    """The int8 GEMM of packed operands: a_packed (batch or 1, m + 1, Kp), bt_packed (batch or 1, Np,
    Kp); a batch of 1 on one side is shared by every product of the other."""
    batch = max(a_packed.shape[0], bt_packed.shape[0])
    rows_a, rows_b, kp = a_packed.shape[1], bt_packed.shape[1], a_packed.shape[2]
    d = cupy.empty((batch, rows_a, rows_b), np.int32)
    try:
        run = int8gemm.plan(cupy.cuda.runtime.getDevice(), rows_a, rows_b, kp)
    except CublasError as exc:  # cuBLASLt refused these sizes: CuPy's integer matmul (exact, slow)
        stats["fallbacks"] += 1
        if stats["fallbacks"] == 1:
            _log.warning("int8 GEMM through CuPy's integer matmul instead of cuBLASLt: %s", exc)
        cupy.matmul(a_packed.astype(np.int32), bt_packed.astype(np.int32).transpose(0, 2, 1), out=d)
        return Product(d, m, n, k)
    stream = cupy.cuda.get_current_stream().ptr
    step_a = a_packed.strides[0] if a_packed.shape[0] > 1 else 0
    step_b = bt_packed.strides[0] if bt_packed.shape[0] > 1 else 0
    for i in range(batch):
        run(a_packed.data.ptr + i * step_a, bt_packed.data.ptr + i * step_b, d.data.ptr + i * d.strides[0], stream)
    return Product(d, m, n, k)


def matmul(a, b, trans_a: bool = False, trans_b: bool = False) -> tuple[Product, tuple]:
    """The int8 GEMM of integer tensors a (..., M, K) and b (..., K, N) (2-D op(a), op(b) with the
    trans flags): the Product and the output shape. A 2-D b is shared: a's leading dims become rows."""
    if trans_a:
        a = a.T
    if trans_b:
        b = b.T
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"integer MatMul of shapes {a.shape} and {b.shape}; allowed: rank 2 or more")
    k = a.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"integer MatMul of shapes {a.shape} and {b.shape}: the inner dimensions {k} and "
                         f"{b.shape[-2]} must match")
    n = b.shape[-1]
    if b.ndim == 2:
        m = int(np.prod(a.shape[:-1], dtype=np.int64))
        a_batch = (1, a.reshape(m, k))
        b_batch = (1, b)
        out_shape = a.shape[:-1] + (n,)
    else:
        batch_shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        m = a.shape[-2]
        batch = int(np.prod(batch_shape, dtype=np.int64))
        a_batch = (batch, cupy.broadcast_to(a, batch_shape + a.shape[-2:]))
        b_batch = (batch, cupy.broadcast_to(b, batch_shape + b.shape[-2:]))
        out_shape = batch_shape + (m, n)
    rows_a, rows_b, kp = int8gemm.padded_dims(m, n, k)
    ap = pack(a_batch[1], m, k, rows_a, (m * k, k, 1), a_batch[0])
    bp = pack(b_batch[1], n, k, rows_b, (k * n, 1, n), b_batch[0])
    return gemm(ap, bp, m, n, k), out_shape
