"""ephost host runtime: loads EP plugins by path and runs ONNX models through them."""

from host.errors import (
    AbiVersionError,
    EpError,
    EphostError,
    GraphCaptureError,
    InvalidArgument,
    KernelError,
    ModelError,
    OutOfMemoryError,
    PluginBuildError,
    PluginLoadError,
)
from host.plugins.environment import Environment

__all__ = [
    "Environment", "InferenceSession", "SessionOptions", "RunOptions", "IOBinding",
    "EphostError", "PluginLoadError", "PluginBuildError", "AbiVersionError", "EpError", "ModelError", "InvalidArgument",
    "KernelError", "GraphCaptureError", "OutOfMemoryError",
]


def __getattr__(name):
    # The session pulls in onnx and the CPU EP; load it only when asked for.
    if name in ("InferenceSession", "SessionOptions", "RunOptions", "IOBinding"):
        from host.runtime import session

        return getattr(session, name)
    raise AttributeError(f"module 'host' has no attribute {name!r}")
