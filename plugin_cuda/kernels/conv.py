"""Conv (im2col + cuBLAS GEMM), MaxPool, AveragePool, GlobalAveragePool, for 1-D and 2-D spatial data.

1-D inputs run as 2-D with a unit height. Output sizes and automatic padding follow the ONNX spec
(ceil_mode drops a last window that would start in the end padding, as ONNX Runtime does).
"""

from __future__ import annotations

import logging

import numpy as np

from ..device import cublas, cudnn, cudnn_conv
from ..device.nvrtc import elementwise_table
from ..semantics.shapes import AUTO_PADS, output_geometry
from .base import FLOAT, CudaKernel, is_half, num_outputs, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None

_log = logging.getLogger(__name__)

_GEOMETRY = "int32 H, int32 W, int32 OH, int32 OW, int32 KH, int32 KW, int32 SH, int32 SW, " \
            "int32 PH, int32 PW, int32 DH, int32 DW"

# Window walk shared by the pooling kernels: i indexes the (N, C, OH, OW) output.
_WINDOW_HEAD = """
ptrdiff_t t = i;
const int ox = (int)(t % OW); t /= OW;
const int oy = (int)(t % OH); t /= OH;
const ptrdiff_t base = t * H * W;
"""

SOURCES = {
    # i indexes col viewed as (N, C, KH, KW, OH, OW); zero where the window reads padding.
    "im2col": (
        "raw T x, " + _GEOMETRY, "T col",
        """
        ptrdiff_t t = i;
        const int ox = (int)(t % OW); t /= OW;
        const int oy = (int)(t % OH); t /= OH;
        const int kx = (int)(t % KW); t /= KW;
        const int ky = (int)(t % KH); t /= KH;
        const int iy = oy * SH - PH + ky * DH;
        const int ix = ox * SW - PW + kx * DW;
        col = (iy >= 0 && iy < H && ix >= 0 && ix < W) ? T(x[(t * H + iy) * W + ix]) : T(0);
        """,
    ),
    "max_pool": (
        "raw T x, " + _GEOMETRY, "T y",
        _WINDOW_HEAD + """
        float best = -3.402823466e+38f;
        for (int ky = 0; ky < KH; ++ky) {
          const int iy = oy * SH - PH + ky * DH;
          if (iy < 0 || iy >= H) continue;
          for (int kx = 0; kx < KW; ++kx) {
            const int ix = ox * SW - PW + kx * DW;
            if (ix < 0 || ix >= W) continue;
            const float v = float(x[base + (ptrdiff_t)iy * W + ix]);
            if (v > best) best = v;
          }
        }
        y = T(best);
        """,
    ),
    "max_pool_indices": (
        "raw T x, " + _GEOMETRY + ", int32 col_major", "T y, int64 idx",
        _WINDOW_HEAD + """
        float best = -3.402823466e+38f;
        long long arg = -1;
        for (int ky = 0; ky < KH; ++ky) {
          const int iy = oy * SH - PH + ky * DH;
          if (iy < 0 || iy >= H) continue;
          for (int kx = 0; kx < KW; ++kx) {
            const int ix = ox * SW - PW + kx * DW;
            if (ix < 0 || ix >= W) continue;
            const float v = float(x[base + (ptrdiff_t)iy * W + ix]);
            if (v > best) {
              best = v;
              arg = col_major ? base + (ptrdiff_t)ix * H + iy : base + (ptrdiff_t)iy * W + ix;
            }
          }
        }
        y = T(best);
        idx = arg;
        """,
    ),
    # Taps outside the padded input (ceil_mode overhang) count for nothing; padding counts only
    # with count_include_pad.
    "avg_pool": (
        "raw T x, " + _GEOMETRY + ", int32 PEH, int32 PEW, int32 include_pad", "T y",
        _WINDOW_HEAD + """
        float acc = 0.0f;
        int taps = 0;
        for (int ky = 0; ky < KH; ++ky) {
          const int iy = oy * SH - PH + ky * DH;
          if (iy < -PH || iy >= H + PEH) continue;
          for (int kx = 0; kx < KW; ++kx) {
            const int ix = ox * SW - PW + kx * DW;
            if (ix < -PW || ix >= W + PEW) continue;
            if (iy >= 0 && iy < H && ix >= 0 && ix < W) {
              acc += float(x[base + (ptrdiff_t)iy * W + ix]);
              ++taps;
            } else if (include_pad) {
              ++taps;
            }
          }
        }
        y = T(taps > 0 ? acc / (float)taps : 0.0f);
        """,
    ),
}

elementwise = elementwise_table(SOURCES)

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


