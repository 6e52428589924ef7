"""Warnings that point at the user's line, however deep in ephost they are raised.

A fixed `stacklevel` breaks whenever a call path gains or loses a frame (the same check runs from
session creation and from re-expansion of fused nodes); this counts ephost's own frames instead.
(Python 3.12's `skip_file_prefixes` does the same; 3.11 is supported.)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_HOST = str(Path(__file__).resolve().parents[1])  # the host package directory


def warn_caller(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """warnings.warn attributed to the first frame outside the host package."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is the caller of warn_caller
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_HOST):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
