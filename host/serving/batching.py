"""Joining requests into session runs: group, concatenate on the batch axis, pad to a bucket, split.

Ray Serve's `@serve.batch` hands the replica a list of requests; this module decides how they run.
Requests join one run when their non-batch dimensions agree; a run holds at most `max_batch_size`
rows (a larger request runs alone); with buckets, a run's rows are padded up to the smallest bucket
that holds them, so the session sees a few fixed shapes (one compiled plan, one CUDA graph each)
instead of every size from 1 to `max_batch_size`. Padding repeats the last real row (a valid input,
unlike zeros for models that divide or index), and the padded rows of the outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from host.errors import InvalidArgument, ModelError
from host.serving.signature import DYNAMIC, STATIC, UNBATCHED, Signature


@dataclass(frozen=True)
class Piece:
    """One validated request: its feeds and its rows on the batch axis."""

    feeds: dict[str, np.ndarray]
    rows: int


@dataclass
class Run:
    """One session run: which pieces of the batch it serves and the feeds it passes."""

    members: list[int] = field(default_factory=list)
    rows: int = 0
    padded_rows: int = 0
    feeds: dict[str, np.ndarray] = field(default_factory=dict)


def power_of_two_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including max_batch_size (which ends the list even if not a power of two)."""
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size]
    return (*sizes, max_batch_size)


def resolve_buckets(buckets, max_batch_size: int, gpu: bool) -> tuple[int, ...]:
    """The bucket sizes a deployment pads to; () means no padding.

    "auto": powers of two on a GPU deployment (each bucket keeps its compiled plan and CUDA graph),
    none on the CPU (padding only adds work there). True: powers of two. False/None: none. A list: those sizes.
    """
    if buckets == "auto":
        return power_of_two_buckets(max_batch_size) if gpu else ()
    if buckets is True:
        return power_of_two_buckets(max_batch_size)
    if buckets is None or buckets is False:
        return ()
    if isinstance(buckets, str) or not isinstance(buckets, Sequence):
        raise InvalidArgument(f"buckets={buckets!r}: expected 'auto', True, False, None or a list of "
                              f"positive batch sizes")
    sizes = sorted(set(buckets))
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise InvalidArgument(f"buckets={list(buckets)!r}: every bucket must be a positive int; got {list(buckets)}")
    return tuple(sizes)


class BatchPolicy:
    """How a list of pieces becomes session runs for one model signature."""

    def __init__(self, signature: Signature, max_batch_size: int, buckets: tuple[int, ...]):
        self.signature = signature
        self.max_batch_size = max_batch_size
        if signature.batch_kind == STATIC:
            # A fixed batch is padded only when it is itself a bucket (then it is the only one).
            self.buckets = (signature.static_batch,) if signature.static_batch in buckets else ()
            self.capacity = signature.static_batch
        else:
            self.buckets = buckets if signature.batch_kind == DYNAMIC else ()
            self.capacity = max_batch_size

    @property
    def pads_static(self) -> bool:
        return self.signature.batch_kind == STATIC and bool(self.buckets)

    def plan(self, pieces: Sequence[Piece]) -> list[Run]:
        """Group pieces whose non-batch shapes agree, fill runs up to the capacity, concatenate, pad."""
        if self.signature.batch_kind == UNBATCHED:
            return [Run([i], p.rows, p.rows, p.feeds) for i, p in enumerate(pieces)]
        groups: dict[tuple, list[int]] = {}
        for i, piece in enumerate(pieces):
            groups.setdefault(_shape_key(piece), []).append(i)
        runs = []
        for members in groups.values():
            runs += self._fill(pieces, members)
        for run in runs:
            run.feeds = self._joined(pieces, run)
        return runs

    def _fill(self, pieces: Sequence[Piece], members: list[int]) -> list[Run]:
        runs: list[Run] = []
        current = Run()
        for i in members:
            rows = pieces[i].rows
            if current.members and current.rows + rows > self.capacity:
                runs.append(current)
                current = Run()
            current.members.append(i)
            current.rows += rows
        runs.append(current)
        for run in runs:
            run.padded_rows = self.bucket_for(run.rows)
        return runs

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket holding `rows`; `rows` itself when none does (or there are no buckets)."""
        if rows == 0:
            return 0
        return next((b for b in self.buckets if b >= rows), rows)

    def _joined(self, pieces: Sequence[Piece], run: Run) -> dict[str, np.ndarray]:
        if len(run.members) == 1 and run.padded_rows == run.rows:
            return pieces[run.members[0]].feeds  # nothing to join: no copy
        pad = run.padded_rows - run.rows
        feeds = {}
        for spec in self.signature.inputs:
            parts = [pieces[i].feeds[spec.name] for i in run.members]
            if pad:
                parts.append(np.repeat(parts[-1][-1:], pad, axis=0))
            feeds[spec.name] = np.concatenate(parts, axis=0)
        return feeds

    def split(self, pieces: Sequence[Piece], run: Run, outputs: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Each member's rows of every output, padding dropped; in member order."""
        if self.signature.batch_kind == UNBATCHED:
            return [outputs]
        for name, value in zip(self.signature.output_names, outputs):
            if value.ndim == 0 or value.shape[0] != run.padded_rows:
                raise ModelError(f"output '{name}' has shape {list(value.shape)} after a run of "
                                 f"{run.padded_rows} rows; a batched model's outputs must carry the batch "
                                 f"on axis 0 (serve it with max_batch_size=1)")
        result, start = [], 0
        for i in run.members:
            stop = start + pieces[i].rows
            result.append([value[start:stop] for value in outputs])
            start = stop
        return result


def _shape_key(piece: Piece) -> tuple:
    return tuple(sorted((name, value.shape[1:], value.dtype.str) for name, value in piece.feeds.items()))
