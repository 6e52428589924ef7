"""Static memory plan: every intermediate buffer of a plan gets one offset in one arena, once.

Pure Python (no CuPy), so it is tested on machines without a GPU.

A buffer lives from the step that writes it to the last step that reads it (both inclusive: a
kernel reads its inputs while it writes its outputs, so a buffer freed by step s cannot host a
buffer written by step s). Two buffers whose lifetimes overlap never share bytes; the others may.
Placement is greedy by size (largest first, lowest fitting offset), the heuristic TFLite's arena
planner uses: simple, deterministic, and within a few percent of optimal on inference graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugin_cuda.plan.errors import PlanError

DEFAULT_ALIGNMENT = 256  # what cudaMalloc guarantees; enough for any vector load


@dataclass(frozen=True)
class BufferRequest:
    """One buffer to place: `key` names it, written at step `first`, last read at step `last`."""

    key: object
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryPlan:
    """Offsets into one arena of `arena_bytes`; `naive_bytes` is what one buffer each would take."""

    offsets: dict
    arena_bytes: int
    naive_bytes: int
    alignment: int

    def offset(self, key) -> int:
        return self.offsets[key]


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _validate(requests: list[BufferRequest], alignment: int) -> None:
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise PlanError(f"memory plan alignment is {alignment!r}; allowed: a power of two >= 1")
    seen = set()
    for r in requests:
        if r.key in seen:
            raise PlanError(f"memory plan got buffer {r.key!r} twice; each buffer is requested once")
        seen.add(r.key)
        if not isinstance(r.nbytes, int) or r.nbytes < 0:
            raise PlanError(f"buffer {r.key!r} asks for {r.nbytes!r} bytes; allowed: an integer >= 0")
        if not (isinstance(r.first, int) and isinstance(r.last, int)) or r.first < 0 or r.last < r.first:
            raise PlanError(f"buffer {r.key!r} lives from step {r.first!r} to {r.last!r}; "
                            "allowed: integers with 0 <= first <= last")


def plan_memory(requests, alignment: int = DEFAULT_ALIGNMENT) -> MemoryPlan:
    """Assign each request an aligned offset so that buffers alive at the same step never overlap."""
    requests = list(requests)
    _validate(requests, alignment)
    order = sorted(requests, key=lambda r: (-r.nbytes, r.first, r.last))
    placed: list[tuple[int, int, BufferRequest]] = []  # (offset, end, request), any order
    offsets = {}
    top = 0
    for req in order:
        size = align_up(max(req.nbytes, 1), alignment)
        # Byte ranges taken by buffers alive at the same time as this one, by offset.
        busy = sorted((off, end) for off, end, other in placed
                      if other.first <= req.last and req.first <= other.last)
        offset = 0
        for off, end in busy:
            if offset + size <= off:
                break  # fits in the gap before this range
            offset = max(offset, align_up(end, alignment))
        offsets[req.key] = offset
        placed.append((offset, offset + size, req))
        top = max(top, offset + size)
    naive = sum(align_up(max(r.nbytes, 1), alignment) for r in requests)
    return MemoryPlan(offsets, top, naive, alignment)


def lifetimes(steps, keep: set | frozenset = frozenset()) -> dict:
    """(first, last) step per buffer from `steps`: a list of (reads, writes) per step.

    Buffers in `keep` live to the end of the plan (never reused after their last read).
    """
    spans: dict = {}
    for i, (reads, writes) in enumerate(steps):
        for key in writes:
            if key not in spans:
                spans[key] = [i, i]
            spans[key][1] = max(spans[key][1], i)
        for key in reads:
            if key in spans:
                spans[key][1] = max(spans[key][1], i)
    end = max(len(steps) - 1, 0)
    for key in keep:
        if key in spans:
            spans[key][1] = end
    return {k: (a, b) for k, (a, b) in spans.items()}


def overlapping_pairs(plan: MemoryPlan, requests) -> list[tuple]:
    """Pairs of buffers that share bytes while both are alive (empty for a correct plan): a checker."""
    reqs = list(requests)
    bad = []
    for i, a in enumerate(reqs):
        a0 = plan.offsets[a.key]
        a1 = a0 + max(a.nbytes, 1)
        for b in reqs[i + 1:]:
            b0 = plan.offsets[b.key]
            b1 = b0 + max(b.nbytes, 1)
            live = a.first <= b.last and b.first <= a.last
            if live and a0 < b1 and b0 < a1:
                bad.append((a.key, b.key))
    return bad
