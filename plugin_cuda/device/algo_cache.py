"""Algorithm choices (cuBLASLt heuristic answers, cuDNN convolution algorithms), remembered so that
a second session, a second process or a saved context (ABI v7) skips the search.

A choice is a JSON value under a string key that names everything the search depended on: the
library, the device's compute capability and the call's shapes and settings (see `lt_key` and
`conv_key`). The process keeps every choice it made or read (`lookup` / `record`); a compiled
plan's context saves the choices its partition made (`taken` between `mark()`s) and `provide`s them
back at load. On disk, `$EPHOST_CACHE_DIR/algos/<versions>.json` holds a process's choices per
library versions (`set_versions`; another CUDA, cuBLAS or cuDNN starts an empty file): read at the
first lookup, rewritten whole (atomically) after each new choice.
`EPHOST_ALGO_CACHE=0` turns the disk file off (the process table stays).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

__all__ = ["conv_key", "lookup", "lt_key", "mark", "provide", "record", "set_versions", "stats", "taken"]

_lock = threading.Lock()
_choices: dict[str, object] = {}
_order: list[str] = []  # keys in the order they were looked up or recorded (taken() reads a slice)
_state = {"versions": "", "loaded": False}
stats = {"hits": 0, "searches": 0}


def lt_key(cc: str, m: int, n: int, k: int, epilogue: str, compute_type: int, data_type: int,
           workspace_bytes: int = 0, trans_b: bool = False) -> str:
    """A cuBLASLt GEMM's key: `data_type` is the operands' cudaDataType (an algorithm found for one
    type is not valid for another), `workspace_bytes` the most it may use (one found for more may need
    more), `trans_b` B's layout. Sizes are keyed by value: a symbolic plan's sizes are SymInts, which
    format as their C expression ("S0*S1"), the same for every signature."""
    ws = f"|ws{int(workspace_bytes)}" if workspace_bytes else ""
    tb = "|tb" if trans_b else ""
    return f"cublaslt|cc{cc}|{int(m)}x{int(n)}x{int(k)}|{epilogue}|{compute_type}|t{data_type}{ws}{tb}"


def _ints(xs) -> list[int]:
    return [int(x) for x in xs]  # by value, as in lt_key


def conv_key(cc: str, kind: str, geo, dtype: str, use_tf32: bool, search: str) -> str:
    return (f"cudnn|cc{cc}|{kind}|x{_ints(geo.x_shape)}|w{_ints(geo.w_shape)}|y{_ints(geo.y_shape)}"
            f"|p{_ints(geo.pads)}|s{_ints(geo.strides)}|d{_ints(geo.dilations)}|g{int(geo.group)}|{dtype}"
            f"|tf32={int(use_tf32)}|{search}")


def set_versions(text: str) -> None:
    """The library versions choices depend on (the disk file's name); the EP sets it once."""
    with _lock:
        if text != _state["versions"]:
            _state["versions"] = text
            _state["loaded"] = False


def lookup(key: str):
    """The remembered choice of `key`, or None (then search, and `record` the answer)."""
    with _lock:
        if not _state["loaded"]:
            _state["loaded"] = True
            for k, v in _read_disk().items():
                _choices.setdefault(k, v)
        value = _choices.get(key)
        if value is not None:
            stats["hits"] += 1
            _order.append(key)
        return value


def record(key: str, value) -> None:
    """Remember a search's answer (a JSON value) for this process, its contexts and the disk file."""
    with _lock:
        stats["searches"] += 1
        _choices[key] = value
        _order.append(key)
        snapshot = dict(_choices)
    _write_disk(snapshot)


def mark() -> int:
    """A position in the order of choices; `taken(start)` lists the choices used since."""
    with _lock:
        return len(_order)


def taken(start: int) -> dict[str, object]:
    with _lock:
        return {k: _choices[k] for k in _order[start:] if k in _choices}


def provide(choices: dict) -> None:
    """Choices a saved context carries: used as if this process had searched them."""
    with _lock:
        for k, v in choices.items():
            _choices.setdefault(str(k), v)


def clear() -> None:
    """Forget the process's choices (tests: the next lookup reads the disk file again)."""
    with _lock:
        _choices.clear()
        _order.clear()
        _state["loaded"] = False


def _path() -> Path | None:
    if os.environ.get("EPHOST_ALGO_CACHE", "1") == "0" or not _state["versions"]:
        return None
    from abi.builder import cache_dir

    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in _state["versions"])
    return cache_dir() / "algos" / f"{safe}.json"


def _read_disk() -> dict:
    path = _path()
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # no file yet, or a damaged one: search again
        return {}
    return data if isinstance(data, dict) else {}


def _write_disk(choices: dict) -> None:
    """Best effort: an unwritable cache only costs the next process its searches."""
    path = _path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(choices, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
