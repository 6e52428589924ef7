"""SessionOptions and RunOptions, shaped like onnxruntime's, with honest attributes.

Every attribute lives in an explicit table (`SESSION_OPTIONS`, `RUN_OPTIONS`) that says what it
does; `honoured=False` marks the ones accepted for onnxruntime compatibility but ignored (listed
in docs/onnxruntime.md, and a test keeps that list in step with this table). Setting or reading an
attribute that is not in the table is an `UnknownOptionError` naming the nearest known one, so a
typo such as `graph_optimisation_level` is never silently dropped.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import abi
from host.errors import InvalidArgument
from host.optimizer.levels import OrtIntEnum


class UnknownOptionError(InvalidArgument, AttributeError):
    """An option name that SessionOptions/RunOptions do not know (an AttributeError too, as in onnxruntime)."""


class MissingConfigEntry(InvalidArgument, RuntimeError):
    """get_session_config_entry / get_run_config_entry of a key never added (a RuntimeError, as onnxruntime raises)."""


class ExecutionMode(OrtIntEnum):
    """onnxruntime's execution modes; ephost runs the nodes of a session one after another."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class OrtExecutionProviderDevicePolicy(OrtIntEnum):
    """How a session picks EPs when it is given none (onnxruntime's values)."""

    DEFAULT = 0
    PREFER_CPU = 1
    PREFER_NPU = 2
    PREFER_GPU = 3
    MAX_PERFORMANCE = 4
    MAX_EFFICIENCY = 5
    MIN_OVERALL_POWER = 6


# onnxruntime severities (0 verbose .. 4 fatal) as `logging` levels.
LOG_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}

_OPTIMIZATION_LEVELS = {0: "ORT_DISABLE_ALL", 1: "ORT_ENABLE_BASIC", 2: "ORT_ENABLE_EXTENDED", 99: "ORT_ENABLE_ALL"}


def graph_optimization_level_enum():
    """host.optimizer's GraphOptimizationLevel (from its light `levels` module, not the optimizer itself)."""
    from host.optimizer.levels import GraphOptimizationLevel

    return GraphOptimizationLevel


# ---- value checks: each returns the value to store or raises InvalidArgument ---------------------
def _int_at_least(low: int) -> Callable[[str, object], int]:
    def check(where: str, value) -> int:
        if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < low:
            raise InvalidArgument(f"{where} must be an integer >= {low}; got {value!r}")
        return int(value)
    return check


def _severity(where: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) not in (-1, *LOG_LEVELS):
        raise InvalidArgument(f"{where} must be -1 (unset) or 0..4 (verbose, info, warning, error, fatal); "
                              f"got {value!r}")
    return int(value)


def _bool(where: str, value) -> bool:
    if isinstance(value, bool) or (hasattr(value, "__index__") and int(value) in (0, 1)):
        return bool(value)
    raise InvalidArgument(f"{where} must be True or False; got {value!r}")


def _text(where: str, value) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string; got {type(value).__name__} {value!r}")
    return value


def _path_text(where: str, value) -> str:
    # onnxruntime takes str; a pathlib.Path is accepted as well (users pass one naturally).
    if hasattr(value, "__fspath__"):
        value = str(value.__fspath__())
    return _text(where, value)


def _execution_mode(where: str, value) -> ExecutionMode:
    try:
        return ExecutionMode(value)
    except ValueError:
        raise InvalidArgument(f"{where} must be ExecutionMode.ORT_SEQUENTIAL or ORT_PARALLEL; got {value!r}") from None


