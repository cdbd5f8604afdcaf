"""Interleaved rounds: each contender in its own long-lived process, timed turn by turn.

Every worker runs :func:`.timing.serve`: it warms up, prints a ready line (JSON, any
facts it wants to report), then answers each ``N`` on stdin with the seconds ``N`` steps
took, and its peak RSS when stdin closes. A round runs every contender once, one at a time,
so load from elsewhere hits all alike; ratios are taken round by round and their median
reported (:func:`median_ratio`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Outcome:
    """One contender's rounds: seconds per step in each round, the ready line's facts, its
    peak RSS (MiB) at the end, or why it is n/a."""

    seconds_per_step: list[float] = field(default_factory=list)
    ready: dict = field(default_factory=dict)
    peak_rss_mb: float | None = None
    na: str | None = None

    def as_dict(self) -> dict:
        if self.na is not None:
            return {"n/a": self.na}
        return {"seconds_per_step": self.seconds_per_step, "median_s": statistics.median(self.seconds_per_step),
                "best_s": min(self.seconds_per_step), "peak_rss_mb": self.peak_rss_mb, **self.ready}


def _failure(proc: subprocess.Popen, log) -> str:
    code = proc.wait()
    log.seek(0)
    err = [line for line in log.read().strip().splitlines() if line.strip()]
    return f"worker exited with {code}: {err[-1] if err else ''}"


def interleaved(commands: dict[str, list[str]], steps: int | Callable[[str, dict], int], rounds: int,
                settle: float = 0.2, log=None) -> dict[str, Outcome]:
    """Start every command, wait until each is ready, then run ``rounds`` rounds of
    ``steps`` steps each (a number, or ``steps(name, ready line)``), one contender at a time.
    ``settle``: seconds of pause before each turn (the previous contender's thread pools
    stop spinning). A worker that fails is n/a with its last line of stderr."""
    procs, logs, out, per = {}, {}, {name: Outcome() for name in commands}, {}
    try:
        for name, cmd in commands.items():
            logs[name] = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and stall the worker
            try:
                procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=logs[name], text=True)
            except OSError as exc:
                out[name].na = f"cannot run {cmd[0]}: {exc}"
        for name, p in list(procs.items()):  # warm-ups overlap; only the rounds are timed
            line = p.stdout.readline()
            if not line:
                out[name].na = _failure(p, logs[name])
                del procs[name]
                continue
            out[name].ready = json.loads(line)
            per[name] = steps(name, out[name].ready) if callable(steps) else steps
            if log:
                log(f"  {name} ready")
        for r in range(rounds):
            for name, p in list(procs.items()):
                time.sleep(settle)
                p.stdin.write(f"{per[name]}\n")
                p.stdin.flush()
                line = p.stdout.readline()
                if not line:
                    out[name].na = _failure(p, logs[name])
                    del procs[name]
                    continue
                out[name].seconds_per_step.append(json.loads(line)["seconds"] / per[name])
            if log:
                log(f"  round {r + 1}/{rounds}: " + ", ".join(
                    f"{n} {o.seconds_per_step[-1] * 1e3:.1f} ms" for n, o in out.items() if o.na is None))
        for name, p in procs.items():
            p.stdin.close()
            line = p.stdout.readline()
            if line:
                out[name].peak_rss_mb = json.loads(line).get("peak_rss_mb")
    finally:
        for p in procs.values():
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
            p.wait()
        for f in logs.values():
            f.close()
    return out


def median_ratio(a: Outcome, b: Outcome) -> float | None:
    """The median over rounds of ``a``'s step time / ``b``'s (None if either is n/a)."""
    if a.na is not None or b.na is not None or not a.seconds_per_step or not b.seconds_per_step:
        return None
    return statistics.median(x / y for x, y in zip(a.seconds_per_step, b.seconds_per_step))
