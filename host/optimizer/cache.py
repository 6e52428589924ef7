"""An on-disk cache of optimized models, so that a model optimized once is not optimized again.

Optimizing costs the import of onnxscript and onnx-ir (about 0.3 s) and the passes themselves (from
milliseconds to many seconds for a large export); a second session for the same model reads the
result back instead. One file per entry, under `$EPHOST_CACHE_DIR/optimized` (default
`~/.cache/ephost/optimized`, docs/cli.md#start-up-time):

    key   = sha256(fingerprint of the optimizer, level, model_digest(input model))
    entry = MAGIC | sha256 of the rest (32 bytes) | len(meta) (4 bytes) | meta (JSON: the report, counts,
            opsets, sha256 of the model, the shared weights) | model

Weights are not stored twice: a large initializer of the optimized model that is byte for byte one of
the source model's (most of them: the passes move weights, they seldom make new ones) is stored as a
placeholder (its name, type and dims, no data) and listed in meta["shared"]; a hit fills it from the
source model, which the key covers. So an entry for a BERT-sized model is kilobytes, not hundreds of
megabytes, and neither writing nor reading it serialises or hashes the weights again.

The fingerprint covers what changes the result besides the model and the level: ephost's optimizer
sources, the onnx, onnxscript and onnx-ir installs, and this file format. Writes go to a temporary
file then `os.replace`, so a reader sees a whole entry or none; an entry that does not read back
(truncated, overwritten, another format, a byte changed anywhere: the digest covers the metadata too) is a
miss and is written again. The folder is bounded: when
a write takes it (as this process counts it) over `EPHOST_OPTIMIZED_CACHE_BYTES` (default 512 MiB),
the least recently used entries (by mtime, refreshed on every hit) are removed until it fits.

A session turns it off with `SessionOptions.add_session_config_entry("session.ephost.optimized_model_cache", "0")`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

from host.errors import InvalidArgument
from host.optimizer.levels import GraphOptimizationLevel
from host.optimizer.result import OptimizeResult, PassReport

CONFIG_KEY = "session.ephost.optimized_model_cache"
BUDGET_ENV = "EPHOST_OPTIMIZED_CACHE_BYTES"
DEFAULT_BUDGET = 512 << 20
SUFFIX = ".onnxopt"
MAGIC = b"EPHOST-OPTIMIZED\x03"
_LENGTH = struct.Struct("<I")
_DIGEST_SIZE = 32  # sha256
_HERE = Path(__file__).resolve().parent
# Besides host/optimizer: the dim expressions the pipeline keeps from the source model.
_OTHER_SOURCES = (_HERE.parent / "runtime" / "dims.py",)
# The cache is an optimization, never a reason to fail: a file it cannot read, write or remove is skipped.
_ignored_os_errors = functools.partial(contextlib.suppress, OSError)
# folder -> its size in bytes as this process last counted it, plus what it wrote since
_TOTALS: dict[Path, int] = {}


def enabled(entries: dict[str, str]) -> bool:
    """Whether a session with these config entries uses the cache (on unless the key says "0")."""
    value = entries.get(CONFIG_KEY, "1")
    if value not in ("0", "1"):
        raise InvalidArgument(f"session config entry '{CONFIG_KEY}' must be \"0\" or \"1\"; got {value!r}")
    return value == "1"


def directory() -> Path:
    """Where entries live: `optimized` in the per-user cache ($EPHOST_CACHE_DIR, else ~/.cache/ephost)."""
    from abi.builder import cache_dir

    return cache_dir() / "optimized"


def budget() -> int:
    """The folder's size bound in bytes ($EPHOST_OPTIMIZED_CACHE_BYTES, else 512 MiB)."""
    text = os.environ.get(BUDGET_ENV, "")
    if not text:
        return DEFAULT_BUDGET
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgument(f"{BUDGET_ENV} must be a byte count (an integer >= 0); got {text!r}")
    return value


@functools.cache
def fingerprint() -> bytes:
    """A digest of everything besides the model and the level that the optimizer's output depends on
    (computed once per process: about a millisecond, and no import of onnxscript or onnx-ir)."""
    h = hashlib.sha256(MAGIC)
    for path in sorted(_HERE.rglob("*.py")) + list(_OTHER_SOURCES):
        h.update(path.relative_to(_HERE.parent).as_posix().encode() + b"\0" + path.read_bytes())
    h.update(f"onnx {onnx.__version__}".encode())
    for package in ("onnxscript", "onnx_ir"):
        h.update(_install_fingerprint(package).encode())
    return h.digest()


