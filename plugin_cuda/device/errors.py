"""Errors of the device layer (the plugin never imports host.errors: it raises its own types)."""

from __future__ import annotations


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code