def _optimization_level(where: str, value) -> int:
    try:
        from host.optimizer.levels import as_level  # helper A's parser: enum, int or name
    except ImportError:
        as_level = None
    if as_level is not None:
        return int(as_level(value))
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) not in _OPTIMIZATION_LEVELS:
        allowed = ", ".join(f"{name} ({v})" for v, name in _OPTIMIZATION_LEVELS.items())
        raise InvalidArgument(f"{where} must be a GraphOptimizationLevel: {allowed}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Option:
    """One attribute: its default, its check, what it does, and whether ephost honours it."""

    name: str
    default: object
    check: Callable[[str, object], object]
    effect: str
    honoured: bool = True
    read: Callable[[object], object] | None = None  # converts the stored value when read


def _level_read(value: int):
    try:
        return graph_optimization_level_enum()(value)
    except ImportError:  # optimizer not installed in this tree: the plain int still compares equal
        return value


SESSION_OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("intra_op_num_threads", 0, _int_at_least(0),
           "the thread count of every BLAS library the CPU EP uses, set for each run and restored after it "
           "(host.runtime.threads); 0: the physical cores available to the process"),
    Option("inter_op_num_threads", 0, _int_at_least(0),
           "accepted, no effect: ephost runs the nodes of a run one after another (as onnxruntime's sequential "
           "mode ignores it)", honoured=False),
    Option("execution_mode", ExecutionMode.ORT_SEQUENTIAL, _execution_mode,
           "ignored: ORT_PARALLEL is accepted but nodes still run one after another", honoured=False),
    Option("graph_optimization_level", 99, _optimization_level,
           "the optimizer level applied before partitioning (host.optimizer)", read=_level_read),
    Option("optimized_model_filepath", "", _path_text,
           "when set, the optimized model is saved to this path at session creation"),
    Option("log_severity_level", -1, _severity,
           "0..4 sets the level of the process-wide 'ephost' logger (verbose=DEBUG .. fatal=CRITICAL) when a "
           "session is created; -1 leaves it"),
    Option("log_verbosity_level", 0, _int_at_least(0),
           "ignored: ephost has one verbose level", honoured=False),
    Option("logid", "", _text, "the session's name in its log messages"),
    Option("enable_profiling", False, _bool,
           "records a Chrome-trace profile; InferenceSession.end_profiling() writes it and returns its path"),
    Option("profile_file_prefix", "ephost_profile_", _path_text,
           "the profile's file name prefix (a path prefix: directories are kept)"),
    Option("enable_cpu_mem_arena", True, _bool,
           "on: glibc's heap keeps the memory freed by the CPU EP for the next run (process-wide, set by the "
           "first session with it on; host/cpu_ep/heap.py)"),
    Option("enable_mem_pattern", True, _bool,
           "ignored: no memory-pattern planning on the CPU EP", honoured=False),
    Option("enable_mem_reuse", True, _bool,
           "ignored: values are always released after their last use", honoured=False),
    Option("use_deterministic_compute", False, _bool,
           "ignored: the CPU EP is deterministic either way; plugin EPs decide for themselves", honoured=False),
)}

RUN_OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("terminate", False, _bool,
           "a run started while it is True fails at once with an EpError (checked at run start, not between nodes)"),
    Option("log_severity_level", -1, _severity, "ignored: use SessionOptions.log_severity_level", honoured=False),
    Option("log_verbosity_level", 0, _int_at_least(0), "ignored", honoured=False),
    Option("logid", "", _text, "ignored", honoured=False),
    Option("only_execute_path_to_fetches", False, _bool,
           "ignored: every node of the model runs", honoured=False),
)}


class _Options:
    """Attributes from a class-level table; unknown names raise UnknownOptionError with a suggestion."""

    __slots__ = ("_values", "entries")
    _TABLE: dict[str, Option] = {}
    _INTERNAL: frozenset[str] = frozenset({"_values", "entries"})

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {name: o.default for name, o in self._TABLE.items()})
        object.__setattr__(self, "entries", {})

    def _unknown(self, name: str) -> UnknownOptionError:
        kind = type(self).__name__
        close = difflib.get_close_matches(name, list(self._TABLE), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known options: {', '.join(sorted(self._TABLE))}"
        return UnknownOptionError(f"{kind} has no option {name!r}; {hint}")

    def __getattr__(self, name: str):
        # Only reached when normal lookup failed: a table option or an unknown name.
        if name.startswith("__") or name in self._INTERNAL:
            raise AttributeError(name)
        option = self._TABLE.get(name)
        if option is None:
            raise self._unknown(name)
        value = self._values[name]
        return option.read(value) if option.read is not None else value

    def __setattr__(self, name: str, value) -> None:
        if name in self._INTERNAL:
            object.__setattr__(self, name, value)
            return
        option = self._TABLE.get(name)
        if option is None:
            raise self._unknown(name)
        self._values[name] = option.check(f"{type(self).__name__}.{name}", value)

    def __dir__(self):
        return sorted({*super().__dir__(), *self._TABLE})

    def _add(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"config key must be a non-empty string; got {key!r}")
        self.entries[key] = str(value)

    def _get(self, key: str, default: str | None = None) -> str | None:
        return self.entries.get(key, default)

    def _entry(self, key: str) -> str:
        """The value of config entry `key`; a missing key raises with onnxruntime's message."""
        try:
            return self.entries[key]
        except (KeyError, TypeError):
            raise MissingConfigEntry(f"{type(self).__name__} does not have configuration with key: {key}") from None

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if v != self._TABLE[k].default}
        return f"{type(self).__name__}({changed}, entries={self.entries})"