class _Spatial(CudaKernel):
    """Attribute parsing shared by Conv and the windowed pools."""

    kernel_required = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.auto_pad = self.attr_str("auto_pad", "NOTSET", AUTO_PADS)
        self.kernel_shape = self.attr_ints("kernel_shape", minimum=1)
        if self.kernel_shape is None and self.kernel_required:
            raise self.bad_attr("kernel_shape", None, "a list of 1 or 2 positive integers (required)")
        if self.kernel_shape is not None and len(self.kernel_shape) not in (1, 2):
            raise self.bad_attr("kernel_shape", self.kernel_shape, "1 or 2 spatial dims (1-D or 2-D)")
        self.strides = self.attr_ints("strides", minimum=1)
        self.dilations = self.attr_ints("dilations", minimum=1)
        self.pads = self.attr_ints("pads", minimum=0)

    def geometry(self, in_sizes, kernel, ceil_mode=False):
        """Checked strides/dilations/pads, then output_geometry, lifted to 2-D (H, W) form."""
        n = len(in_sizes)
        strides = self.strides or (1,) * n
        dilations = self.dilations or (1,) * n
        pads = self.pads or (0,) * (2 * n)
        for name, value, length in (("strides", strides, n), ("dilations", dilations, n), ("pads", pads, 2 * n)):
            if len(value) != length:
                raise ValueError(f"{self.op_type} node '{self.node_name}': attribute '{name}' is {value}; "
                                 f"allowed: {length} integers for {n} spatial dims")
        outs, begins, ends = output_geometry(
            self.node_name, in_sizes, kernel, strides, dilations, pads, self.auto_pad, ceil_mode
        )
        if n == 1:  # a unit height: every 1-D quantity becomes its 2-D counterpart
            return dict(hw=(1, in_sizes[0]), k=(1, kernel[0]), s=(1, strides[0]), d=(1, dilations[0]),
                        pb=(0, begins[0]), pe=(0, ends[0]), out=(1, outs[0]), out_sizes=outs)
        return dict(hw=tuple(in_sizes), k=tuple(kernel), s=tuple(strides), d=tuple(dilations),
                    pb=begins, pe=ends, out=outs, out_sizes=outs)

    def check_rank(self, shape):
        if len(shape) not in (3, 4):
            raise ValueError(f"{self.op_type} node '{self.node_name}': input shape {shape}; "
                             "allowed: rank 3 (1-D) or rank 4 (2-D)")
        if self.kernel_shape is not None and len(self.kernel_shape) != len(shape) - 2:
            raise ValueError(f"{self.op_type} node '{self.node_name}': kernel_shape {self.kernel_shape} does "
                             f"not fit input shape {shape}")


class _ConvPlan:
    __slots__ = ("out_shape", "direct", "im2col_shape", "im2col_args", "col_shape", "w_shape",
                 "gemm_out_shape", "bias_shape", "cudnn_geo")


def use_cudnn(geo) -> bool:
    """Whether a convolution runs on cuDNN rather than im2col + cuBLAS (docs/cuda_ops.md has the
    measurements behind the rule). None: cuDNN cannot run it (asymmetric pads)."""
    return geo is not None


