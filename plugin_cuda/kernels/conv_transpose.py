"""ConvTranspose on cuDNN (backward data of the matching Conv), for 1-D, 2-D and 3-D spatial data.

Output geometry as onnxruntime computes it (and host/cpu_ep/ops_conv_transpose.py): the full result
has (in - 1) * stride + (kernel - 1) * dilation + 1 + output_padding cells per axis, cropped by the
pads; auto_pad SAME_* pads to in * stride; an output_shape attribute replaces the pads by the total
padding it implies. SAME_UPPER puts the odd padding cell at the end, every other mode at the start.
An output that the matching Conv would not map back onto the input is an error, as in onnxruntime.

The node is claimed only where cuDNN loads (the plugin has no kernel of its own for it): elsewhere
it runs on the CPU EP.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..device import cudnn, cudnn_conv
from ..semantics.shapes import AUTO_PADS
from .base import FLOAT, CudaKernel, register

try:
    import cupy
except Exception:  # noqa: BLE001 - no CuPy means no device; the plugin still loads
    cupy = None


@dataclass(frozen=True)
class TransposeGeometry:
    """Per spatial axis: the cells cropped at the start and the output size."""

    strides: tuple
    dilations: tuple
    begin: tuple
    out: tuple


def _split(total: int, auto_pad: str) -> int:
    """The padding cropped at the start for `total` cells in all."""
    return total // 2 if auto_pad == "SAME_UPPER" else total - total // 2


def transpose_output(where: str, x_shape, kernel, strides, dilations, pads, output_padding, output_shape,
                     auto_pad: str) -> TransposeGeometry:
    """ConvTranspose's begin crops and output sizes (ValueError naming the axis when they do not fit)."""
    nd = len(x_shape) - 2
    begin, out = [], []
    for i in range(nd):
        s, d, adj, size_in = strides[i], dilations[i], output_padding[i], x_shape[2 + i]
        if adj >= max(s, d):
            raise ValueError(f"{where}: output_padding[{i}] = {adj} must be less than max(stride, dilation) = "
                             f"{max(s, d)}")
        taps = (kernel[i] - 1) * d + 1
        span = (size_in - 1) * s + taps
        if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = output_shape[i] if output_shape is not None else size_in * s
            total = max(0, span + adj - target)
            head = _split(total, auto_pad)
            size = target if output_shape is not None else span + adj - total
        else:
            head, tail = (0, 0) if auto_pad == "VALID" else (pads[i], pads[i + nd])
            total, size = head + tail, span + adj - head - tail
        implied = (size + total - taps) // s + 1
        if size <= 0 or implied != size_in:
            raise ValueError(f"{where}: spatial axis {i}: an output of {size} cells does not fit the input's "
                             f"{size_in} (a Conv of it gives {implied}); output_padding must stay below the "
                             "stride and output_shape within a stride of the natural size")
        begin.append(head)
        out.append(size)
    return TransposeGeometry(tuple(strides), tuple(dilations), tuple(begin), tuple(out))


class _TransposePlan:
    __slots__ = ("out_shape", "geo", "crop", "window", "bias_shape")


