"""Fault suite, threads (issue 20 item 1): several threads, each with its own
TrainingSession, train at once. Before the fix numba's workqueue layer aborted the process
(SIGABRT) on the fast path. Each case must run, and end bit-exact where the same session
trained alone ends (the parallel and serial loops compute every element identically)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ["mlp-adam", "mlp-momentum", "mlp-adagrad", "mlp-rmsprop", "embedding-lazy", "mlp-adam-graph"]


def test_threads_with_their_own_sessions_run_and_match_a_lone_run():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_threads_child.py"), *CASES],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])
    assert proc.stdout.split("\n")[:-1] == [f"{case} same" for case in CASES]
