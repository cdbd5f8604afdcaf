"""The one timing loop of the bench, standard library only: onnxruntime-training's worker
(:mod:`._ortt_worker`, run by another Python that cannot import this package) loads this
file by path and times its steps the same way; the workers of interleaved rounds serve
their steps with :func:`serve`."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable


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


def peak_rss_mb() -> float | None:
    """This process's peak resident set size in MiB (None where the OS does not say).

    Linux: ``VmHWM`` of /proc/self/status, which starts afresh at exec. ``ru_maxrss`` does
    not: a worker started by a parent holding 1 GB would report at least 1 GB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20  # kB on Linux, bytes on macOS


def serve(run: Callable[[int], None], ready: dict, stdin=None, stdout=None) -> None:
    """The worker side of interleaved rounds (:mod:`.rounds`): print ``ready`` (a JSON line),
    then for each line ``N`` on stdin run ``run(N)`` and print ``{"seconds": ...}``; when
    stdin closes, print ``{"peak_rss_mb": ...}``."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    print(json.dumps(ready), file=stdout, flush=True)
    for line in stdin:
        steps = int(line)
        t0 = time.perf_counter()
        run(steps)
        print(json.dumps({"seconds": time.perf_counter() - t0}), file=stdout, flush=True)
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}), file=stdout, flush=True)


def warm_up(run: Callable[[int], None], min_steps: int = 3, min_seconds: float = 1.0) -> float:
    """Run at least ``min_steps`` steps and ``min_seconds`` (first-step compilation and
    allocation, caches, a cycle of batches); the seconds per step of the last batch of them."""
    run(1)
    start, done, per_step = time.perf_counter(), 1, None
    batch = max(1, min_steps - 1)
    while done < min_steps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        run(batch)
        per_step = (time.perf_counter() - t0) / batch
        done += batch
        batch = max(batch, int(0.25 / max(per_step, 1e-6)))  # ~0.25 s a batch
    return per_step
