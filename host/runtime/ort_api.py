"""onnxruntime's Python API surface over ephost: module functions, provider arguments, metadata.

`import host as ort` gives these names (host/__init__.py re-exports them). A module-level default
Environment backs the module functions, as onnxruntime's process-wide environment does; sessions
created without `env=` use it too.
"""

from __future__ import annotations

import difflib
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import abi
from host.errors import InvalidArgument
from host.runtime.options import LOG_LEVELS, OrtExecutionProviderDevicePolicy, SessionOptions

CPU_EP = "CPUExecutionProvider"
_log = logging.getLogger("ephost")


def default_environment():
    """The process-wide Environment behind the module functions and sessions given no env."""
    from host.runtime.session import default_environment as env

    return env()


# ---- devices ----------------------------------------------------------------------------------
class OrtHardwareDeviceType(enum.IntEnum):
    """onnxruntime's device kinds (its values)."""

    CPU = 0
    GPU = 1
    NPU = 2


_DEVICE_KIND = {abi.DEVICE_CPU: OrtHardwareDeviceType.CPU, abi.DEVICE_GPU: OrtHardwareDeviceType.GPU}


@dataclass(frozen=True)
class HardwareDevice:
    """onnxruntime's OrtHardwareDevice."""

    type: OrtHardwareDeviceType
    vendor: str
    vendor_id: int
    device_id: int
    metadata: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class EpDevice:
    """onnxruntime's OrtEpDevice: an EP and one device it can run on (from get_ep_devices())."""

    ep_name: str
    ep_vendor: str
    device: HardwareDevice
    ep_metadata: dict = field(default_factory=dict, compare=False)
    ep_options: dict = field(default_factory=dict, compare=False)


def _cpu_device() -> EpDevice:
    return EpDevice(CPU_EP, "ephost", HardwareDevice(OrtHardwareDeviceType.CPU, "ephost", 0, 0),
                    {"version": version()})


def ep_devices(env) -> list[EpDevice]:
    """Every device of every EP registered in `env`, then the built-in CPU EP's."""
    out = []
    for reg in env.plugins.values():
        for f in reg.factories:
            for d in f.devices:
                hw = HardwareDevice(_DEVICE_KIND.get(d.device_type, OrtHardwareDeviceType.NPU), d.vendor, d.vendor_id,
                                    d.device_id, {"name": d.name, "memory": d.memory_name})
                out.append(EpDevice(f.name, f.vendor, hw,
                                    {"version": f.plugin_version, "library_path": str(reg.path),
                                     "registration": reg.name}))
    out.append(_cpu_device())
    return out


# ---- module functions (onnxruntime's names) -----------------------------------------------------
def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("ephost")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def get_version_string() -> str:
    return version()


def get_available_providers() -> list[str]:
    """EPs a session can ask for now: registered plugin EPs, the built-in EPs whose plugin is built or
    can be built here (CUDA: listed without a GPU too, as onnxruntime-gpu lists it), the CPU EP."""
    from host.plugins.builtin import BUILTIN_PLUGINS, unavailable_reason

    env = default_environment()
    names = [f.name for reg in env.plugins.values() for f in reg.factories]
    names += [p for p in BUILTIN_PLUGINS if p not in names and unavailable_reason(p) is None]
    return [*names, CPU_EP]


def get_all_providers() -> list[str]:
    """Every provider name ephost knows of (the available ones; plugins add theirs when registered)."""
    return get_available_providers()


def get_device() -> str:
    """'GPU' when an EP registered in the default environment has a GPU device, else 'CPU'."""
    return "GPU" if any(d.device.type == OrtHardwareDeviceType.GPU for d in get_ep_devices()) else "CPU"


def register_execution_provider_library(registration_name: str, path) -> None:
    """Load the EP plugin library at `path` into the default environment under `registration_name`."""
    default_environment().register_plugin(registration_name, path)


def unregister_execution_provider_library(registration_name: str) -> None:
    """Unregister a library registered with register_execution_provider_library."""
    default_environment().unregister_plugin(registration_name)


def get_ep_devices() -> list[EpDevice]:
    """The EP devices of the default environment (the CPU EP's last)."""
    return ep_devices(default_environment())


def set_default_logger_severity(severity: int) -> None:
    """0..4 (verbose .. fatal) as the level of the 'ephost' logger."""
    if isinstance(severity, bool) or not isinstance(severity, int) or severity not in LOG_LEVELS:
        raise InvalidArgument(f"logger severity must be 0..4 (verbose, info, warning, error, fatal); got {severity!r}")
    logging.getLogger("ephost").setLevel(LOG_LEVELS[severity])