@register("Conv", 1)
class Conv(_Spatial):
    """Conv as im2col then one batched GEMM per group set: out[n, g] = W[g] @ col[n, g]."""

    input_types = (FLOAT, FLOAT, FLOAT)
    needs_cublas = True
    needs_cudnn = True
    kernel_required = False

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.group = self.attr_int("group", 1)
        if self.group < 1:
            raise self.bad_attr("group", self.group, "an integer >= 1")

    def _plan(self, x_shape, w_shape):
        self.check_rank(x_shape)
        if len(w_shape) != len(x_shape):
            raise ValueError(f"Conv node '{self.node_name}': weight shape {w_shape} does not fit input {x_shape}")
        n, c = x_shape[:2]
        m, cg = w_shape[:2]
        kernel = w_shape[2:]
        if self.kernel_shape is not None and tuple(self.kernel_shape) != tuple(kernel):
            raise ValueError(f"Conv node '{self.node_name}': kernel_shape {self.kernel_shape} differs from "
                             f"weight shape {w_shape}")
        g = self.group
        if c != cg * g or m % g:
            raise ValueError(f"Conv node '{self.node_name}': input channels {c}, weight shape {w_shape} and "
                             f"group {g} do not agree (need C == W.shape[1] * group, M % group == 0)")
        geo = self.geometry(x_shape[2:], kernel)
        (h, w), (kh, kw), (sh, sw), (dh, dw) = geo["hw"], geo["k"], geo["s"], geo["d"]
        (ph, pw), (peh, pew), (oh, ow) = geo["pb"], geo["pe"], geo["out"]
        p = _ConvPlan()
        p.out_shape = (n, m) + geo["out_sizes"]
        kg = cg * kh * kw
        p.direct = (kh, kw, sh, sw, ph, pw, peh, pew) == (1, 1, 1, 1, 0, 0, 0, 0)
        p.im2col_shape = (n, c, kh, kw, oh, ow)
        p.im2col_args = (h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw)
        p.col_shape = (n, g, kg, oh * ow)
        p.w_shape = (1, g, m // g, kg)
        p.gemm_out_shape = (n, g, m // g, oh * ow)
        p.bias_shape = (1, m) + (1,) * (len(x_shape) - 2)
        cut = slice(4 - len(x_shape), None)  # 1-D: geometry() lifted every quantity to (unit, size)
        cgeo = cudnn_conv.forward_geometry(x_shape, w_shape, p.out_shape, g, geo["pb"][cut], geo["pe"][cut],
                                           geo["s"][cut], geo["d"][cut])
        p.cudnn_geo = cgeo if use_cudnn(cgeo) else None
        return p

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, w = inputs[0], inputs[1]
        b = inputs[2] if len(inputs) > 2 else None
        p = self.plan((x.shape, w.shape), self._plan)
        out = ctx.output(0, p.out_shape, x.dtype)
        if out.size == 0:
            return
        handle = getattr(ctx, "cudnn", None)
        if handle is not None and p.cudnn_geo is not None:
            try:
                setup = cudnn_conv.setup(handle, "forward", p.cudnn_geo, x.dtype)
                self._cudnn(handle, setup, x, w, b, out)
                return
            except cudnn.CudnnError as e:
                if e.status is not None and e.status // 1000 not in (2, 3):
                    raise  # an execution error: the device, not the case
                # No descriptor, algorithm or kernel for this case (nothing was launched): im2col runs it.
                _log.warning("Conv node '%s': cuDNN cannot run %s (%s); im2col + cuBLAS instead",
                             self.node_name, p.cudnn_geo, e)
                p.cudnn_geo = None
        if p.direct:
            col = x.reshape(p.col_shape)  # a 1x1, stride-1, unpadded conv needs no im2col
        else:
            col = cupy.empty(p.im2col_shape, dtype=x.dtype)
            elementwise("im2col")(x, *p.im2col_args, col)
            col = col.reshape(p.col_shape)
        cublas.matmul(ctx.cublas, w.reshape(p.w_shape), col, out.reshape(p.gemm_out_shape))
        if b is not None:
            cupy.add(out, b.reshape(p.bias_shape), out=out)

    @staticmethod
    def _cudnn(handle, setup, x, w, b, out) -> None:
        # The workspace comes from the current (the EP's, stream-ordered) pool, as im2col's buffer does.
        ws = cupy.cuda.alloc(setup.workspace_bytes) if setup.workspace_bytes else None
        x, w = cupy.ascontiguousarray(x), cupy.ascontiguousarray(w)
        cudnn_conv.forward(handle, setup, x.data.ptr, w.data.ptr, out.data.ptr, ws.ptr if ws is not None else 0,
                           bias=cupy.ascontiguousarray(b).data.ptr if b is not None else 0)


class _Pool(_Spatial):
    input_types = (FLOAT,)

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.ceil_mode = bool(self.attr_int("ceil_mode", 0, (0, 1)))

    def _plan(self, x_shape):
        self.check_rank(x_shape)
        geo = self.geometry(x_shape[2:], self.kernel_shape, self.ceil_mode)
        (h, w), (kh, kw), (sh, sw), (dh, dw) = geo["hw"], geo["k"], geo["s"], geo["d"]
        (ph, pw), (peh, pew), (oh, ow) = geo["pb"], geo["pe"], geo["out"]
        out_shape = tuple(x_shape[:2]) + geo["out_sizes"]
        return out_shape, (h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw), (peh, pew)


@register("MaxPool", 1)
class MaxPool(_Pool):
    """MaxPool, with the optional Indices output (flat, padding ignored, storage_order honoured)."""

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.col_major = self.attr_int("storage_order", 0, (0, 1))

    def _compute(self, ctx):
        x = ctx.inputs[0]
        out_shape, args, _ = self.plan((x.shape,), self._plan)
        y = ctx.output(0, out_shape, x.dtype)
        if num_outputs(ctx) > 1:
            elementwise("max_pool_indices")(x, *args, self.col_major, y, ctx.output(1, out_shape, _I64))
        else:
            elementwise("max_pool")(x, *args, y)


@register("AveragePool", 1)
class AveragePool(_Pool):
    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.include_pad = self.attr_int("count_include_pad", 0, (0, 1))

    def _compute(self, ctx):
        x = ctx.inputs[0]
        out_shape, args, pads_end = self.plan((x.shape,), self._plan)
        elementwise("avg_pool")(x, *args, *pads_end, self.include_pad, ctx.output(0, out_shape, x.dtype))


@register("GlobalAveragePool", 1)
class GlobalAveragePool(CudaKernel):
    def _plan(self, shape):
        if len(shape) < 3:
            raise ValueError(f"GlobalAveragePool node '{self.node_name}': input shape {shape}; allowed: rank >= 3")
        return tuple(range(2, len(shape))), tuple(shape[:2]) + (1,) * (len(shape) - 2)

    def _compute(self, ctx):
        x = ctx.inputs[0]
        axes, out_shape = self.plan((x.shape,), self._plan)
        out = ctx.output(0, out_shape, x.dtype)
        if is_half(x.dtype):
            cupy.copyto(out, cupy.mean(x, axis=axes, dtype=_F32, keepdims=True))
        else:
            cupy.mean(x, axis=axes, keepdims=True, out=out)