@register("ConvTranspose", 1)
class ConvTranspose(CudaKernel):
    """Y = ConvTranspose(X (N, C, *in), W (C, M / group, *kernel), B (M)) through cuDNN."""

    input_types = (FLOAT, FLOAT, FLOAT)
    needs_cudnn = True

    def __init__(self, attrs, opset, node_name):
        super().__init__(attrs, opset, node_name)
        self.auto_pad = self.attr_str("auto_pad", "NOTSET", AUTO_PADS)
        self.group = self.attr_int("group", 1)
        if self.group < 1:
            raise self.bad_attr("group", self.group, "an integer >= 1")
        self.kernel_shape = self.attr_ints("kernel_shape", minimum=1)
        self.strides = self.attr_ints("strides", minimum=1)
        self.dilations = self.attr_ints("dilations", minimum=1)
        self.pads = self.attr_ints("pads", minimum=0)
        self.output_padding = self.attr_ints("output_padding", minimum=0)
        self.output_shape = self.attr_ints("output_shape", minimum=1)
        for name, value in (("kernel_shape", self.kernel_shape), ("strides", self.strides),
                            ("dilations", self.dilations), ("output_padding", self.output_padding),
                            ("output_shape", self.output_shape)):
            if value is not None and len(value) not in (1, 2, 3):
                raise self.bad_attr(name, value, "1 to 3 values (1-D, 2-D or 3-D)")

    @classmethod
    def claims(cls, attrs, dtypes, opset) -> bool:
        # Only cuDNN runs it here: without cuDNN the node goes to another EP (warned once).
        return super().claims(attrs, dtypes, opset) and cudnn.availability() is None

    def _list(self, name: str, value, n: int, default: int) -> tuple:
        if value is None:
            return (default,) * n
        if len(value) != n:
            raise ValueError(f"ConvTranspose node '{self.node_name}': attribute '{name}' is {list(value)}; "
                             f"allowed: {n} values for an input of {n // (2 if name == 'pads' else 1)} spatial dims")
        return tuple(value)

    def _plan(self, x_shape, w_shape):
        where = f"ConvTranspose node '{self.node_name}'"
        nd = len(x_shape) - 2
        if nd not in (1, 2, 3) or len(w_shape) != len(x_shape):
            raise ValueError(f"{where}: input {x_shape} and weight {w_shape}; allowed: the same rank, 3 to 5")
        g = self.group
        if w_shape[0] != x_shape[1] or x_shape[1] % g:
            raise ValueError(f"{where}: weight {w_shape} must have the input's {x_shape[1]} channels first, "
                             f"a multiple of group {g}")
        kernel = tuple(w_shape[2:])
        if self.kernel_shape is not None and tuple(self.kernel_shape) != kernel:
            raise ValueError(f"{where}: kernel_shape {self.kernel_shape} differs from weight shape {w_shape}")
        strides = self._list("strides", self.strides, nd, 1)
        dilations = self._list("dilations", self.dilations, nd, 1)
        geo = transpose_output(where, x_shape, kernel, strides, dilations, self._list("pads", self.pads, 2 * nd, 0),
                               self._list("output_padding", self.output_padding, nd, 0),
                               None if self.output_shape is None else self._list("output_shape", self.output_shape,
                                                                                  nd, 1),
                               self.auto_pad)
        p = _TransposePlan()
        m = w_shape[1] * g
        p.out_shape = (x_shape[0], m) + geo.out
        p.geo, p.crop = cudnn_conv.transpose_geometry(x_shape, w_shape, geo.out, g, geo.begin, strides, dilations)
        if p.crop is not None:  # Y is a window of the full result
            p.window = (slice(None), slice(None)) + tuple(slice(c, c + o) for c, o in
                                                          zip(p.crop[-nd:], geo.out))
        p.bias_shape = (1, m) + (1,) * nd
        return p

    def _compute(self, ctx):
        inputs = ctx.inputs
        x, w = cupy.ascontiguousarray(inputs[0]), cupy.ascontiguousarray(inputs[1])
        b = inputs[2] if len(inputs) > 2 else None
        p = self.plan((x.shape, w.shape), self._plan)
        out = ctx.output(0, p.out_shape, x.dtype)
        if out.size == 0:
            return
        handle = ctx.cudnn
        if handle is None:
            raise RuntimeError(f"ConvTranspose node '{self.node_name}': cuDNN is not available: "
                               f"{cudnn.availability()}")
        setup = cudnn_conv.setup(handle, "backward_data", p.geo, x.dtype)
        ws = cupy.cuda.alloc(setup.workspace_bytes) if setup.workspace_bytes else None
        ws_ptr = ws.ptr if ws is not None else 0
        if p.crop is None:
            bias = cupy.ascontiguousarray(b).data.ptr if b is not None else 0
            cudnn_conv.backward_data(handle, setup, x.data.ptr, w.data.ptr, out.data.ptr, ws_ptr, bias=bias)
            return
        full = cupy.empty(p.geo.x_shape, dtype=x.dtype)
        cudnn_conv.backward_data(handle, setup, x.data.ptr, w.data.ptr, full.data.ptr, ws_ptr)
        full = full.reshape((full.shape[0], full.shape[1]) + full.shape[-len(p.out_shape) + 2:]) \
            if len(full.shape) != len(p.out_shape) else full
        out[...] = full[p.window]
        if b is not None:
            cupy.add(out, b.reshape(p.bias_shape), out=out)
