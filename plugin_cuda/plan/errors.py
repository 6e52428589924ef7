"""Errors of the compiled plan (the plugin never imports host.errors: it raises its own types)."""

from __future__ import annotations


class PlanError(ValueError):
    """A partition cannot become a plan (unsupported op, unknown shape) or a plan input is wrong."""


class DriverError(RuntimeError):
    """A CUDA driver call of the plan failed; the message names the call and the CUresult."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code
