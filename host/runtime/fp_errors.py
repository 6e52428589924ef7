"""Floating-point errors ignored for a block: what `with np.errstate(all="ignore"):` does, for the CPU
segments that run it once per run.

np.errstate builds its error state object at every entry (about 1 us; a tiny model's whole run is a
few microseconds more). Here it is built once per base state (NumPy's current buffer size, error
callback and modes, read from NumPy's context variable) and set and reset directly. NumPy versions
without that context variable (before 2.0) go through np.errstate itself.
"""

from __future__ import annotations

import numpy as np

try:  # NumPy >= 2.0 keeps the error state in a context variable
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj
except ImportError:  # pragma: no cover - older NumPy
    _extobj_contextvar = _make_extobj = None

_cached: tuple = (None, None)  # (the base state, the same with all errors ignored)


def ignore_fp_errors():
    """Starts ignoring floating-point errors; returns the token to hand to restore_fp_errors."""
    if _extobj_contextvar is None:
        state = np.errstate(all="ignore")
        state.__enter__()
        return state
    global _cached
    base = _extobj_contextvar.get()
    cached_base, ignoring = _cached
    if cached_base is not base:
        ignoring = _make_extobj(all="ignore")  # built on `base`, the state now in force
        _cached = (base, ignoring)
    return _extobj_contextvar.set(ignoring)


def restore_fp_errors(token) -> None:
    """Puts back the error state that ignore_fp_errors found."""
    if _extobj_contextvar is None:
        token.__exit__(None, None, None)
        return
    _extobj_contextvar.reset(token)


__all__ = ["ignore_fp_errors", "restore_fp_errors"]
