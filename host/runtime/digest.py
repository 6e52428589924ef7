"""SHA-256 over many large buffers, hashed in parallel threads (hashlib releases the GIL over large
updates), for keys that cover a model's weights (host/optimizer/cache.py): BERT-base's 435 MB took
0.3 s on one core.

Each buffer is cut into CHUNK-byte pieces, each piece is hashed alone, and a buffer's digest is the
concatenation of its pieces' digests (a tree of one level), so the result does not depend on the
number of threads. Buffers are taken in batches of about BATCH bytes, so that a caller handing copies
(protobuf's `raw_data` is one) holds one batch of them at a time, not the whole model."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

CHUNK = 8 << 20
BATCH = 256 << 20
MAX_THREADS = 8


def _sha256(piece) -> bytes:
    return hashlib.sha256(piece).digest()


def threads() -> int:
    """The threads to hash with: the CPUs this process may use, at most MAX_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def _pieces(data) -> list:
    view = memoryview(data).cast("B")
    return [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)] or [view]


def _batch_digests(batch: list, pool) -> list[tuple[int, bytes]]:
    pieces = [_pieces(data) for data in batch]
    flat = [p for ps in pieces for p in ps]
    hashed = iter(pool.map(_sha256, flat) if pool is not None and len(flat) > 1 else map(_sha256, flat))
    return [(sum(map(len, ps)), b"".join(next(hashed) for _ in ps)) for ps in pieces]  # lengths in bytes


def buffer_digests(buffers: Iterable) -> Iterator[tuple[int, bytes]]:
    """For each buffer (bytes-like) in order, its length in bytes and the concatenated SHA-256 digests of its
    pieces."""
    workers = threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ephost-digest") if workers > 1 else None
    try:
        batch, size = [], 0
        for data in buffers:
            batch.append(data)
            size += memoryview(data).nbytes
            if size >= BATCH:
                yield from _batch_digests(batch, pool)
                batch, size = [], 0
        yield from _batch_digests(batch, pool)
    finally:
        if pool is not None:
            pool.shutdown()
