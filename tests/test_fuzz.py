"""The fuzz suite (issue 9): seeded mutations of optimizer graphs, Gradient graphs, training
models, training and inference feeds, and checkpoint bytes (cases in tests/fuzz_cases.py).

Each category runs in a subprocess that reports every case as it finishes; a case that
kills the process (crash) or reports nothing within CASE_TIMEOUT (hang) is counted, and a
fresh process carries on with the next case. Every case must end in a result equal to an
independent reference or one of our clean errors — no crash, hang, raw exception, changed
state after a failed step, or damaged checkpoint loading different values.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time

import pytest

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_cases.py")
SEED = 20261122
STARTUP_TIMEOUT = 120.0  # imports, numba's cached kernels, the first session (a loaded machine)
CASE_TIMEOUT = 30.0
SIZES = {"graphs": 300, "gradients": 200, "training_feeds": 250, "inference_feeds": 250,
         "checkpoints": 210, "training_models": 100}


def run_category(category: str, n: int, seed: int = SEED) -> dict:
    """Counts of ran/clean/crash/hang/wrong over cases 0..n-1, and the first bad examples."""
    counts = dict.fromkeys(("ran", "clean", "crash", "hang", "wrong"), 0)
    examples: list[str] = []
    start = 0
    while start < n:
        with tempfile.TemporaryFile() as stderr:
            proc = subprocess.Popen([sys.executable, CASES, category, str(seed), str(start), str(n)],
                                    stdout=subprocess.PIPE, stderr=stderr)
            start, failure = _collect(proc, start, counts, examples)
            if failure:  # the case after the last reported one crashed or hung the process
                counts[failure] += 1
                stderr.seek(0)
                tail = stderr.read().decode(errors="replace").strip().splitlines()[-3:]
                examples.append(f"case {start}: {failure} (exit {proc.returncode}): {' | '.join(tail)}")
                start += 1
    return {"category": category, **counts, "examples": examples[:5]}


def _collect(proc: subprocess.Popen, start: int, counts: dict, examples: list) -> tuple[int, str]:
    """Read the process's per-case lines until it exits; (next case, "" | "crash" | "hang")."""
    fd, buffer, next_case = proc.stdout.fileno(), b"", start
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            proc.wait()
            return next_case, "hang"
        chunk = os.read(fd, 65536)
        if not chunk:
            proc.wait()
            return next_case, ("" if proc.returncode == 0 else "crash")
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            case = json.loads(line)
            counts[case["outcome"]] += 1
            if case["outcome"] == "wrong" and len(examples) < 5:
                examples.append(f"case {case['i']} {case['kind']}: {case['detail']}")
            next_case = case["i"] + 1
            deadline = time.monotonic() + CASE_TIMEOUT


@pytest.mark.parametrize("category", sorted(SIZES))
def test_fuzz(category):
    n = SIZES[category]
    result = run_category(category, n)
    print(json.dumps(result))
    assert sum(result[k] for k in ("ran", "clean", "crash", "hang", "wrong")) == n
    assert result["crash"] == result["hang"] == result["wrong"] == 0, result["examples"]
    assert result["clean"] > n // 10  # the mutations reach the error paths...
    assert category == "checkpoints" or result["ran"] > n // 10  # ...and valid ones still run


def test_the_driver_counts_crashes_and_hangs(tmp_path, monkeypatch):
    """A process that dies or stalls on a case costs that case only: the next process goes on."""
    script = tmp_path / "cases.py"
    script.write_text(
        "import json, os, sys, time\n"
        "start, stop = int(sys.argv[3]), int(sys.argv[4])\n"
        "for i in range(start, stop):\n"
        "    if i == 2: os.abort()\n"
        "    if i == 4: time.sleep(60)\n"
        "    print(json.dumps({'i': i, 'outcome': 'ran', 'kind': 'k', 'detail': ''}), flush=True)\n")
    monkeypatch.setattr(sys.modules[__name__], "CASES", str(script))
    monkeypatch.setattr(sys.modules[__name__], "CASE_TIMEOUT", 1.0)
    monkeypatch.setattr(sys.modules[__name__], "STARTUP_TIMEOUT", 3.0)
    result = run_category("any", 7)
    assert (result["ran"], result["crash"], result["hang"]) == (5, 1, 1), result
