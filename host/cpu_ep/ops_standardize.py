"""Normalizations by mean and variance: BatchNormalization and LayerNormalization, and the row
standardization that the transformer kernels (ops_transformer.py) share with them."""

from __future__ import annotations

import math

import numpy as np

from host.cpu_ep import native
from host.cpu_ep.base import OpKernel, bound_tile, compute_dtype, constant_column, normalize_axis
from host.cpu_ep.registry import register

F32 = native.F32


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


def read_norm_attrs(kernel: OpKernel) -> None:
    """axis, epsilon and stash_type of LayerNormalization and RMSNormalization (same rules)."""
    kernel.axis = kernel.attr_int("axis", -1)
    kernel.epsilon = kernel.attr_float("epsilon", 1e-5)
    kernel.stash_type = kernel.attr_int("stash_type", 1)
    if kernel.stash_type not in (1, 11):
        raise kernel.bad_attr("stash_type", kernel.stash_type, "1 (FLOAT) or 11 (DOUBLE)")


@register("LayerNormalization", since=17)
class LayerNormalization(OpKernel):
    """Normalizes over axes [axis, rank). Mean and InvStdDev come out in the stash type:
    float32, or float64 for float64 inputs."""

    def __init__(self, node):
        super().__init__(node)
        read_norm_attrs(self)
        self._bound: dict[int, np.ndarray] = {}
        self._tiles: tuple[dict, dict] = ({}, {})
        # Per input shape, for float32 C-contiguous x and the bound scale and bias: (library, the compiled
        # call with nothing else), made by the first such call (issue 23: the checks cost twice the call).
        self._runs: dict[tuple, tuple] = {}

    def bind_constants(self, constants):
        self._bound, self._tiles, self._runs = constants, ({}, {}), {}

    def _run(self, x, scale, bias=None):
        run = self._runs.get(x.shape)
        if (run is not None and run[0] is native.LIB and scale is self._bound.get(1) and bias is self._bound.get(2)
                and x.dtype == F32 and x.flags.c_contiguous):
            return run[1](x)
        axis = normalize_axis(self.axis, x.ndim)
        st = np.float64 if self.stash_type == 11 or x.dtype == np.float64 else np.float32
        lib = native.LIB
        if (lib is not None and st is np.float32 and x.dtype == F32 and fast_rows(x, axis) and _vector(scale, x.shape[-1])
                and (bias is None or _vector(bias, x.shape[-1]))):
            # One pass per row in C (statistics in double).
            n = x.shape[-1]
            rows = x.size // n
            if (self.n_outputs == 1 and scale is self._bound.get(1) and bias is self._bound.get(2)
                    and len(self._runs) < 16):
                run = self._runs[x.shape] = (lib, _norm_runner(lib, x.shape, scale, bias, self.epsilon))
                return run[1](x)
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


def _norm_runner(lib, shape: tuple, scale, bias, eps: float):
    """A function of a float32 C-contiguous x of `shape` doing LayerNormalization's one compiled call (last
    axis, bound scale and bias, one output)."""
    n = shape[-1]
    rows, ptr, null, empty, norm = math.prod(shape) // n, native.ptr, native.NULL, np.empty, lib.ep_layernorm
    sp, bp = ptr(scale), null if bias is None else ptr(bias)

    def run(x):
        y = empty(shape, dtype=F32)
        norm(ptr(x), null, sp, bp, ptr(y), null, null, null, rows, n, eps)
        return (y,)

    return run


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
