"""The cyclic garbage collector paused while a plan is built for a new input-shape signature.

Why: building a plan allocates tens of thousands of short-lived objects (lowering, fusion, code
generation), enough to trigger collections, and a generation-2 collection traverses every object of
the process: with a large framework imported beside ephost that is tens of milliseconds each, charged
to the first run at a new shape (issue 23's goal: at most 50 ms of host time). With the collector
paused, the garbage is reference-counted away as usual; what is cyclic waits for the next
collection after the build. `EPHOST_PLAN_GC_PAUSE=0` leaves the collector alone.

Nested and concurrent builds share one pause (a count under a lock); a collector that was already
disabled stays as it was.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading

__all__ = ["paused"]

_lock = threading.Lock()
_state = {"depth": 0, "ours": False}


def enabled() -> bool:
    return os.environ.get("EPHOST_PLAN_GC_PAUSE", "1") != "0"


@contextlib.contextmanager
def paused():
    """The collector disabled for the duration (see the module doc)."""
    if not enabled():
        yield
        return
    with _lock:
        if _state["depth"] == 0:
            _state["ours"] = gc.isenabled()
            if _state["ours"]:
                gc.disable()
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["ours"]:
                _state["ours"] = False
                gc.enable()
