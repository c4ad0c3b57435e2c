"""Timing shared by the benchmarks: one warm-up each, then interleaved runs so drift hits every case alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall seconds of each case over `repeats` interleaved runs, after one warm-up run each."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def interleaved_wall_and_cpu(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall seconds, CPU seconds of this process, all its threads) of each case over `repeats` interleaved
    runs, after one warm-up run each. On a machine other jobs share, the CPU seconds move less than the wall."""
    for fn in cases.values():
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        for name, values in times.items()
    }
