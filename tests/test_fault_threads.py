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


def test_a_fork_while_another_thread_runs_a_parallel_loop_leaves_the_child_able_to_train():
    """The pool lock taken by a thread of the parent is free in a forked child (which has no
    such thread): its sessions warm up and train instead of waiting forever."""
    import signal
    import threading
    import time

    from onnx_training_ops.kernels import fused

    held, release = threading.Event(), threading.Event()

    def hold_the_pool():
        with fused._POOL:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold_the_pool)
    thread.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: warm up (takes the pool lock) and leave
            try:
                fused.warm_up()
            finally:
                os._exit(0)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung on the pool lock"
    finally:
        release.set()
        thread.join()
