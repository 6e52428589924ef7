"""Convolution, pooling, normalization and Dropout, for any number of spatial axes.

Windows are strided views (sliding_window_view) of the padded input: Conv turns them into
one batched GEMM per group (im2col), pools reduce over the window axes. No python loop
runs over pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel, bound_tile, compute_dtype, constant_column, normalize_axis, scalar
from host.cpu_ep.ops_reduce import trailing_sum
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
        elif lib.ep_conv2d(ptr(x), ptr(w), bp, ptr(y), handle, prog, rp, alpha, beta):
            return None
        return y

    def _native_runner(self, lib, x, w, b, prog, alpha, beta):
        """A function of (x, res) computing what _native computes for this input shape, program and the
        bound weights and bias, or False where _native would not serve."""
        if x.ndim != 4 or w.ndim != 4 or x.shape[0] != 1 or w.dtype != F32 or not w.flags.c_contiguous:
            return False
        if b is not None and (b.dtype != F32 or b.shape != (w.shape[0],) or not b.flags.c_contiguous):
            return False
        entry = self._native_geom(x, w)
        if entry is None:
            return False
        kind, handle, out_shape = entry
        ptr, null, empty = native.ptr, native.NULL, np.empty
        wp, bp = ptr(w), null if b is None else ptr(b)
        if kind == "pointwise":
            gemm, (m, c), pixels = lib.ep_gemm, w.shape[:2], x.shape[2] * x.shape[3]

            def call(xp, yp, rp):
                gemm(wp, handle, xp, bp, 0 if b is None else 2, yp, m, c, pixels, prog, rp, alpha, beta)
                return 0
        else:
            fn = lib.ep_depthwise2d if kind == "depthwise" else lib.ep_conv2d

            def call(xp, yp, rp):
                return fn(xp, wp, bp, yp, handle, prog, rp, alpha, beta)

        def run(x, res):
            if res is not None and (res.shape != out_shape or res.dtype != F32 or not res.flags.c_contiguous):
                return None
            y = empty(out_shape, dtype=F32)
            return None if call(ptr(x), ptr(y), null if res is None else ptr(res)) else y

        return run

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
        geom = native.ffi.new("ConvGeom *", dict(
            C=c, H=x.shape[2], W=x.shape[3], M=m, KH=w.shape[2], KW=w.shape[3], SH=plan.strides[0],
            SW=plan.strides[1], PH=g.begin[0], PW=g.begin[1], DH=plan.dilations[0], DW=plan.dilations[1],
            OH=g.out[0], OW=g.out[1]))
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


class _Pool(_Spatial):
    def __init__(self, node):
        super().__init__(node)
        # Pools have no weight to take the kernel shape from: the attribute is required.
        self.kernel_shape = self.attr_ints("kernel_shape", lo=1)
        self._check_lengths(len(self.kernel_shape))


@register("MaxPool")
class MaxPool(_Pool):
    """Indices (second output) are flat indices into x, row-major, or column-major over
    the spatial axes when storage_order=1."""

    def __init__(self, node):
        super().__init__(node)
        self.storage_order = self.attr_int("storage_order", 0, lo=0, hi=1)
        self.want_indices = self.n_outputs > 1 and bool(node.outputs[1])

    def _run(self, x):
        g, strides, dilations = self._params(x, self.kernel_shape)
        nd = len(self.kernel_shape)
        if x.dtype.kind not in "fiu":
            raise TypeError(f"MaxPool does not support dtype {x.dtype}")
        # Padding must never win the max.
        low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        lead = x.shape[:2] + g.out
        if 0 in g.out or x.size == 0:
            y = np.zeros(lead, dtype=x.dtype)
            return (y, np.zeros(lead, dtype=np.int64)) if self.want_indices else (y,)
        taps = _taps(_windows(_pad_spatial(x, g, low), g, self.kernel_shape, strides, dilations), nd)
        y = next(taps).copy()
        if not self.want_indices:
            for tap in taps:
                np.maximum(y, tap, out=y)
            return (y,)
        index_taps = _taps(_windows(_pad_spatial(self._flat_index(x.shape), g, -1), g,
                                    self.kernel_shape, strides, dilations), nd)
        index = next(index_taps).copy()
        for tap, index_tap in zip(taps, index_taps):
            # Strictly greater: ties keep the first tap, as the reference kernels do.
            better = tap > y
            np.copyto(y, tap, where=better)
            np.copyto(index, index_tap, where=better)
        return (y, index)

    def _flat_index(self, shape) -> np.ndarray:
        spatial = shape[2:]
        size = math.prod(spatial)
        local = np.arange(size, dtype=np.int64).reshape(spatial)
        if self.storage_order == 1:
            local = np.arange(size, dtype=np.int64).reshape(spatial[::-1]).T
        block = np.arange(shape[0] * shape[1], dtype=np.int64).reshape(shape[0], shape[1], *[1] * len(spatial))
        return block * size + local


@register("AveragePool")
class AveragePool(_Pool):
    """Divides by the window's count of input cells, plus explicit pads when
    count_include_pad; cells added only for ceil_mode never count."""

    def __init__(self, node):
        super().__init__(node)
        self.count_include_pad = self.attr_bool("count_include_pad", 0)

    def _run(self, x):
        g, strides, dilations = self._params(x, self.kernel_shape)
        nd = len(self.kernel_shape)
        dtype = x.dtype
        if 0 in g.out or x.size == 0:
            return (np.zeros(x.shape[:2] + g.out, dtype=dtype),)
        ct = compute_dtype(dtype)
        win = _windows(_pad_spatial(x.astype(ct, copy=False), g, 0), g, self.kernel_shape, strides, dilations)
        taps = _taps(win, nd)
        total = next(taps).copy()
        for tap in taps:
            total += tap
        # The counted-cell mask is a product of 1-D masks, so the divisor is too.
        divisor = np.ones((1, 1), dtype=ct)
        for i in range(nd):
            pad_flag = 1 if self.count_include_pad else 0
            mask = np.concatenate([np.full(g.begin[i], pad_flag), np.ones(x.shape[2 + i]),
                                   np.full(g.end[i], pad_flag), np.zeros(g.extra[i])]).astype(ct)
            counts = sliding_window_view(mask, (self.kernel_shape[i] - 1) * dilations[i] + 1)
            counts = counts[: (g.out[i] - 1) * strides[i] + 1: strides[i], :: dilations[i]].sum(axis=-1)
            divisor = divisor[..., None] * counts
        return ((total / divisor).astype(dtype, copy=False),)


@register("GlobalAveragePool")
class GlobalAveragePool(OpKernel):
    def _run(self, x):
        if x.dtype in _ROW_DTYPES and x.ndim > 2 and x.size and x.flags.c_contiguous:
            # One GEMV against a 1/count column (as ReduceMean over trailing axes).
            count = math.prod(x.shape[2:])
            y = np.dot(x.reshape(-1, count), constant_column(count, 1 / count, x.dtype))
            return (y.reshape(*x.shape[:2], *([1] * (x.ndim - 2))),)
        ct = compute_dtype(x.dtype)
        axes = tuple(range(2, x.ndim))
        y = trailing_sum(x, axes, True, ct)
        y *= ct.type(1 / math.prod(x.shape[2:])) if x.size else ct.type(np.nan)
        return (y.astype(x.dtype, copy=False),)


@register("GlobalMaxPool")
class GlobalMaxPool(OpKernel):
    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


@register("BatchNormalization", since=7)
class BatchNormalization(OpKernel):
    """Inference uses the given mean/var. training_mode=1 (opset 14) normalizes with the
    batch statistics and also returns the updated running mean and variance."""

    def __init__(self, node):
        super().__init__(node)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self.momentum = self.attr_float("momentum", 0.9)
        self.training = self.attr_bool("training_mode", 0)

    def _run(self, x, scale, bias, mean, var):
        dtype = x.dtype
        ct = compute_dtype(dtype)
        shape = (1, -1) + (1,) * (x.ndim - 2)
        xc = x.astype(ct, copy=False)
        stat_dtype = mean.dtype
        if self.training:
            axes = (0, *range(2, x.ndim))
            batch_mean = xc.mean(axis=axes)
            batch_var = xc.var(axis=axes)
            running_mean = mean * self.momentum + batch_mean * (1 - self.momentum)
            running_var = var * self.momentum + batch_var * (1 - self.momentum)
            mean, var = batch_mean, batch_var
        inv = scale.astype(ct, copy=False) / np.sqrt(var.astype(ct, copy=False) + self.epsilon)
        y = (xc - mean.astype(ct, copy=False).reshape(shape)) * inv.reshape(shape)
        y = (y + bias.astype(ct, copy=False).reshape(shape)).astype(dtype, copy=False)
        if not self.training:
            return (y,)
        return (y, running_mean.astype(stat_dtype), running_var.astype(stat_dtype))


@register("LayerNormalization", since=17)
class LayerNormalization(OpKernel):
    """Normalizes over axes [axis, rank). Mean and InvStdDev come out in the stash type:
    float32, or float64 for float64 inputs."""

    def __init__(self, node):
        super().__init__(node)
        self.axis = self.attr_int("axis", -1)
        self.epsilon = self.attr_float("epsilon", 1e-5)
        self.stash_type = self.attr_int("stash_type", 1)
        if self.stash_type not in (1, 11):
            raise self.bad_attr("stash_type", self.stash_type, "1 (FLOAT) or 11 (DOUBLE)")
        self._bound: dict[int, np.ndarray] = {}
        self._tiles: tuple[dict, dict] = ({}, {})

    def bind_constants(self, constants):
        self._bound, self._tiles = constants, ({}, {})

    def _run(self, x, scale, bias=None):
        axis = normalize_axis(self.axis, x.ndim)
        st = np.float64 if self.stash_type == 11 or x.dtype == np.float64 else np.float32
        lib = native.LIB
        if (lib is not None and st is np.float32 and x.dtype == F32 and fast_rows(x, axis) and _vector(scale, x.shape[-1])
                and (bias is None or _vector(bias, x.shape[-1]))):
            # One pass per row in C (statistics in double).
            n = x.shape[-1]
            rows = x.size // n
            y = np.empty(x.shape, dtype=F32)
            stats = np.empty((2, *x.shape[:-1], 1), dtype=F32) if self.n_outputs > 1 else None
            ptr, null = native.ptr, native.NULL
            lib.ep_layernorm(ptr(x), null, ptr(scale), null if bias is None else ptr(bias), ptr(y), null,
                             null if stats is None else ptr(stats[0]), null if stats is None else ptr(stats[1]),
                             rows, n, self.epsilon)
            return (y,) if stats is None else (y, stats[0], stats[1])
        if x.dtype == st and fast_rows(x, axis):
            y, mean, std = standardize_rows(x.reshape(-1, x.shape[-1]), self.epsilon)
            rows = y.shape[0]
            y *= bound_tile(self._tiles[0], scale, self._bound.get(1), rows, st)
            if bias is not None:
                y += bound_tile(self._tiles[1], bias, self._bound.get(2), rows, st)
            y = y.reshape(x.shape)
            if self.n_outputs == 1:
                return (y,)
            stat_shape = x.shape[:-1] + (1,)
            return (y, mean.reshape(stat_shape), np.reciprocal(std).reshape(stat_shape))
        y, mean, inv_std = standardize(x.astype(st, copy=False), tuple(range(axis, x.ndim)), self.epsilon)
        y *= scale
        if bias is not None:
            y += bias
        return (y.astype(x.dtype, copy=False), mean, inv_std)


def _vector(v: np.ndarray, n: int) -> bool:
    """v is a contiguous float32 vector of n elements (a scale or bias the compiled kernels take)."""
    return v.dtype == F32 and v.shape == (n,) and v.flags.c_contiguous


def fast_rows(x: np.ndarray, axis: int) -> bool:
    """Whether `standardize_rows` serves x normalized over [axis, rank): float32/float64, C-contiguous,
    the normalized part being the last axis alone, nothing empty."""
    return (x.dtype in _ROW_DTYPES and axis == x.ndim - 1 and x.size > 0 and x.flags.c_contiguous)


_ROW_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def standardize_rows(x2: np.ndarray, epsilon: float):
    """standardize() for a C-contiguous float 2-D array normalized over its last axis:
    ((x - mean) / std, mean, std) with std = sqrt(var + epsilon); the first is a new array.
    Means are GEMVs against a 1/n column: 8 NumPy calls in all."""
    avg = constant_column(x2.shape[1], 1 / x2.shape[1], x2.dtype)
    mean = np.dot(x2, avg)  # np.dot: a cheaper call than matmul for 2-D operands
    diff = x2 - mean
    var = np.dot(np.square(diff), avg)
    var += x2.dtype.type(epsilon)
    std = np.sqrt(var, out=var)
    diff /= std
    return diff, mean, std


def standardize(x: np.ndarray, axes: tuple[int, ...], epsilon: float):
    """((x - mean) * inv_std, mean, inv_std) over `axes`, in x's dtype; the first is a new array that
    callers may update in place. add.reduce and in-place ufuncs: a handful of NumPy calls in all."""
    scale = x.dtype.type(1 / math.prod(x.shape[a] for a in axes))
    mean = np.add.reduce(x, axis=axes, keepdims=True)
    mean *= scale
    diff = x - mean
    var = np.add.reduce(diff * diff, axis=axes, keepdims=True)
    var *= scale
    var += x.dtype.type(epsilon)
    inv_std = np.sqrt(var, out=var)
    np.reciprocal(inv_std, out=inv_std)
    diff *= inv_std
    return diff, mean, inv_std


@register("Dropout", since=7)
class Dropout(OpKernel):
    """Inference (the default) is the identity with an all-true mask. ratio is an
    attribute before opset 12; ratio and training_mode are inputs since."""

    def __init__(self, node):
        super().__init__(node)
        self.ratio_attr = self.attr_float("ratio", 0.5)
        seed = self.attr("seed", None)
        # Seeded once per kernel: runs differ, the first one matches np.random.seed(seed)
        # followed by uniform(), which is how the ONNX test data were drawn.
        self.rng = np.random.RandomState(None if seed is None else self.attr_int("seed") % 2**32)
        self.want_mask = self.n_outputs > 1 and bool(node.outputs[1])

    def _run(self, x, ratio=None, training_mode=None):
        training = training_mode is not None and bool(scalar(training_mode))
        r = self.ratio_attr if ratio is None else float(scalar(ratio))
        if not 0 <= r < 1:
            raise ValueError(f"ratio {r} is outside [0, 1)")
        if not training or r == 0:
            y, mask = x, (np.ones(x.shape, dtype=bool) if self.want_mask else None)
        else:
            mask = self.rng.uniform(0, 1.0, x.shape) >= r
            y = (x * mask / (1 - r)).astype(x.dtype, copy=False)
        return (y, mask) if self.want_mask else (y,)

