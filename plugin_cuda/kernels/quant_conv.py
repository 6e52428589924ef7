"""QLinearConv and ConvInteger on the GPU (1-D and 2-D, groups, pads, strides, dilations): an int8
im2col (windows over the padding read the input's zero point) and one int8 tensor-core GEMM per group
(quant_gemm.py), the zero points applied through the GEMM's row and column sums, then the requantization
of the CPU EP (host/cpu_ep/ops_quant.py: int32 bias added to the accumulator, multiplier
x_scale * w_scale / y_scale in float32, per tensor or per output channel).

cuDNN's int8 convolutions need NHWC tensors with channels a multiple of 4 and round through float
scales of their own; this path keeps the exact int32 accumulator that bit-exactness needs.
"""

from __future__ import annotations

import numpy as np

from ..device import int8gemm
from .base import register
from .conv import _Spatial
from .quant import F32_ONLY
from .quant_gemm import Q8, bounds, gemm, kernel, pack, shift, zero

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

INT32 = frozenset({"int32"})


class _IntConv(_Spatial):
    same_type = ()
    kernel_required = False

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.group = self.attr_int("group", 1)
        if self.group < 1:
            raise self.bad_attr("group", self.group, "an integer >= 1")

    def _geometry(self, x_shape, w_shape):
        self.check_rank(x_shape)
        n, c = x_shape[:2]
        m, cg = w_shape[:2]
        g = self.group
        if len(w_shape) != len(x_shape) or c != cg * g or m % g:
            raise ValueError(f"{self.where}: input {tuple(x_shape)}, weight {tuple(w_shape)} and group {g} do not "
                             "agree (need the same rank, C == W.shape[1] * group, M % group == 0)")
        geo = self.geometry(x_shape[2:], w_shape[2:])
        return geo, (n, m) + tuple(geo["out_sizes"])

    def accumulate(self, x, x_zp, w, w_zp, bias):
        """(the acc_* arguments, the (G, N, S, M/G) view maker of the output, shape of the output)."""
        geo, out_shape = self.plan((x.shape, w.shape), self._geometry)
        n, c = x.shape[:2]
        m, cg = w.shape[:2]
        g = self.group
        (h, wd), (kh, kw), (sh, sw), (dh, dw) = geo["hw"], geo["k"], geo["s"], geo["d"]
        (ph, pw), (oh, ow) = geo["pb"], geo["out"]
        k, rows, ocg, spatial = cg * kh * kw, n * oh * ow, m // g, oh * ow
        rows_a, rows_b, kp = int8gemm.padded_dims(rows, ocg, k)
        col = cupy.empty((g, rows_a, kp), np.int8)
        x_zp = zero(x.dtype) if x_zp is None else x_zp.reshape(())
        kernel("im2col_q8")(x, x_zp, shift(x.dtype), c, cg, h, wd, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, rows, k, kp,
                         rows_a, col)
        wt = pack(w.reshape(g, ocg, k), ocg, k, rows_b, (ocg * k, k, 1), g)
        product = gemm(col, wt, rows, ocg, k)

        def channels(v):  # a per-output-channel vector as (G, 1, 1, M/G), a scalar as 0-d
            return v.reshape(()) if v.size == 1 else v.reshape(g, 1, 1, ocg)

        p = product.p.reshape(g, n, spatial, ocg)
        ra = product.ra.reshape(g, n, spatial, 1)
        cb = product.cb.reshape(g, 1, 1, ocg)
        zb = zero(w.dtype) if w_zp is None else channels(w_zp)
        args = (p, ra, cb, x_zp, zb, shift(x.dtype), shift(w.dtype), k, zero(np.int32) if bias is None else channels(bias))
        return args, channels, out_shape, (n, g, ocg, spatial)

    @staticmethod
    def grouped(y, view_shape):
        """The output (N, M, spatial...) seen as (G, N, S, M/G), the GEMM's order."""
        return y.reshape(view_shape).transpose(1, 0, 3, 2)


@register("ConvInteger", 10)
class ConvInteger(_IntConv):
    input_types = (Q8, Q8, Q8, Q8)

    def _compute(self, ctx):
        inputs = list(ctx.inputs) + [None] * (4 - len(ctx.inputs))
        x, w, x_zp, w_zp = inputs
        args, _, out_shape, view = self.accumulate(x, x_zp, w, w_zp, None)
        y = ctx.output(0, out_shape, np.int32)
        kernel("acc_int")(*args, self.grouped(y, view))


@register("QLinearConv", 10)
class QLinearConv(_IntConv):
    input_types = (Q8, F32_ONLY, Q8, Q8, F32_ONLY, Q8, F32_ONLY, Q8, INT32)

    def _compute(self, ctx):
        inputs = list(ctx.inputs) + [None] * (9 - len(ctx.inputs))
        x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias = inputs
        args, channels, out_shape, view = self.accumulate(x, x_zp, w, w_zp, bias)
        y = ctx.output(0, out_shape, y_zp.dtype)
        lo, hi = bounds(y_zp.dtype)
        kernel("acc_quant")(*args, x_scale.reshape(()), channels(w_scale), np.float32(1), y_scale.reshape(()),
                            y_zp.reshape(()), lo, hi, self.grouped(y, view))
