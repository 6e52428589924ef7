"""The CLI's display of a slow session creation, fed by host.runtime.stages.

Nothing shows for a session created within a second (the usual case). Past a second, a terminal
(stderr a TTY) gets a `rich` spinner naming the current stage ("optimizing", "compiling
CUDAExecutionProvider", ...), cleared when the session is ready; elsewhere (a log, a pipe) each
stage that took longer than a second gets one line once it ends, `session: optimizing took 3.2 s`.
EPHOST_PROGRESS=0 turns the display off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

SHOW_AFTER_S = 1.0


def _label(stage: str, detail: str) -> str:
    return f"{stage} {detail}" if detail else stage


class StageDisplay:
    """An observer for host.runtime.stages.observe; `close()` clears whatever it shows."""

    def __init__(self, stream=None, tty: bool | None = None, show_after_s: float = SHOW_AFTER_S):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.show_after_s = show_after_s
        self.label = "starting"
        self.since = time.perf_counter()
        self._lock = threading.Lock()
        self._status = None  # the rich spinner, once shown
        self._closed = False
        self._timer = None
        if self.tty:
            self._timer = threading.Timer(show_after_s, self._show)
            self._timer.daemon = True
            self._timer.start()

    def __call__(self, stage: str, detail: str = "") -> None:
        now = time.perf_counter()
        with self._lock:
            if not self.tty and now - self.since > self.show_after_s and self.label != "starting":
                print(f"session: {self.label} took {now - self.since:.1f} s", file=self.stream, flush=True)
            self.label, self.since = _label(stage, detail), now
            if self._status is not None:
                self._status.update(self._text())

    def _text(self) -> str:
        return f"creating the session: {self.label}..."

    def _show(self) -> None:
        with self._lock:
            if self._closed or self.label == "done":
                return
            try:
                from rich.console import Console
            except ImportError:  # rich is a dependency; a broken install still gets one plain line
                print(self._text(), file=self.stream, flush=True)
                return
            self._status = Console(file=self.stream).status(self._text())
            self._status.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._status is not None:
                self._status.stop()
                self._status = None


@contextlib.contextmanager
def session_progress(stream=None) -> Iterator[StageDisplay | None]:
    """Show the stages of sessions created inside the block (see the module docstring)."""
    from host.runtime import stages

    if os.environ.get("EPHOST_PROGRESS", "1") == "0":
        yield None
        return
    display = StageDisplay(stream)
    try:
        with stages.observe(display):
            yield display
    finally:
        display.close()
