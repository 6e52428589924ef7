"""Convolution for any number of spatial axes, and the window geometry it shares with the pools.

Windows are strided views (sliding_window_view) of the padded input: Conv turns them into
one batched GEMM per group (im2col), pools (ops_pool.py) reduce over the window axes. No python
loop runs over pixels. Normalizations are in ops_standardize.py and ops_norm.py, Dropout in ops_shape.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel, compute_dtype
from host.cpu_ep.registry import register

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
F32 = native.F32


@dataclass(frozen=True)
class _Geometry:
    """Per spatial axis: output size, padding before, padding after (the explicit part
    and the extra that ceil_mode windows need beyond it)."""

    out: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]
    extra: tuple[int, ...]


def _geometry(size, kernel, strides, dilations, pads, auto_pad, ceil_mode=False) -> _Geometry:
    nd = len(size)
    out, begin, end, extra = [], [], [], []
    for i in range(nd):
        span = (kernel[i] - 1) * dilations[i] + 1  # the dilated window
        s = strides[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size[i] // s)
            total = max(0, (o - 1) * s + span - size[i])
            # SAME_UPPER puts the odd padding element at the end, SAME_LOWER at the start.
            b = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            e = total - b
        else:
            b, e = (0, 0) if auto_pad == "VALID" else (pads[i], pads[i + nd])
            room = size[i] + b + e - span
            if room < 0:
                o = 0
            elif ceil_mode:
                o = -(-room // s) + 1
                # The last window must start inside the input or its left padding.
                if (o - 1) * s >= size[i] + b:
                    o -= 1
            else:
                o = room // s + 1
        x = max(0, (o - 1) * s + span - (size[i] + b + e)) if o > 0 else 0
        out.append(o)
        begin.append(b)
        end.append(e)
        extra.append(x)
    return _Geometry(tuple(out), tuple(begin), tuple(end), tuple(extra))


def _pad_spatial(x: np.ndarray, g: _Geometry, value) -> np.ndarray:
    if not any(g.begin) and not any(g.end) and not any(g.extra):
        return x
    # A filled buffer and one slice assignment: much cheaper than np.pad for small tensors.
    shape = x.shape[:2] + tuple(d + b + e + x_ for d, b, e, x_ in zip(x.shape[2:], g.begin, g.end, g.extra))
    xp = np.full(shape, value, dtype=x.dtype) if value else np.zeros(shape, dtype=x.dtype)
    xp[(slice(None), slice(None), *(slice(b, b + d) for b, d in zip(g.begin, x.shape[2:])))] = x
    return xp


def _windows(xp: np.ndarray, g: _Geometry, kernel, strides, dilations) -> np.ndarray:
    """Read-only view of shape (N, C, *out, *kernel) over the padded input; no copy."""
    st = xp.strides
    nd = len(kernel)
    shape = xp.shape[:2] + tuple(g.out) + tuple(kernel)
    steps = st[:2] + tuple(st[2 + i] * strides[i] for i in range(nd)) + tuple(st[2 + i] * dilations[i]
                                                                             for i in range(nd))
    if xp.flags.c_contiguous:
        # The ndarray constructor over xp's buffer: the same view as as_strided, without its Python overhead.
        view = np.ndarray(shape, xp.dtype, buffer=xp, strides=steps)
        view.flags.writeable = False
        return view
    return as_strided(xp, shape, steps, writeable=False)


def _taps(win: np.ndarray, nd: int):
    """The (N, C, *out) views win[..., k1, .., knd] for each kernel tap, row-major. Looping
    over taps (not pixels) with whole-array ops beats reducing over the strided view."""
    for tap in np.ndindex(*win.shape[-nd:]):
        yield win[(Ellipsis, *tap)]


class _Spatial(OpKernel):
    """Attributes shared by Conv and the pools; lengths are checked once rank is known."""

    def __init__(self, node):
        super().__init__(node)
        self.auto_pad = self.attr_str("auto_pad", "NOTSET", choices=_AUTO_PADS)
        self.kernel_shape = self.attr_ints("kernel_shape", None, lo=1)
        self.strides = self.attr_ints("strides", None, lo=1)
        self.dilations = self.attr_ints("dilations", None, lo=1)
        self.pads = self.attr_ints("pads", None, lo=0)
        self.ceil_mode = self.attr_bool("ceil_mode", 0)
        if self.kernel_shape is not None:
            self._check_lengths(len(self.kernel_shape))

    def _check_lengths(self, nd: int):
        for name, want in (("strides", nd), ("dilations", nd), ("pads", 2 * nd)):
            value = getattr(self, name)
            if value is not None and len(value) != want:
                raise self.bad_attr(name, value, f"a list of {want} ints ({nd} spatial axes)")

    def _params(self, x: np.ndarray, kernel):
        nd = x.ndim - 2
        if nd < 1:
            raise ValueError(f"input of shape {x.shape} has no spatial axis")
        if len(kernel) != nd:
            raise ValueError(f"kernel {list(kernel)} does not match the {nd} spatial axes of {x.shape}")
        strides = self.strides or [1] * nd
        dilations = self.dilations or [1] * nd
        pads = self.pads or [0] * (2 * nd)
        if len(strides) != nd or len(dilations) != nd or len(pads) != 2 * nd:
            raise ValueError(f"strides {strides} / dilations {dilations} / pads {pads} do not fit {nd}-D")
        g = _geometry(x.shape[2:], kernel, strides, dilations, pads, self.auto_pad, self.ceil_mode)
        return g, strides, dilations


# Largest dense per-channel matrix (elements) a depthwise convolution with bound weights is turned
# into: beyond it (larger images) the window copy costs less than the extra multiply-adds by zero.
_DENSE_LIMIT = 1 << 17


@dataclass(frozen=True)
class _ConvPlan:
    """What one input/weight shape pair needs, computed once per shape (shapes only: safe to share
    between threads)."""

    g: _Geometry
    strides: list
    dilations: list
    kind: str  # "pointwise" (1x1, stride 1, no padding, one group), "depthwise" (one channel a group), "im2col"


def _patch_runner(lib, w, b, geom, prog: int, alpha: float, beta: float, images: int = 1):
    """For a convolution whose windows tile the image (kernel = stride, no padding or dilation: ViT's patch
    embedding): a function of x (images, C, H, W) doing im2col as one reshape-transpose copy and one GEMM
    into (images * pixels, M) over the weights transposed once, the output transposed back; None where the
    windows do not tile x or the product is beyond the small GEMM. The compiled im2col took 8-10 us at
    ViT-tiny's 3x32x32 image (8x8 patches): a copy per window row and a narrow-output GEMM (16 pixels)."""
    c, h, wd, m, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = (geom[i] for i in range(14))
    if ((kh, kw) != (sh, sw) or ph or pw or dh != 1 or dw != 1 or oh != (h - kh) // sh + 1
            or ow != (wd - kw) // sw + 1):
        return None
    taps, rows = c * kh * kw, images * oh * ow
    if not native.gemm_fits(rows, taps, m):
        return None
    wt = np.ascontiguousarray(w.reshape(m, taps).T)
    ptr, null, gemm, empty, dense = native.ptr, native.NULL, lib.ep_gemm, np.empty, np.ascontiguousarray
    wtp, bp, kind = ptr(wt), null if b is None else ptr(b), 0 if b is None else 1  # bias over the GEMM's columns

    def run(x):
        p = dense(x[:, :, :oh * kh, :ow * kw].reshape(images, c, oh, kh, ow, kw).transpose(0, 2, 4, 1, 3, 5))
        yt = empty((images, oh * ow, m), dtype=F32)
        gemm(ptr(p), null, wtp, bp, kind, ptr(yt), rows, taps, m, prog, null, alpha, beta)
        return dense(yt.transpose(0, 2, 1)).reshape(images, m, oh, ow)

    return run


@register("Conv")
class Conv(_Spatial):
    """Grouped N-D convolution: a 1x1 convolution is one matmul, a depthwise one a batched dot per
    channel over its windows, anything else im2col + one batched matmul over groups."""

    def __init__(self, node):
        super().__init__(node)
        self.group = self.attr_int("group", 1, lo=1)
        self._plans: dict[tuple, _ConvPlan] = {}
        self._bound_w = self._bound_b = None
        # Per input shape, what the bound (initializer) weights become: ("pointwise" | "dense", matrix),
        # or None where neither applies.
        self._prepared: dict[tuple, tuple | None] = {}
        self._fast: dict[tuple, tuple] = {}
        self._native_geoms: dict[tuple, tuple | None] = {}
        self._native_runs: dict[tuple, tuple | bool] = {}

    native_steps = ()

    def fused_native(self, args, prog, res, alpha, beta):
        """The output followed by an epilogue program (fusion.py's chains) from the compiled kernels, or None."""
        return self._native(*args, prog=prog, res=res, alpha=alpha, beta=beta)

    def native_runner(self, lib, args, prog, alpha, beta):
        """For a chain (fusion.py) over bound weights and bias: a function of (x, res) for float32 contiguous
        input of args[0]'s shape, or False."""
        x, w, *rest = args
        b = rest[0] if rest else None
        if w is not self._bound_w or b is not self._bound_b:
            return False
        return self._native_runner(lib, x, w, b, prog, alpha, beta)

    def _native(self, x, w, b=None, prog=0, res=None, alpha=0.0, beta=0.0):
        """A float32 2-D convolution of one image by the compiled kernels: pointwise as one GEMM, depthwise
        (one channel per group) as a direct loop, one group as a window copy and a GEMM; the bias and the
        epilogue applied as each output is stored. None where they do not serve (the NumPy paths then
        decide, errors included)."""
        lib = native.LIB
        if lib is None or x.dtype != F32 or not x.flags.c_contiguous:
            return None
        if w is self._bound_w and b is self._bound_b:
            # Bound weights: per input shape and program, a closure doing just the call (checks done once).
            run = native.cached(self._native_runs, (x.shape, prog, alpha, beta), lib,
                                lambda: self._native_runner(lib, x, w, b, prog, alpha, beta))
            if run:
                return run(x, res)
        if x.ndim != 4 or w.ndim != 4 or x.shape[0] != 1 or w.dtype != F32 or not w.flags.c_contiguous:
            return None
        if b is not None and (b.dtype != F32 or b.shape != (w.shape[0],) or not b.flags.c_contiguous):
            return None
        key = (x.shape, w.shape)
        entry = self._native_geoms.get(key, False)
        if entry is False:
            entry = self._native_geom(x, w)
            if len(self._native_geoms) < 16:
                self._native_geoms[key] = entry
        if entry is None:
            return None
        kind, handle, out_shape = entry
        if res is not None and (res.shape != out_shape or res.dtype != F32 or not res.flags.c_contiguous):
            return None
        y = np.empty(out_shape, dtype=F32)
        ptr, null = native.ptr, native.NULL
        bp, rp = null if b is None else ptr(b), null if res is None else ptr(res)
        if kind == "pointwise":
            m, c = w.shape[:2]
            # handle: the bound weights transposed, for the GEMM's narrow-output scheme (few pixels)
            lib.ep_gemm(ptr(w), handle if w is self._bound_w else null, ptr(x), bp, 0 if b is None else 2, ptr(y), m, c, x.shape[2] * x.shape[3], prog,
                        rp, alpha, beta)
        elif kind == "depthwise":
            if lib.ep_depthwise2d(ptr(x), ptr(w), bp, ptr(y), handle, prog, rp, alpha, beta):
                return None
        elif lib.ep_conv2d(ptr(x), ptr(w), null, bp, ptr(y), handle, prog, rp, alpha, beta):
            return None
        return y

    def _native_runner(self, lib, x, w, b, prog, alpha, beta):
        """A function of (x, res) computing what _native computes for this input shape, program and the
        bound weights and bias, or False where _native would not serve."""
        if x.ndim != 4 or w.ndim != 4 or w.dtype != F32 or not w.flags.c_contiguous:
            return False
        if b is not None and (b.dtype != F32 or b.shape != (w.shape[0],) or not b.flags.c_contiguous):
            return False
        if x.shape[0] != 1:  # the compiled convolutions take one image; patches of several are one GEMM
            entry = self._native_geom(x[:1], w)
            patches = entry and entry[0] == "im2col" and _patch_runner(lib, w, b, entry[1], prog, alpha, beta,
                                                                       x.shape[0])
            return bool(patches) and (lambda x, res: patches(x) if res is None else None)
        entry = self._native_geom(x, w)
        if entry is None:
            return False
        kind, handle, out_shape = entry
        ptr, null, empty = native.ptr, native.NULL, np.empty
        wp, bp, patches = ptr(w), null if b is None else ptr(b), None
        if kind == "pointwise":
            gemm, (m, c), pixels = lib.ep_gemm, w.shape[:2], x.shape[2] * x.shape[3]

            def call(xp, yp, rp):
                gemm(wp, handle, xp, bp, 0 if b is None else 2, yp, m, c, pixels, prog, rp, alpha, beta)
                return 0
        elif kind == "depthwise":
            fn = lib.ep_depthwise2d

            def call(xp, yp, rp):
                return fn(xp, wp, bp, yp, handle, prog, rp, alpha, beta)
        else:
            patches = _patch_runner(lib, w, b, handle, prog, alpha, beta)
            fn, m = lib.ep_conv2d, w.shape[0]
            # The weights transposed once, for the kernel's narrow-output GEMM (fewer pixels than a tile's
            # columns, more channels: a patch embedding); kept by the closure with the bound weights.
            pixels = out_shape[2] * out_shape[3]
            wt = np.ascontiguousarray(w.reshape(m, -1).T) if pixels < 32 and m > pixels else None
            wtp = null if wt is None else ptr(wt)

            def call(xp, yp, rp):
                return fn(xp, wp, wtp, bp, yp, handle, prog, rp, alpha, beta)

            if patches is not None:  # no residual operand: the GEMM writes the output transposed
                def run_patches(x, res):
                    if res is None:
                        return patches(x)
                    return run(x, res)

        def run(x, res):
            if res is not None and (res.shape != out_shape or res.dtype != F32 or not res.flags.c_contiguous):
                return None
            y = empty(out_shape, dtype=F32)
            return None if call(ptr(x), ptr(y), null if res is None else ptr(res)) else y

        return run if patches is None else run_patches

    def _native_geom(self, x, w):
        """(kind, handle, output shape) for the compiled kernels, or None. The handle is the ConvGeom of a
        depthwise or one-group convolution; for a pointwise one, a pointer to the bound weights transposed
        (C, M) when `w` is them (NULL else)."""
        plan = self._plans.get((x.shape, w.shape))
        if plan is None:
            plan = self._plans[(x.shape, w.shape)] = self._plan(x, w)  # raises on shapes that do not fit
        g = plan.g
        c, m = x.shape[1], w.shape[0]
        if 0 in g.out:
            return None
        pointwise = plan.kind == "pointwise"
        if pointwise or self.group == 1:
            if not native.conv_gemm_fits(m, c * w.shape[2] * w.shape[3], g.out[0] * g.out[1]):
                return None  # a large GEMM: the NumPy path's BLAS takes it
        if pointwise:
            wt = np.ascontiguousarray(w.reshape(m, c).T) if w is self._bound_w else None
            return "pointwise", (native.NULL if wt is None else native.ptr(wt)), (1, m, *g.out)
        elif self.group == c == m and w.shape[1] == 1:
            kind = "depthwise"
        elif self.group == 1:
            kind = "im2col"
        else:
            return None
        geom = native.conv_geometry(
            C=c, H=x.shape[2], W=x.shape[3], M=m, KH=w.shape[2], KW=w.shape[3], SH=plan.strides[0],
            SW=plan.strides[1], PH=g.begin[0], PW=g.begin[1], DH=plan.dilations[0], DW=plan.dilations[1],
            OH=g.out[0], OW=g.out[1])
        return kind, geom, (1, m, *g.out)

    def bind_constants(self, constants):
        self._bound_w, self._bound_b = constants.get(1), constants.get(2)
        self._native_geoms = {}  # may hold the bound weights transposed
        self._native_runs = {}
        self._prepared = {}
        self._fast: dict[tuple, tuple] = {}  # input shape -> (dtype, closure) for the bound weights and bias

    def _prepare(self, x, w, plan: _ConvPlan) -> tuple | None:
        """The bound weights as one matrix for this input shape: (M, C) for a pointwise convolution;
        for a depthwise one over a small image, the dense (C, pixels in, multiplier * pixels out)
        matrix of each channel's filter (zeros where a tap falls on padding), so the whole
        convolution is one batched GEMV instead of a window copy (_DENSE_LIMIT bounds its size)."""
        ct = compute_dtype(x.dtype)
        n, c = x.shape[:2]
        m = w.shape[0]
        if plan.kind == "pointwise":
            return "pointwise", np.ascontiguousarray(w.reshape(m, c), dtype=ct)
        if plan.kind == "im2col":
            # One group, one image: the window copy (C * taps, pixels) times W as (M, C * taps), one GEMM.
            if self.group != 1 or n != 1:
                return None
            return "im2col", np.ascontiguousarray(w.reshape(m, -1), dtype=ct)
        if plan.kind != "depthwise":
            return None
        hw, pixels = math.prod(x.shape[2:]), math.prod(plan.g.out)
        mg, taps = m // c, math.prod(w.shape[2:])
        if c * hw * mg * pixels > _DENSE_LIMIT:
            return self._prepare_rows(x, w, plan, ct)
        # Which input pixel each (output pixel, tap) reads: the convolution's windows over an image of
        # pixel numbers, padded with the number hw (a dump row, dropped below).
        ids = np.arange(hw, dtype=np.int64).reshape(1, 1, *x.shape[2:])
        reads = _windows(_pad_spatial(ids, plan.g, hw), plan.g, w.shape[2:], plan.strides,
                         plan.dilations).reshape(pixels, taps)
        dense = np.zeros((c, hw + 1, mg, pixels), dtype=ct)
        # Within one output pixel every tap reads a different input pixel (or the dump row): no clashes.
        dense[:, reads, :, np.arange(pixels)[:, None]] = np.moveaxis(w.reshape(c, mg, taps), 2, 0)[None]
        return "dense", np.ascontiguousarray(dense[:, :hw].reshape(c, hw, mg * pixels))

    @staticmethod
    def _prepare_rows(x, w, plan: _ConvPlan, ct) -> tuple | None:
        """For a 2-D depthwise convolution (one filter per channel) over a larger image: per channel, the
        (kernel rows * padded width, output width) matrix that turns the kernel_h padded input rows under
        one output row into that output row. A run copies those rows (kernel_h times the image, not
        kernel_h * kernel_w times as im2col does) and multiplies once."""
        c = x.shape[1]
        if w.ndim != 4 or w.shape[0] != c:
            return None
        g = plan.g
        kh, kw = w.shape[2:]
        wp = x.shape[3] + g.begin[1] + g.end[1] + g.extra[1]
        ow = g.out[1]
        if c * kh * wp * ow > _DENSE_LIMIT:
            return None
        rows = np.zeros((c, kh, wp, ow), dtype=ct)
        first = np.arange(ow) * plan.strides[1]
        for j in range(kw):  # tap (i, j) of output column o reads padded column o * stride + j * dilation
            rows[:, :, first + j * plan.dilations[1], np.arange(ow)] = w[:, 0, :, j, None].astype(ct)
        return "rows", np.ascontiguousarray(rows.reshape(c, kh * wp, ow))

    def _rows_view(self, xp, plan: _ConvPlan, kh: int):
        """(N, C, out_h, kh, Wp) view of the padded input: the kernel rows under each output row."""
        st = xp.strides
        shape = (*xp.shape[:2], plan.g.out[0], kh, xp.shape[3])
        steps = (st[0], st[1], st[2] * plan.strides[0], st[2] * plan.dilations[0], st[3])
        if xp.flags.c_contiguous:  # the ndarray constructor: as_strided without its Python overhead
            return np.ndarray(shape, xp.dtype, buffer=xp, strides=steps)
        return as_strided(xp, shape, steps, writeable=False)

    def _with_bias_tile(self, prepared, plan: _ConvPlan):
        """prepared + the bound bias as a read-only (M, pixels) tile (adding a same-shape array costs
        NumPy less than broadcasting a column), or None without a bound bias or when it is large."""
        b = self._bound_b
        if prepared is None:
            return None
        pixels = math.prod(plan.g.out)
        if b is None or b.ndim != 1 or b.size * pixels > 1 << 16:
            return (*prepared, None)
        tile = np.repeat(b.astype(prepared[1].dtype).reshape(-1, 1), pixels, axis=1)
        tile.flags.writeable = False
        return (*prepared, tile)

    def _closure(self, x, prepared, g, m):
        """For a pointwise or dense convolution of this input shape with the bound weights and bias,
        a function of x doing just its two or three NumPy calls (the checks and lookups of _run cost
        as much as the arithmetic on these sizes), or None. Same operations as _run_prepared."""
        kind, matrix, bias_tile = prepared
        if kind not in ("pointwise", "dense") or matrix.dtype != x.dtype:
            return None
        if self._bound_b is not None and bias_tile is None:
            return None
        n, c = x.shape[:2]
        out_shape = (n, m, *g.out)
        dot, matmul = np.dot, np.matmul
        if kind == "pointwise" and n == 1:
            flat = (c, math.prod(x.shape[2:]))

            def run(x):
                y = dot(matrix, x.reshape(flat))
                if bias_tile is not None:
                    y += bias_tile
                return (y.reshape(out_shape),)
        elif kind == "pointwise":
            flat = (n, c, math.prod(x.shape[2:]))

            def run(x):
                y = matmul(matrix, x.reshape(flat))
                if bias_tile is not None:
                    y += bias_tile
                return (y.reshape(out_shape),)
        else:
            flat, rows = (n, c, 1, math.prod(x.shape[2:])), (n, m, -1)

            def run(x):
                y = matmul(x.reshape(flat), matrix).reshape(rows)
                if bias_tile is not None:
                    y += bias_tile
                return (y.reshape(out_shape),)
        return run

    def _run_prepared(self, x, b, prepared, g, m):
        n, c = x.shape[:2]
        kind, matrix, bias_tile = prepared
        ct = matrix.dtype
        xc = x.astype(ct, copy=False)
        if kind == "pointwise":
            # (N, M, pixels), a new array; np.dot for batch 1 (a cheaper call than matmul).
            y = np.dot(matrix, xc.reshape(c, -1))[None] if n == 1 else np.matmul(matrix, xc.reshape(n, c, -1))
        elif kind == "im2col":
            plan = self._plans[(x.shape, self._bound_w.shape)]
            nd = x.ndim - 2
            win = _windows(_pad_spatial(xc, g, 0), g, self._bound_w.shape[2:], plan.strides, plan.dilations)[0]
            # (C, *out, *kernel) -> (C, *kernel, *out): the copy that im2col is.
            cols = win.transpose(0, *range(1 + nd, 1 + 2 * nd), *range(1, 1 + nd)).reshape(matrix.shape[1], -1)
            y = np.dot(matrix, cols)[None]
        elif kind == "rows":
            plan = self._plans[(x.shape, self._bound_w.shape)]
            kh = matrix.shape[1] // (x.shape[3] + g.begin[1] + g.end[1] + g.extra[1])
            view = self._rows_view(_pad_spatial(xc, g, 0), plan, kh)
            # A dense copy: overlapping rows (stride < kernel rows) would keep matmul off BLAS.
            rows = np.ascontiguousarray(view).reshape(n, c, g.out[0], -1)
            y = np.matmul(rows, matrix).reshape(n, m, -1)
        else:
            y = np.matmul(xc.reshape(n, c, 1, -1), matrix).reshape(n, m, -1)
        if b is not None:
            y += bias_tile if b is self._bound_b and bias_tile is not None else b.astype(ct, copy=False).reshape(1, m, 1)
        return (y.reshape(n, m, *g.out).astype(x.dtype, copy=False),)

    def _plan(self, x, w) -> _ConvPlan:
        kernel = list(w.shape[2:])
        if self.kernel_shape is not None and self.kernel_shape != kernel:
            raise ValueError(f"kernel_shape {self.kernel_shape} differs from the weight's {kernel}")
        g, strides, dilations = self._params(x, kernel)
        c, m, G = x.shape[1], w.shape[0], self.group
        if c != w.shape[1] * G or m % G:
            raise ValueError(f"input channels {c} / weight {w.shape} do not fit group={G}")
        unpadded = not any(g.begin) and not any(g.end) and not any(g.extra)
        if G == 1 and unpadded and all(k == 1 for k in kernel) and all(s == 1 for s in strides):
            kind = "pointwise"
        else:
            kind = "depthwise" if c // G == 1 else "im2col"
        return _ConvPlan(g, strides, dilations, kind)

    def _run(self, x, w, b=None):
        entry = self._native_runs.get((x.shape, 0, 0.0, 0.0))  # the call made for this shape, checked first
        if (entry and entry[0] is native.LIB and entry[1] and w is self._bound_w and b is self._bound_b
                and x.dtype == F32 and x.flags.c_contiguous):
            y = entry[1](x, None)
            if y is not None:
                return (y,)
        if native.LIB is not None:
            y = self._native(x, w, b)
            if y is not None:
                return (y,)
        if w is self._bound_w and b is self._bound_b:
            fast = self._fast.get(x.shape)
            if fast is not None and fast[0] == x.dtype:
                return fast[1](x)
        key = (x.shape, w.shape)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(x, w)
        g = plan.g
        n, c = x.shape[:2]
        m, G, nd = w.shape[0], self.group, w.ndim - 2
        dtype = x.dtype
        if 0 in g.out or x.size == 0:
            return (np.zeros((n, m, *g.out), dtype=dtype),)
        if w is self._bound_w:
            pkey = (x.shape, dtype)
            prepared = self._prepared.get(pkey, False)
            if prepared is False:
                if len(self._prepared) >= 16:  # many input shapes: keep memory bounded, start over
                    self._prepared = {}
                prepared = self._prepared[pkey] = self._with_bias_tile(self._prepare(x, w, plan), plan)
            if prepared is not None:
                if b is self._bound_b and len(self._fast) < 16:
                    closure = self._closure(x, prepared, g, m)
                    if closure is not None:
                        self._fast[x.shape] = (dtype, closure)
                return self._run_prepared(x, b, prepared, g, m)
        ct = compute_dtype(dtype)
        xc, wc = x.astype(ct, copy=False), w.astype(ct, copy=False)
        if plan.kind == "pointwise":
            y = np.matmul(wc.reshape(m, c), xc.reshape(n, c, -1))  # (N, M, pixels), contiguous
            if b is not None:
                y += b.astype(ct, copy=False).reshape(1, m, 1)
            return (y.reshape(n, m, *g.out).astype(dtype, copy=False),)
        cols = _windows(_pad_spatial(xc, g, 0), g, w.shape[2:], plan.strides, plan.dilations)
        mg = m // G
        if plan.kind == "depthwise":
            y = self._depthwise(cols, wc, mg, nd)
        else:
            y = self._im2col(cols, wc, g, mg, c // G, nd)
        y = y.reshape(n, m, *g.out)
        if b is not None:
            y = y + b.astype(ct, copy=False).reshape(1, m, *([1] * nd))
        return (np.ascontiguousarray(y).astype(dtype, copy=False),)

    @staticmethod
    def _depthwise(cols, w, mg, nd):
        """One input channel per group: each channel's windows copied dense, times its filters in one
        batched matmul. The copy's layout follows the larger side: (taps, pixels) when there are at least
        as many output pixels as taps (the copy then runs along image rows, far faster than gathering
        a few taps per pixel), else (pixels, taps)."""
        n, c = cols.shape[:2]
        out, ksize = cols.shape[2:2 + nd], math.prod(cols.shape[2 + nd:])
        pixels = math.prod(out)
        if pixels >= ksize:
            perm = (0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))  # (N, C, *kernel, *out)
            dense = np.ascontiguousarray(cols.transpose(perm)).reshape(n, c, ksize, pixels)
            y = np.matmul(w.reshape(c, mg, ksize), dense)  # (N, C, Mg, pixels)
        else:
            dense = np.ascontiguousarray(cols).reshape(n, c, 1, pixels, ksize)
            y = np.matmul(dense, w.reshape(c, mg, ksize, 1))  # (N, C, Mg, pixels, 1)
        return y.reshape(n, c * mg, *out)

    @staticmethod
    def _im2col(cols, w, g, mg, cg, nd):
        """(N, G*Cg, *out, *kernel) windows times weights as one batched GEMM over groups, laid out
        (G, Cg*kernel, N*out) so the weights multiply from the left and the result needs no transpose
        for batch 1."""
        n, G = cols.shape[0], cols.shape[1] // cg
        kernel = cols.shape[2 + nd:]
        kprod, oprod = math.prod(kernel), math.prod(g.out)
        cols = cols.reshape(n, G, cg, *g.out, *kernel)
        # (G, Cg, *kernel, N, *out) -> (G, Cg*kernel, N*out): the one copy (im2col).
        perm = (1, 2, *range(3 + nd, 3 + 2 * nd), 0, *range(3, 3 + nd))
        cols = cols.transpose(perm).reshape(G, cg * kprod, n * oprod)
        y = np.matmul(w.reshape(G, mg, cg * kprod), cols)  # (G, Mg, N*out)
        y = y.reshape(G * mg, n, *g.out)
        return y[None, :, 0] if n == 1 else np.moveaxis(y, 1, 0)
