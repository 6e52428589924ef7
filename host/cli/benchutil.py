"""The timing loop every ephost benchmark shares: warm-up, then per-call latencies and percentiles."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from host.errors import InvalidArgument

PERCENTILES = (50, 90, 99)


def bench_session(run_callable: Callable[[], object], warmup: int = 10, iters: int = 100) -> dict:
    """Call `run_callable` `warmup` times, then time `iters` calls one by one.

    Returns microseconds: first_run_us (the very first call, where lazy set-up lands), warmup_us
    (all warm-up calls together), p50_us/p90_us/p99_us, mean_us, std_us, min_us, max_us, and
    samples_us (every timed call, in order). With warmup=0 the first call is also the first sample.
    """
    if not callable(run_callable):
        raise InvalidArgument(f"run_callable must be callable; got {type(run_callable).__name__}")
    if not isinstance(warmup, int) or warmup < 0:
        raise InvalidArgument(f"warmup must be an integer >= 0; got {warmup!r}")
    if not isinstance(iters, int) or iters < 1:
        raise InvalidArgument(f"iters must be an integer >= 1; got {iters!r}")
    clock = time.perf_counter_ns
    first_ns = warm_ns = 0
    for i in range(warmup):
        t0 = clock()
        run_callable()
        dt = clock() - t0
        warm_ns += dt
        if i == 0:
            first_ns = dt
    samples = np.empty(iters, np.float64)
    for i in range(iters):
        t0 = clock()
        run_callable()
        samples[i] = clock() - t0
    samples /= 1e3
    if warmup == 0:
        first_ns = samples[0] * 1e3
    result = {f"p{p}_us": float(np.percentile(samples, p)) for p in PERCENTILES}
    result.update(
        first_run_us=first_ns / 1e3, warmup_us=warm_ns / 1e3, warmup=warmup, iters=iters,
        mean_us=float(samples.mean()), std_us=float(samples.std()),
        min_us=float(samples.min()), max_us=float(samples.max()), samples_us=samples.tolist(),
    )
    return result


def format_stats(stats: dict) -> str:
    """One block of text: first run, warm-up, percentiles and mean, in microseconds."""
    lines = [
        f"first run: {stats['first_run_us']:.1f} us"
        + (f" (warm-up: {stats['warmup']} runs, {stats['warmup_us']:.1f} us total)" if stats["warmup"] else ""),
        f"iters: {stats['iters']}",
    ]
    lines += [f"p{p}: {stats[f'p{p}_us']:.1f} us" for p in PERCENTILES]
    lines.append(f"mean: {stats['mean_us']:.1f} us (std {stats['std_us']:.1f}, min {stats['min_us']:.1f}, "
                 f"max {stats['max_us']:.1f})")
    return "\n".join(lines)


class PlanReports(logging.Handler):
    """Collects the lines plugins log about their compiled partitions (through the ABI's logger)."""

    MARK = "compiled partition '"

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.MARK in text:
            self.lines.append(text[text.index(self.MARK) + len("compiled partition "):])

    def __enter__(self) -> PlanReports:
        logger = logging.getLogger("ephost.plugin")
        self._level = logger.level
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("ephost.plugin")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def plan_counts(session, reports: list[str] = ()) -> list[str]:
    """Lines on the session's compiled partitions (ABI v6): fused nodes per partition, and what each
    plugin reported about its plans through the host logger at Compile (kernels, arena, build time)."""
    partitioner = getattr(session, "_partitioner", None)
    parts = partitioner.partitions if partitioner is not None else []
    if not parts:
        return ["compiled partitions: none (per-node kernels)"]
    fused = sum(len(getattr(getattr(p, "group", None), "nodes", ())) for p in parts)
    return [f"compiled partitions: {len(parts)} ({fused} nodes fused)"] + [f"  {line}" for line in reports]


__all__ = ["PERCENTILES", "PlanReports", "bench_session", "format_stats", "plan_counts"]
