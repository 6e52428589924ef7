"""Provider options of the CUDA plugin (seed 001): one table, parsed and validated at CreateEp.

Keys are accepted as `ep.cuda.KEY` or `KEY`. Booleans take 0/1/true/false; pointers take
decimal or 0x-hex addresses. No option names a library path: function pointers are given as
addresses of functions already loaded in the process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

PREFIXES = ("ep.cuda.", "ep.CUDAExecutionProvider.")


class OptionError(ValueError):
    """A provider option is malformed, unknown, or conflicts with another."""


def _bool(key: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true"):
        return True
    if v in ("0", "false"):
        return False
    raise OptionError(f"option {key}={raw!r}: expected a boolean; allowed: 0, 1, true, false")


_DECIMAL = re.compile(r"-?[0-9]+")
_HEX = re.compile(r"0x[0-9a-f]+")


def _int(key: str, raw: str, minimum: int = 0) -> int:
    # ASCII digits only: Python's int() also takes '1_000' and non-ASCII digits.
    if not _DECIMAL.fullmatch(raw.strip()):
        raise OptionError(f"option {key}={raw!r}: expected a decimal integer >= {minimum}")
    v = int(raw.strip(), 10)
    if v < minimum:
        raise OptionError(f"option {key}={raw!r}: must be >= {minimum}")
    return v


ALGO_SEARCHES = ("HEURISTIC", "EXHAUSTIVE", "DEFAULT")


def _algo_search(key: str, raw: str) -> str:
    # onnxruntime's names and meanings: cuDNN's heuristic, a timed search of every algorithm, or
    # cuDNN's implicit-precomputed-GEMM algorithm without asking.
    v = raw.strip().upper()
    if v not in ALGO_SEARCHES:
        raise OptionError(f"option {key}={raw!r}: expected a cuDNN algorithm search; allowed: "
                          f"{', '.join(ALGO_SEARCHES)}")
    return v


ATTENTION_KERNELS = ("auto", "flash", "gemm")  # kernels/flash_attention.py: CHOICES


def _choice(key: str, raw: str, allowed: tuple, what: str) -> str:
    v = raw.strip().lower()
    if v not in allowed:
        raise OptionError(f"option {key}={raw!r}: expected {what}; allowed: {', '.join(allowed)}")
    return v


def _pointer(key: str, raw: str) -> int:
    text = raw.strip().lower()
    if not (_HEX.fullmatch(text) or _DECIMAL.fullmatch(text)):
        raise OptionError(f"option {key}={raw!r}: expected an address in decimal or 0x-hex")
    v = int(text, 16) if text.startswith("0x") else int(text, 10)
    if v < 0 or v >= 1 << 64:
        raise OptionError(f"option {key}={raw!r}: address out of range 0..2**64-1")
    return v


@dataclass(frozen=True)
class CudaOptions:
    """Parsed options; field names are the option keys (arena.* use '_' for '.')."""

    device_id: int = 0
    user_compute_stream: int = 0
    do_copy_in_default_stream: bool = False
    use_ep_level_unified_stream: bool = False
    arena_use_cuda_mempool: bool = False
    arena_max_mem: int = 0
    gpu_external_alloc: int = 0
    gpu_external_free: int = 0
    gpu_external_empty_cache: int = 0
    use_tf32: bool = True
    enable_cuda_graph: bool = False
    min_num_runs_before_cuda_graph_capture: int = 2
    debug_force_capture_failure: bool = False
    compiled_plan: bool = True  # ABI v6 hosts: run fused partitions as compiled plans (plugin_cuda/plan)
    plan_auto_graph: bool = False  # a plan captures its own launches after warm-up and replays them
    plan_dynamic_shapes: bool = True  # claim partitions with symbolic dims: one plan per input-shape signature
    plan_shape_cache: int = 32  # plans kept per dynamic partition (LRU over input-shape signatures)
    plan_shape_cache_mb: int = 2048  # and their arenas' bytes per partition, in MiB
    cudnn_conv_algo_search: str = "HEURISTIC"  # how cuDNN convolutions pick their algorithm
    attention_kernel: str = "auto"  # Attention: fused flash kernel, two cuBLAS GEMMs, or by size

    @property
    def has_user_compute_stream(self) -> bool:
        return self.user_compute_stream != 0

    @property
    def unified_stream(self) -> bool:
        # A user stream is the one stream of the EP (seed 001).
        return self.use_ep_level_unified_stream or self.has_user_compute_stream

    @property
    def external_allocator(self) -> bool:
        return self.gpu_external_alloc != 0


# key -> (field, parser); documented in the README's option table.
OPTION_TABLE = {
    "device_id": ("device_id", _int),
    "user_compute_stream": ("user_compute_stream", _pointer),
    "do_copy_in_default_stream": ("do_copy_in_default_stream", _bool),
    "use_ep_level_unified_stream": ("use_ep_level_unified_stream", _bool),
    "arena.use_cuda_mempool": ("arena_use_cuda_mempool", _bool),
    "arena.max_mem": ("arena_max_mem", _int),
    "gpu_external_alloc": ("gpu_external_alloc", _pointer),
    "gpu_external_free": ("gpu_external_free", _pointer),
    "gpu_external_empty_cache": ("gpu_external_empty_cache", _pointer),
    "use_tf32": ("use_tf32", _bool),
    "enable_cuda_graph": ("enable_cuda_graph", _bool),
    "min_num_runs_before_cuda_graph_capture": ("min_num_runs_before_cuda_graph_capture", _int),
    "debug_force_capture_failure": ("debug_force_capture_failure", _bool),
    "compiled_plan": ("compiled_plan", _bool),
    "plan_auto_graph": ("plan_auto_graph", _bool),
    "plan_dynamic_shapes": ("plan_dynamic_shapes", _bool),
    "plan_shape_cache": ("plan_shape_cache", lambda key, raw: _int(key, raw, 1)),
    "plan_shape_cache_mb": ("plan_shape_cache_mb", _int),
    "cudnn_conv_algo_search": ("cudnn_conv_algo_search", _algo_search),
    "attention_kernel": ("attention_kernel", lambda key, raw: _choice(key, raw, ATTENTION_KERNELS, "an attention kernel")),
}
assert {f for f, _ in OPTION_TABLE.values()} == {f.name for f in fields(CudaOptions)}  # table and dataclass agree


def _strip(key: str) -> str:
    for p in PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return key


def parse_options(raw: dict[str, str], device_count: int, check_device: bool = True) -> CudaOptions:
    """Parse and validate; every error names the option, the value and what is allowed. Without
    `check_device` (no device to create an EP on) device_id's range is not checked."""
    values: dict[str, object] = {}
    seen: dict[str, str] = {}
    for key, value in raw.items():
        name = _strip(key)
        if name not in OPTION_TABLE:
            raise OptionError(f"unknown option {key!r} for CUDAExecutionProvider; allowed: "
                              f"{', '.join(sorted(OPTION_TABLE))} (optionally prefixed with 'ep.cuda.')")
        if name in seen:
            raise OptionError(f"option {name!r} given twice (as {seen[name]!r} and {key!r})")
        seen[name] = key
        field_name, parser = OPTION_TABLE[name]
        values[field_name] = parser(key, str(value))
    opts = CudaOptions(**values)
    _validate(opts, device_count, check_device)
    return opts


def _validate(o: CudaOptions, device_count: int, check_device: bool = True) -> None:
    if check_device and (not 0 <= o.device_id < max(device_count, 1) or device_count == 0):
        allowed = f"0..{device_count - 1}" if device_count else "none (no CUDA device)"
        raise OptionError(f"option device_id={o.device_id}: no such CUDA device; allowed: {allowed}")
    if bool(o.gpu_external_alloc) != bool(o.gpu_external_free):
        given = "gpu_external_alloc" if o.gpu_external_alloc else "gpu_external_free"
        raise OptionError(f"option {given} needs both gpu_external_alloc and gpu_external_free; "
                          "only one was given")
    if o.gpu_external_empty_cache and not o.gpu_external_alloc:
        raise OptionError("option gpu_external_empty_cache needs gpu_external_alloc and gpu_external_free")
    if o.has_user_compute_stream and o.external_allocator:
        raise OptionError("options user_compute_stream and gpu_external_alloc cannot be combined: "
                          "the external allocator is not ordered on the caller's stream")
    if o.external_allocator and (o.arena_use_cuda_mempool or o.arena_max_mem):
        raise OptionError("options gpu_external_alloc and arena.* cannot be combined: "
                          "the external allocator manages its own memory")
