"""CuPy's compiled per-node kernels carried in a saved context (issue 29: a context session compiles nothing).

A session made from a context model replays its per-node warm-ups early (kernel_prefetch.py), but on a
machine whose CuPy disk cache is cold each of those calls still runs NVRTC: 0.49 s of BERT's 1.1 s
creation on the H200. CuPy (from 14.2) looks its compiled kernels up through one replaceable cache
backend (`cupy.cuda.compiler._set_kernel_cache_backend`, load(name) / save(name, payload, source); its
names hash the source, the options, the architecture and the NVRTC version). This module wraps whatever
backend is installed, once per process, so that:

- a per-node warm-up that will go into a context records, in its own thread, the names and payloads
  CuPy loads or saves while it runs (`recording`), and the context carries them beside the recipes;
- a context's payloads are handed in before its recipes replay (`provide`), and the wrapper answers
  those names from them, so NVRTC does not run. A name CuPy would not ask for on this machine (another
  architecture, another NVRTC) is never looked up: a carried payload cannot be loaded in the wrong place.

Everything else goes to the wrapped backend unchanged (CuPy's disk cache, or what the application set).
A CuPy without the backend hook (before 14.2), or CUPY_CACHE_IN_MEMORY=1 (which bypasses the backend),
leaves the feature off: contexts then carry no payloads and the replay compiles, as before. The hook is
private and marked experimental by CuPy, so `install` checks for it and never fails a session.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["MAX_PROVIDED_BYTES", "install", "provide", "recording", "stats"]

# What the provided payloads may hold in all, per process: a few hundred kB per model in practice
# (BERT's per-node kernels), so this only stops a process that loads many contexts from growing.
MAX_PROVIDED_BYTES = 64 << 20

stats = {"provided": 0, "served": 0, "recorded": 0}  # per process (tests read them)

_lock = threading.Lock()
_wrapper = None  # the installed _Carrying, or False where this CuPy has no backend hook
_local = threading.local()


class _Carrying:
    """A CuPy kernel cache backend: payloads handed in by contexts first, then the wrapped backend;
    what either answers or stores is noted in the calling thread's recording, if any."""

    def __init__(self, inner):
        self.inner = inner
        self.provided: dict[str, bytes] = {}
        self.provided_bytes = 0

    def load(self, name: str):
        payload = self.provided.get(name)
        if payload is not None:
            stats["served"] += 1
        else:
            payload = self.inner.load(name)
        _note(name, payload)
        return payload

    def save(self, name: str, cubin: bytes, source: str) -> None:
        self.inner.save(name, cubin, source)
        _note(name, cubin)


def _note(name: str, payload) -> None:
    seen = getattr(_local, "seen", None)
    if seen is not None and payload is not None:
        seen[name] = bytes(payload)
        stats["recorded"] += 1


def install(compiler=None):
    """The process's wrapper around CuPy's kernel cache backend (made at the first call), or None when
    `compiler` (default: cupy.cuda.compiler) has no backend hook."""
    global _wrapper
    with _lock:
        if _wrapper is None:
            _wrapper = _wrap(compiler) or False
        return _wrapper or None


def _wrap(compiler):
    if compiler is None:
        try:
            from cupy.cuda import compiler
        except ImportError:
            return None
    current = getattr(compiler, "_kernel_cache_backend", None)
    setter = getattr(compiler, "_set_kernel_cache_backend", None)
    if current is None or setter is None:
        return None
    if isinstance(current, _Carrying):  # installed by another copy of this module (tests reload it)
        return current
    wrapper = _Carrying(current)
    setter(wrapper)
    return wrapper


@contextlib.contextmanager
def recording():
    """Collects, in this thread, name -> payload of every kernel CuPy loads or compiles in the block
    (an empty dict where the wrapper is not installed)."""
    outer = getattr(_local, "seen", None)
    seen: dict[str, bytes] = {}
    _local.seen = seen
    try:
        yield seen
    finally:
        _local.seen = outer
        if outer is not None:
            outer.update(seen)


def provide(payloads: dict) -> int:
    """Hand in a context's payloads (name -> bytes); returns how many were new. Nothing happens where
    the wrapper is not installed, or once MAX_PROVIDED_BYTES are held."""
    wrapper = install()
    if wrapper is None or not payloads:
        return 0
    added = 0
    with _lock:
        for name, payload in payloads.items():
            if name in wrapper.provided or wrapper.provided_bytes + len(payload) > MAX_PROVIDED_BYTES:
                continue
            wrapper.provided[str(name)] = bytes(payload)
            wrapper.provided_bytes += len(payload)
            added += 1
    stats["provided"] += added
    return added
