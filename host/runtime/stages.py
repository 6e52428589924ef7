"""Session-creation stages, told to an observer: what a progress display shows.

    def show(stage: str, detail: str) -> None: ...
    with stages.observe(show):
        session = InferenceSession(model)   # show("optimizing", ""), show("compiling", "CUDAExecutionProvider"), ...

InferenceSession calls `stages.enter(stage, detail)` at each boundary; with no observer that is one
context-variable read. The observer belongs to the context (thread, task) that set it, so sessions
created elsewhere at the same time are not reported to it. An observer that raises is not allowed
to break session creation: its exception is logged and it is not called again.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator

Observer = Callable[[str, str], None]

LOADING = "loading"
OPTIMIZING = "optimizing"
PARTITIONING = "partitioning"
COMPILING = "compiling"
CREATING_KERNELS = "creating kernels"
DONE = "done"
STAGES = (LOADING, OPTIMIZING, PARTITIONING, COMPILING, CREATING_KERNELS, DONE)

_OBSERVER: contextvars.ContextVar[Observer | None] = contextvars.ContextVar("ephost_stage_observer", default=None)
_log = logging.getLogger("ephost")


@contextlib.contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Call `observer(stage, detail)` at each stage boundary of sessions created inside the block."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def enter(stage: str, detail: str = "") -> None:
    """Tell the context's observer (if any) that session creation enters `stage` (one of STAGES)."""
    observer = _OBSERVER.get()
    if observer is None:
        return
    try:
        observer(stage, detail)
    except Exception:  # noqa: BLE001 - a display must never make a session fail
        _log.exception("session stage observer failed; it is no longer called")
        _OBSERVER.set(None)
