"""ephost host runtime: loads EP plugins by path and runs ONNX models through them."""

from host.errors import (
    AbiVersionError,
    EpError,
    EphostError,
    GraphCaptureError,
    InvalidArgument,
    KernelError,
    ModelError,
    NoSuchFile,
    OutOfMemoryError,
    PluginBuildError,
    PluginLoadError,
)

__all__ = [
    "Environment", "InferenceSession", "SessionOptions", "RunOptions", "IOBinding",
    "EphostError", "PluginLoadError", "PluginBuildError", "AbiVersionError", "EpError", "ModelError", "InvalidArgument",
    "KernelError", "GraphCaptureError", "OutOfMemoryError", "NoSuchFile",
    "OrtValue", "NodeArg", "ExecutionMode", "GraphOptimizationLevel", "OrtExecutionProviderDevicePolicy",
    "ModelMetadata", "OrtEpDevice", "OrtHardwareDevice", "OrtHardwareDeviceType",
    "get_available_providers", "get_all_providers", "get_device",
    "get_ep_devices", "get_version_string", "register_execution_provider_library",
    "unregister_execution_provider_library", "set_default_logger_severity",
]


# onnxruntime's names, so that `import host as ort` runs onnxruntime scripts (docs/onnxruntime.md).
# name -> module that defines it; imported on first use (the session pulls in onnx and the CPU EP).
_LAZY = {
    "Environment": "host.plugins.environment",
    "InferenceSession": "host.runtime.session", "SessionOptions": "host.runtime.options",
    "RunOptions": "host.runtime.options", "IOBinding": "host.runtime.session", "NodeArg": "host.runtime.session",
    "OrtValue": "host.runtime.ortvalue", "ExecutionMode": "host.runtime.options",
    "OrtExecutionProviderDevicePolicy": "host.runtime.options", "GraphOptimizationLevel": "host.optimizer.levels",
    "ModelMetadata": "host.runtime.ort_api", "OrtEpDevice": "host.runtime.ort_api",
    "OrtHardwareDevice": "host.runtime.ort_api", "OrtHardwareDeviceType": "host.runtime.ort_api",
    **{fn: "host.runtime.ort_api" for fn in (
        "get_available_providers", "get_all_providers", "get_device", "get_ep_devices", "get_version_string",
        "register_execution_provider_library", "unregister_execution_provider_library",
        "set_default_logger_severity")},
}
_RENAMED = {"OrtEpDevice": "EpDevice", "OrtHardwareDevice": "HardwareDevice"}


def __getattr__(name):
    if name == "capi":
        import host.capi

        return host.capi
    if name == "__version__":
        from host.runtime.ort_api import version

        return version()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'host' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), _RENAMED.get(name, name))
