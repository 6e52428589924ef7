"""The one timing loop of the benchmarks: the median of repeated calls after a warm-up."""

from __future__ import annotations

import time

import numpy as np


def median_us(fn, iters: int, warmup: int = 0) -> float:
    """Median microseconds of fn() (fn synchronises itself), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return float(np.median(samples)) / 1e3
