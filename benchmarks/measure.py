"""Timing: one step's median, the memory-bandwidth floor, and each contender in its own process.

Each contender runs in its own process (numba's, torch's and onnxruntime's thread pools
spin-wait after their work; in one process on 2 cores they steal each other's core and a
parallel step then stalls for a scheduler slice, ~8 ms here).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from .contenders import CONTENDERS, GRAPH_OPTIONS, NATIVE_OPTIONS, ORTT, PORTABLE_OPTIONS
from .problem import TRAFFIC, NotAvailable, T
from .timing import time_step

ORTT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ortt_worker.py")


def copy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 7) -> dict:
    """Bytes read + written per second over ``nbytes`` (far beyond the last-level cache),
    with one thread and with two threads each doing half:

    - ``copy``: ``np.copyto(dst, src)``. Its stores to ``dst`` first pull each line into
      cache (write-allocate), so DRAM moves ~3 bytes per 2 counted: it understates what
      an in-place update, whose stores hit lines it has just read, can reach.
    - ``inplace``: ``np.multiply(a, 1, out=a)``, a read-modify-write stream like the
      optimizers' own.

    ``best`` (the largest) is the bandwidth the floor uses.
    """
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    half = src.size // 2
    one = np.float32(1)

    def copy(d, s):
        np.copyto(d, s)

    def inplace(d, s):
        np.multiply(d, one, out=d)

    out = {}
    for name, kernel in (("copy", copy), ("inplace", inplace)):

        def one_thread(kernel=kernel):
            kernel(dst, src)

        def two_threads(kernel=kernel):  # numpy releases the GIL in both
            th = threading.Thread(target=kernel, args=(dst[:half], src[:half]))
            th.start()
            kernel(dst[half:], src[half:])
            th.join()

        for label, f in (("1_thread", one_thread), ("2_threads", two_threads)):
            f()
            out[f"{name}_{label}"] = 2 * nbytes / min(timed(f) for _ in range(reps))
    out["best"] = max(out.values())
    return out


def timed(f: Callable[[], object]) -> float:
    """Wall time of one call of ``f``, seconds."""
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def floor_seconds(op: str, n: int, bandwidth: float, itemsize: int = 4) -> float:
    """Seconds one step must take to move its bytes (:data:`.problem.TRAFFIC`) at ``bandwidth``."""
    reads, writes = TRAFFIC[op]
    return (reads + writes) * n * itemsize / bandwidth


def measure(name: str, ops, sizes, min_time: float, max_reps: int) -> dict:
    """One contender over ops x sizes in this process: ``{"op/n": timing or {"n/a": reason}}``."""
    out = {}
    for op in ops:
        for n in sizes:
            try:
                step = CONTENDERS[name](op, n)
            except NotAvailable as exc:
                out[f"{op}/{n}"] = {"n/a": str(exc)}
                continue
            out[f"{op}/{n}"] = time_step(step, min_time, max_reps)
            del step
    return out


def worker_command(worker_script: str | None) -> list[str]:
    """The command that re-runs the bench CLI in a worker process."""
    if worker_script:
        return [sys.executable, worker_script]
    return [sys.executable, "-m", "benchmarks"]


def run_worker(args: list[str], worker_script: str | None, timeout: float | None = None):
    """Run a worker process; ``(parsed last stdout line, None)`` or ``(None, reason)``."""
    proc = subprocess.run(worker_command(worker_script) + args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        return None, f"worker failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def measure_isolated(name: str, ops, sizes, min_time: float, max_reps: int, worker_script: str | None = None) -> dict:
    """:func:`measure` in a fresh process. Thread pools of different contenders (numba's
    OpenMP, torch's own OpenMP, onnxruntime's) spin-wait after their work; in one process
    on 2 cores they steal each other's core and a parallel step then stalls for a
    scheduler slice (~8 ms here)."""
    args = ["--worker", name, "--ops", ",".join(ops), "--sizes", ",".join(map(str, sizes)),
            "--min-time", str(min_time), "--max-reps", str(max_reps)]  # fmt: skip
    out, reason = run_worker(args, worker_script)
    if out is None:
        return {f"{op}/{n}": {"n/a": reason} for op in ops for n in sizes}
    return out


def measure_ortt(ortt_python: str, ops, sizes, min_time: float, max_reps: int) -> dict:
    """onnxruntime-training's ``Optimizer.step()`` (AdamW) in ``ortt_python``: Adam cells
    only (it has no Momentum or Adagrad optimizer artifact); the rest are n/a."""
    out = {f"{op}/{n}": {"n/a": "onnxruntime-training artifacts offer AdamW and SGD only"}
           for op in ops for n in sizes if op != "adam"}  # fmt: skip
    if "adam" not in ops:
        return out
    cmd = [ortt_python, ORTT_WORKER, "step", ",".join(map(str, sizes)), str(min_time), str(max_reps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        reason = f"cannot run {ortt_python}: {exc}"
    else:
        if proc.returncode == 0:
            return {**out, **json.loads(proc.stdout.strip().splitlines()[-1])}
        reason = f"worker failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
    return {**out, **{f"adam/{n}": {"n/a": reason} for n in sizes}}


def run(sizes, ops, contenders, min_time: float, max_reps: int, log=print, stat: str = "median_s",
        isolate: bool = True, worker_script: str | None = None, bandwidth_bytes: int = 512 * 2**20,
        ortt_python: str | None = None) -> dict:  # fmt: skip
    """Measure every contender over ops x sizes; the report (rows with times, n/a reasons and
    the bandwidth floor, plus machine, versions and load). ``ortt_python``: the Python that
    measures the ``onnxruntime_training`` contender."""
    load_before = loadavg()
    bw = copy_bandwidth(bandwidth_bytes)
    log("bandwidth (bytes read + written), GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()))
    per_contender = {}
    for name in contenders:
        if name == ORTT and ortt_python:
            log(f"measuring {name} ({ortt_python}) ...")
            per_contender[name] = measure_ortt(ortt_python, ops, sizes, min_time, max_reps)
        elif isolate:
            log(f"measuring {name} (own process) ...")
            per_contender[name] = measure_isolated(name, ops, sizes, min_time, max_reps, worker_script)
        else:
            log(f"measuring {name} ...")
            per_contender[name] = measure(name, ops, sizes, min_time, max_reps)
    results = []
    pools = {name: cells.pop("threads") for name, cells in per_contender.items() if "threads" in cells}
    for op in ops:
        for n in sizes:
            row = {"op": op, "n": n, "floor_s": floor_seconds(op, n, bw["best"]), "times": {}, "n/a": {}}
            for name in contenders:
                cell = per_contender[name][f"{op}/{n}"]
                if "n/a" in cell:
                    row["n/a"][name] = cell["n/a"]
                else:
                    row["times"][name] = cell
            results.append(row)
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": sys.version.split()[0], "cpus": os.cpu_count()},  # fmt: skip
        "versions": _versions(),
        "loadavg_before_after": [load_before, loadavg()],  # other processes distort timings on 2 cores
        "isolated_processes": isolate,
        "graph_session_options": GRAPH_OPTIONS,
        "native_session_options": NATIVE_OPTIONS,
        "portable_session_options": PORTABLE_OPTIONS,
        "ortt_python": ortt_python if ORTT in contenders else None,
        "training_session_gradient": "G is a graph input fed on every step; R and T are initializers",
        "copy_bandwidth_bytes_per_s": bw,
        "threads": pools,  # each contender's pool sizes, as its worker saw them
        "dtype": "float32",
        "t": T,
        "stat": stat,
        "results": results,
    }


def loadavg() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load averages (None where the OS has none)."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def _versions() -> dict:
    out = {}
    for mod in ("numpy", "numba", "onnx", "onnxruntime", "onnxruntime_extensions", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing peer is reported, not fatal
            out[mod] = None
    return out
