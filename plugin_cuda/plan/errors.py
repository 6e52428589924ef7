"""Errors of the compiled plan (the plugin never imports host.errors: it raises its own types)."""

from __future__ import annotations

from plugin_cuda.device.errors import DriverError

__all__ = ["DriverError", "PlanError"]


class PlanError(ValueError):
    """A partition cannot become a plan (unsupported op, unknown shape) or a plan input is wrong."""
