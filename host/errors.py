"""Typed errors of the host. Every ABI status goes through `host.status.check`."""

from __future__ import annotations


class EphostError(Exception):
    """Base class of every error ephost raises on purpose."""


class PluginLoadError(EphostError):
    """A plugin library could not be loaded or registered."""


class PluginBuildError(PluginLoadError):
    """A plugin library could not be built (no C compiler, no Python headers, a failed compile)."""


class AbiVersionError(PluginLoadError):
    """A plugin declares an ABI version or table size this host cannot use."""


class EpError(EphostError):
    """An execution provider returned an error status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class ModelError(EphostError):
    """The model is malformed or uses something no EP supports."""


class NoSuchFile(ModelError, FileNotFoundError):
    """The model path names no file (onnxruntime's NoSuchFile; an OSError too)."""


class InvalidArgument(EphostError, ValueError):
    """A caller passed a value that is not allowed (feed, option, binding)."""


class KernelError(EphostError):
    """A kernel failed; the message names the node and the EP."""

    def __init__(self, message: str, node: str = "", ep: str = ""):
        super().__init__(message)
        self.node = node
        self.ep = ep


class GraphCaptureError(EphostError):
    """Graph capture or replay cannot proceed as asked."""


class OutOfMemoryError(EphostError, MemoryError):
    """An allocation failed; carries the requested size."""

    def __init__(self, message: str, requested: int = 0, available: int | None = None):
        super().__init__(message)
        self.requested = requested
        self.available = available
