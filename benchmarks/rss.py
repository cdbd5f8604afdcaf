"""Resident memory per phase of a run: the peak (high-water mark) and the end value.

Standard library only: onnxruntime-training's worker (another Python) loads this file by
path. On Linux the peak is the kernel's ``VmHWM`` of ``/proc/self/status``, reset at the
start of each phase by writing ``5`` to ``/proc/self/clear_refs``, so each phase reports
its own peak (``peak_mib``) and the run's peak is the largest of them. Elsewhere the peak
is ``ru_maxrss``, which cannot be reset: each phase then reports the peak so far.

    meter = Phases()
    with meter.phase("build"):
        model = build()
    meter.report()  # {"build": {"peak_mib": ..., "end_mib": ..., "seconds": ...}, ...}
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

_STATUS = "/proc/self/status"


def _status_mib(key: str) -> float | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def current_mib() -> float | None:
    """Resident set size now, MiB (None where the OS does not say)."""
    return _status_mib("VmRSS")


def peak_mib() -> float:
    """The high-water mark of the resident set, MiB (since the last :func:`reset_peak`)."""
    hwm = _status_mib("VmHWM")
    if hwm is not None:
        return hwm
    import resource  # not on Windows

    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage / 2**20 if sys.platform == "darwin" else usage / 1024  # bytes on macOS, kB elsewhere


def reset_peak() -> bool:
    """Restart the high-water mark at the current resident set (Linux); False where the
    OS cannot (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Phases:
    """Named phases, each with its peak and end resident set and its wall time."""

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}
        self.resettable = reset_peak()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the body as phase ``name`` (garbage collected first, so a phase does not
        pay for the previous one's garbage)."""
        gc.collect()
        reset_peak()
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        self.phases[name] = {"peak_mib": round(peak_mib(), 1), "end_mib": round(current_mib() or 0.0, 1),
                             "seconds": round(seconds, 4)}

    def report(self) -> dict:
        """``{phase: {"peak_mib", "end_mib", "seconds"}}`` plus ``"peak_mib"``: the run's peak."""
        out = dict(self.phases)
        out["peak_mib"] = max((p["peak_mib"] for p in self.phases.values()), default=0.0)
        out["peak_per_phase"] = self.resettable
        out["pid"] = os.getpid()
        return out