def _install_fingerprint(package: str) -> str:
    """Where `package` is installed, its version (the dist-info folder's name) and its __init__'s
    size and mtime: a reinstall or an upgrade changes one of them."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return f"{package}: absent"
    origin = Path(spec.origin)
    stat = origin.stat()
    prefix = package.replace("_", "-").lower(), package.lower()
    site = origin.parent.parent
    infos = sorted(n for n in os.listdir(site) if n.endswith(".dist-info") and n.lower().startswith(prefix))
    return f"{package}: {origin} {stat.st_size} {stat.st_mtime_ns} {infos}"


class OptimizedModelCache:
    """The cache folder: `lookup` and `store` by key, bounded to `budget` bytes."""

    def __init__(self, folder: Path | None = None, budget_bytes: int | None = None):
        self.folder = Path(folder) if folder is not None else directory()
        self.budget = budget() if budget_bytes is None else budget_bytes

    @staticmethod
    def key(model_bytes: bytes, level: GraphOptimizationLevel) -> str:
        h = hashlib.sha256(fingerprint())
        h.update(f"level {int(level)}\0".encode())
        h.update(model_bytes)
        return h.hexdigest()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def lookup(self, key: str, source: onnx.ModelProto, level: GraphOptimizationLevel) -> OptimizeResult | None:
        """The stored result for `key` (the source model itself when the optimizer left it unchanged),
        or None: no entry, or one that does not read back whole."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        result = _decode(data, source, level)
        if result is not None:
            with _ignored_os_errors():
                os.utime(path)  # recently used: the last to be evicted
        return result

    def store(self, key: str, result: OptimizeResult, source: onnx.ModelProto) -> None:
        """Write the entry for `key` (atomically), then keep the folder within the budget. A folder that cannot
        be written only costs the next session the optimization again."""
        data = _encode(result, unchanged=result.model is source, source=source)
        if len(data) > self.budget:
            return
        with _ignored_os_errors():
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(key))
            except BaseException:
                with _ignored_os_errors():
                    os.unlink(tmp)
                raise
            # The folder is scanned on a process's first write and whenever the running total says
            # the budget is passed, not on every write (a test suite writes thousands of entries).
            known = _TOTALS.get(self.folder)
            if known is None or known + len(data) > self.budget:
                self.evict()
            else:
                _TOTALS[self.folder] = known + len(data)

    def evict(self) -> None:
        """Remove the least recently used entries until the folder is within the budget."""
        entries = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            with _ignored_os_errors():
                st = path.stat()
                entries.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.budget:
                break
            with _ignored_os_errors():
                path.unlink()
            total -= size
        _TOTALS[self.folder] = total


# Initializers above this many bytes are shared with the source model when their bytes are the same.
SHARED_MIN_BYTES = 4096