def apply_log_severity(options: SessionOptions) -> None:
    """SessionOptions.log_severity_level >= 0 sets the 'ephost' logger's level (process-wide)."""
    level = options._values["log_severity_level"]
    if level >= 0:
        logging.getLogger("ephost").setLevel(LOG_LEVELS[level])


# ---- session arguments ----------------------------------------------------------------------
# InferenceSession keyword arguments onnxruntime takes beyond the named ones; ephost ignores them.
SESSION_KWARGS = {
    "disabled_optimizers": "names of optimizers to skip (ignored: use graph_optimization_level)",
    "read_config_from_model": "read session options from the model's metadata (ignored)",
}


def check_session_kwargs(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - set(SESSION_KWARGS))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, [*SESSION_KWARGS, "sess_options", "providers", "provider_options",
                                                 "env"], n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"allowed: {sorted(SESSION_KWARGS)}"
        raise InvalidArgument(f"InferenceSession got unexpected keyword argument(s) {unknown}; {hint}")


def session_options(sess_options) -> SessionOptions:
    """A private copy of the caller's options, so changes after creation do not half-apply."""
    if sess_options is None:
        return SessionOptions()
    if not isinstance(sess_options, SessionOptions):
        raise InvalidArgument(f"sess_options must be a SessionOptions; got {type(sess_options).__name__}")
    return sess_options.copy()


def normalize_providers(providers, provider_options) -> list:
    """onnxruntime's argument forms -> [name | (name, options)], with its rules and messages.

    A bare string is taken as a one-element list (onnxruntime would iterate its characters).
    """
    if providers is None:
        if provider_options is not None:
            raise InvalidArgument("'provider_options' given without 'providers'; pass both, of the same length")
        return []
    if isinstance(providers, str):
        providers = [providers]
    if not isinstance(providers, Sequence):
        raise InvalidArgument(f"'providers' should be a sequence; got {type(providers).__name__}")
    if provider_options is None:
        return list(providers)
    if isinstance(provider_options, dict):
        provider_options = [provider_options]
    if not isinstance(provider_options, Sequence):
        raise InvalidArgument(f"'provider_options' should be a sequence; got {type(provider_options).__name__}")
    if len(providers) != len(provider_options):
        raise InvalidArgument(f"'providers' and 'provider_options' should be the same length if both are given; "
                              f"got {len(providers)} and {len(provider_options)}")
    if not all(isinstance(p, str) for p in providers):
        raise InvalidArgument("Only string values for 'providers' are supported if 'provider_options' is given")
    if not all(isinstance(o, dict) for o in provider_options):
        raise InvalidArgument("'provider_options' values must be dicts")
    return list(zip(providers, provider_options))


# Policies that put GPU EPs first; the others keep to CPU devices (onnxruntime's DEFAULT is PREFER_CPU).
_GPU_FIRST = {OrtExecutionProviderDevicePolicy.PREFER_GPU, OrtExecutionProviderDevicePolicy.MAX_PERFORMANCE}


def _by_policy(policy, env) -> list:
    devices = [d for d in ep_devices(env) if d.ep_name != CPU_EP]
    gpu = [d.ep_name for d in devices if d.device.type == OrtHardwareDeviceType.GPU]
    cpu = [d.ep_name for d in devices if d.device.type == OrtHardwareDeviceType.CPU]
    chosen = gpu + cpu if policy in _GPU_FIRST else cpu
    return list(dict.fromkeys(chosen)) + [CPU_EP]


def select_providers(providers, provider_options, options: SessionOptions, env) -> list:
    """The provider list of a session: explicit arguments, else the options' devices or policy."""
    explicit = normalize_providers(providers, provider_options)
    if explicit and options.has_providers():
        raise InvalidArgument("providers are given both as 'providers' and through SessionOptions "
                              "(add_provider_for_devices / set_provider_selection_policy); use one")
    if explicit:
        return explicit
    if options._devices:
        return [(name, opts) for name, _, opts in options._devices]
    if options._policy is not None:
        return _by_policy(options._policy, env)
    return []


# ---- model metadata ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelMetadata:
    """onnxruntime's ModelMetadata."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict


def model_metadata(model) -> ModelMetadata:
    """ModelMetadata of an onnx.ModelProto."""
    return ModelMetadata(model.producer_name, model.graph.name, model.domain, model.doc_string,
                         model.graph.doc_string, int(model.model_version),
                         {p.key: p.value for p in model.metadata_props})


__all__ = ["EpDevice", "HardwareDevice", "OrtHardwareDeviceType", "ModelMetadata", "get_available_providers", "get_all_providers",
           "get_device", "get_ep_devices", "get_version_string", "register_execution_provider_library",
           "unregister_execution_provider_library", "set_default_logger_severity"]
