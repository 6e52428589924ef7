"""ephost ABI: constants, the since-table and cffi declarations for any ABI version.

Both the host and plugins import this package; neither imports the other.
"""

from __future__ import annotations

import functools

from abi.header import cdef, header

_C = header().constants

ABI_VERSION: int = _C["EP_ABI_VERSION"]
ABI_MIN_VERSION: int = _C["EP_ABI_MIN_VERSION"]
ABI_NEXT_GENERATION: int = _C["EP_ABI_NEXT_GENERATION"]
SUPPORTED_VERSIONS = range(ABI_MIN_VERSION, ABI_VERSION + 1)

STATUS_NAMES: dict[int, str] = {
    v: k[len("EP_"):] for k, v in _C.items()
    if k in ("EP_OK", "EP_FAIL", "EP_INVALID_ARGUMENT", "EP_NOT_FOUND", "EP_NOT_IMPLEMENTED",
             "EP_OUT_OF_MEMORY", "EP_RUNTIME_EXCEPTION", "EP_INVALID_GRAPH", "EP_DEVICE_ERROR")
}
EP_OK = _C["EP_OK"]
EP_FAIL = _C["EP_FAIL"]
EP_INVALID_ARGUMENT = _C["EP_INVALID_ARGUMENT"]
EP_NOT_FOUND = _C["EP_NOT_FOUND"]
EP_NOT_IMPLEMENTED = _C["EP_NOT_IMPLEMENTED"]
EP_OUT_OF_MEMORY = _C["EP_OUT_OF_MEMORY"]
EP_RUNTIME_EXCEPTION = _C["EP_RUNTIME_EXCEPTION"]
EP_INVALID_GRAPH = _C["EP_INVALID_GRAPH"]
EP_DEVICE_ERROR = _C["EP_DEVICE_ERROR"]

DEVICE_CPU = _C["EP_DEVICE_CPU"]
DEVICE_GPU = _C["EP_DEVICE_GPU"]
VALUE_INTERMEDIATE = _C["EP_VALUE_INTERMEDIATE"]
VALUE_GRAPH_INPUT = _C["EP_VALUE_GRAPH_INPUT"]
VALUE_GRAPH_OUTPUT = _C["EP_VALUE_GRAPH_OUTPUT"]
VALUE_INITIALIZER = _C["EP_VALUE_INITIALIZER"]
VALUE_HOST_COMPUTED = _C["EP_VALUE_HOST_COMPUTED"]  # EpValueInfo.flags bit (since 7)
GRAPH_ALL_NODES_ON_EP = _C["EP_GRAPH_ALL_NODES_ON_EP"]
GRAPH_ALLOW_CPU_FOR_SHAPES = _C["EP_GRAPH_ALLOW_CPU_FOR_SHAPES"]
# EpFactory.ValidateCompiledModelCompatibilityInfo answers (since 7), with their onnxruntime names.
COMPILED_MODEL_NOT_APPLICABLE = _C["EP_COMPILED_MODEL_NOT_APPLICABLE"]
COMPILED_MODEL_SUPPORTED_OPTIMAL = _C["EP_COMPILED_MODEL_SUPPORTED_OPTIMAL"]
COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION = _C["EP_COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION"]
COMPILED_MODEL_UNSUPPORTED = _C["EP_COMPILED_MODEL_UNSUPPORTED"]
COMPATIBILITY_NAMES: dict[int, str] = {
    COMPILED_MODEL_NOT_APPLICABLE: "EP_NOT_APPLICABLE",
    COMPILED_MODEL_SUPPORTED_OPTIMAL: "EP_SUPPORTED_OPTIMAL",
    COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION: "EP_SUPPORTED_PREFER_RECOMPILATION",
    COMPILED_MODEL_UNSUPPORTED: "EP_UNSUPPORTED",
}

TABLES = tuple(s.name for s in header().structs if s.is_table)


@functools.cache
def since_table() -> dict[str, dict[str, tuple[int, bool]]]:
    """{table: {slot: (since, required)}} for every function table of the header."""
    return {
        s.name: {m.name: (m.since, m.required) for m in s.members if m.is_slot}
        for s in header().structs if s.is_table
    }


def since(table: str, slot: str) -> int:
    return since_table()[table][slot][0]


def slots_at(table: str, version: int) -> list[str]:
    """Slots of `table` that exist at ABI `version`, in layout order."""
    return [name for name, (s, _) in since_table()[table].items() if s <= version]


@functools.cache
def ffi_for(version: int = ABI_VERSION):
    """An FFI holding the ABI declarations of `version`: the out-of-line module's (abi/outofline.py: type
    strings parsed in C), else an in-line FFI (cached: cdef parsing costs ms). `EPHOST_CFFI_MODULES=0`: the
    in-line one always."""
    check_known_version(version)
    from abi import outofline

    return outofline.ffi_of(f"_ephost_abi_v{version}", cdef(version))


def check_known_version(version: int) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"ABI version {version} is not one this package describes; "
            f"allowed: {ABI_MIN_VERSION}..{ABI_VERSION}")


__all__ = [
    "ABI_VERSION", "ABI_MIN_VERSION", "SUPPORTED_VERSIONS", "TABLES", "cdef", "ffi_for",
    "since", "since_table", "slots_at", "header",
]