class SessionOptions(_Options):
    """Session-wide settings; config entries reach plugins through SessionOptions_GetConfigEntry."""

    __slots__ = ("_devices", "_policy")
    _TABLE = SESSION_OPTIONS
    _INTERNAL = frozenset({"_values", "entries", "_devices", "_policy"})

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_devices", [])   # [(ep_name, [EpDevice], {key: value})]
        object.__setattr__(self, "_policy", None)

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._add(key, value)

    def get_session_config_entry(self, key: str) -> str:
        return self._entry(key)

    def add_provider_for_devices(self, devices, options: dict | None = None) -> None:
        """Use the EP of `devices` (from get_ep_devices(), all of one EP) with `options`."""
        devices = list(devices) if isinstance(devices, (list, tuple)) else [devices]
        if not devices or any(not hasattr(d, "ep_name") for d in devices):
            raise InvalidArgument(f"add_provider_for_devices needs a non-empty list of devices from "
                                  f"get_ep_devices(); got {devices!r}")
        names = sorted({d.ep_name for d in devices})
        if len(names) != 1:
            raise InvalidArgument(f"add_provider_for_devices: the devices belong to several EPs {names}; "
                                  "add each EP's devices in its own call")
        if options is not None and not isinstance(options, dict):
            raise InvalidArgument(f"add_provider_for_devices: options must be a dict; got {type(options).__name__}")
        if any(name == names[0] for name, _, _ in self._devices):
            raise InvalidArgument(f"add_provider_for_devices: {names[0]} was already added")
        self._devices.append((names[0], devices, {str(k): str(v) for k, v in (options or {}).items()}))

    def set_provider_selection_policy(self, policy) -> None:
        """Pick EPs by `policy` (an OrtExecutionProviderDevicePolicy) when a session names none."""
        try:
            object.__setattr__(self, "_policy", OrtExecutionProviderDevicePolicy(policy))
        except ValueError:
            allowed = ", ".join(OrtExecutionProviderDevicePolicy.__members__)
            raise InvalidArgument(f"provider selection policy must be one of {allowed}; got {policy!r}") from None

    def has_providers(self) -> bool:
        """Whether add_provider_for_devices or set_provider_selection_policy chose EPs."""
        return bool(self._devices) or self._policy is not None

    def copy(self) -> SessionOptions:
        """An independent copy (a session keeps one, so later changes do not half-apply)."""
        other = SessionOptions()
        other._values.update(self._values)
        other.entries.update(self.entries)
        other._devices.extend(self._devices)
        object.__setattr__(other, "_policy", self._policy)
        return other


class RunOptions(_Options):
    """Per-run settings and config entries: `gpu_graph_id`, `disable_synchronize_execution_providers`, ..."""

    __slots__ = ("_c", "parsed")
    _TABLE = RUN_OPTIONS
    _INTERNAL = frozenset({"_values", "entries", "_c", "parsed"})

    def __init__(self) -> None:
        super().__init__()
        self._c: dict[tuple, tuple] = {}
        self.parsed = None  # (gpu_graph_id, sync) cached by the replay path

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._add(key, value)
        self._c = {}
        self.parsed = None

    def get_run_config_entry(self, key: str) -> str:
        return self._entry(key)

    def c_struct(self, overrides: dict[str, str] | None = None):
        """The EpRunOptions handed to OnRunStart/OnRunEnd (cached until an entry changes)."""
        key = tuple(sorted((overrides or {}).items()))
        hit = self._c.get(key)
        if hit is not None:
            return hit[0]
        entries = {**self.entries, **(overrides or {})}
        keep = []
        from host.plugins.hostapi import ffi  # the cffi declarations load with the first run, not SessionOptions

        arr = ffi.new("EpKeyValue[]", max(len(entries), 1))
        for i, (k, v) in enumerate(entries.items()):
            kc, vc = ffi.new("char[]", k.encode()), ffi.new("char[]", v.encode())
            keep += [kc, vc]
            arr[i].key, arr[i].value = kc, vc
        c = ffi.new("EpRunOptions*")
        c.struct_size, c.version = ffi.sizeof("EpRunOptions"), abi.ABI_VERSION
        c.num_entries, c.entries = len(entries), arr
        self._c[key] = (c, arr, keep)
        return c


__all__ = ["SessionOptions", "RunOptions", "ExecutionMode", "OrtExecutionProviderDevicePolicy",
           "UnknownOptionError", "SESSION_OPTIONS", "RUN_OPTIONS", "LOG_LEVELS"]
