"""The one timing loop of the bench, standard library only: onnxruntime-training's worker
(:mod:`._ortt_worker`, run by another Python that cannot import this package) loads this
file by path and times its steps the same way."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_step(step: Callable[[], None], min_time: float, max_reps: int, min_reps: int = 5, warmup: int = 2) -> dict:
    """Median (and min, repetitions) of ``step()`` wall time in seconds, after warm-up."""
    for _ in range(warmup):  # first-call costs (compilation, allocation, state creation, page faults)
        step()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, min_time / max(first, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}