def _shared_light(model: onnx.ModelProto, source: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """`model` with its large initializers that are byte for byte the source's replaced by placeholders
    (type and dims only), and their names; `model` itself when there is none."""
    by_name = {t.name: t for t in source.graph.initializer if len(t.raw_data) >= SHARED_MIN_BYTES}
    shared = [t.name for t in model.graph.initializer if _same_weight(t, by_name.get(t.name))]
    if not shared:
        return model, []
    from host.runtime.model import copy_fields

    light = onnx.ModelProto()
    copy_fields(model, light, skip=("graph",))
    copy_fields(model.graph, light.graph, skip=("initializer",))
    names = set(shared)
    for t in model.graph.initializer:
        if t.name in names:
            light.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            light.graph.initializer.append(t)
    return light, shared


def _same_weight(t: onnx.TensorProto, s: onnx.TensorProto | None) -> bool:
    return (s is not None and len(t.raw_data) >= SHARED_MIN_BYTES and t.data_type == s.data_type
            and t.dims == s.dims and t.raw_data == s.raw_data and t.data_location == s.data_location)


def _fill_shared(model: onnx.ModelProto, shared: list, source: onnx.ModelProto) -> bool:
    """Fill the placeholders named in `shared` from the source's initializers; False where one does not match."""
    by_name = {t.name: t for t in source.graph.initializer}
    names = set(shared)
    for t in model.graph.initializer:
        if t.name not in names:
            continue
        s = by_name.get(t.name)
        if s is None or s.data_type != t.data_type or s.dims != t.dims or t.raw_data:
            return False
        t.CopyFrom(s)
        names.discard(t.name)
    return not names


def _encode(result: OptimizeResult, unchanged: bool, source: onnx.ModelProto | None = None) -> bytes:
    light, shared = (result.model, []) if unchanged or source is None else _shared_light(result.model, source)
    model = b"" if unchanged else light.SerializeToString()
    meta = {
        "unchanged": unchanged, "sha256": hashlib.sha256(model).hexdigest(), "level": int(result.level),
        "nodes_before": result.nodes_before, "nodes_after": result.nodes_after,
        "source_opsets": result.source_opsets, "shared": shared,
        "report": [vars(r) for r in result.report],
    }
    text = json.dumps(meta, sort_keys=True).encode()
    body = _LENGTH.pack(len(text)) + text + model
    return MAGIC + hashlib.sha256(body).digest() + body


def _decode(data: bytes, source: onnx.ModelProto, level: GraphOptimizationLevel) -> OptimizeResult | None:
    """The result an entry holds, or None for anything that is not a whole entry of this format."""
    # The digest covers the metadata as well as the model: a changed byte in the report or the counts is
    # a miss, not a hit with a wrong report (tests/property/test_optimized_cache.py).
    head = len(MAGIC) + _DIGEST_SIZE
    view = memoryview(data)
    if not data.startswith(MAGIC) or len(data) < head + _LENGTH.size \
            or hashlib.sha256(view[head:]).digest() != data[len(MAGIC):head]:
        return None
    body = view[head:]
    start = _LENGTH.size
    (length,) = _LENGTH.unpack_from(body, 0)
    try:
        meta = json.loads(bytes(body[start:start + length]))
        model_bytes = body[start + length:]
        if len(body) < start + length or hashlib.sha256(model_bytes).hexdigest() != meta["sha256"]:
            return None
        if meta["level"] != int(level):
            return None
        if meta["unchanged"]:
            model = source
        else:
            model = onnx.ModelProto()
            model.ParseFromString(model_bytes)
            if not _fill_shared(model, meta["shared"], source):
                return None
        report = [PassReport(**r) for r in meta["report"]]
        return OptimizeResult(model, level, report, meta["nodes_before"], meta["nodes_after"],
                              {str(k): int(v) for k, v in meta["source_opsets"].items()})
    except Exception:  # noqa: BLE001 - any damage (bad JSON, fields, protobuf) makes it a miss
        return None


def model_digest(proto: onnx.ModelProto) -> bytes:
    """What identifies a model for the key: its deterministic serialisation without the large weights (typed
    graph inputs stand for them), then each large weight's name, type, dims and length and the digest of its
    raw bytes as they are (no serialisation: a BERT-sized model's would take half a second), the weights
    hashed in parallel threads (host/runtime/digest.py)."""
    from host.runtime.digest import buffer_digests
    from host.runtime.model import is_large, typed_inputs

    h = hashlib.sha256(typed_inputs(proto).SerializeToString(deterministic=True))
    large = [t for t in proto.graph.initializer if is_large(t)]
    datas = ((t.raw_data or t.SerializeToString(deterministic=True)) for t in large)  # raw_data: a copy per access
    for t, (length, digest) in zip(large, buffer_digests(datas)):
        h.update(f"\0{t.name}\0{t.data_type}\0{list(t.dims)}\0{length}\0".encode())
        h.update(digest)
    return h.digest()


def optimize_cached(proto: onnx.ModelProto, level: GraphOptimizationLevel,
                    optimize: Callable[[onnx.ModelProto, GraphOptimizationLevel], OptimizeResult | None],
                    cache: OptimizedModelCache | None = None) -> OptimizeResult | None:
    """`optimize(proto, level)`, read from the cache when it holds the answer and written to it when
    not. A result that is None (the optimizer failed) or not cacheable is returned, not stored."""
    try:
        digest = model_digest(proto)
    except Exception:  # noqa: BLE001 - over protobuf's 2 GiB without its weights: optimized every time
        return optimize(proto, level)
    cache = cache or OptimizedModelCache()
    key = cache.key(digest, level)
    hit = cache.lookup(key, proto, level)
    if hit is not None:
        return hit
    result = optimize(proto, level)
    if result is not None and result.cacheable:
        cache.store(key, result, proto)
    return result
