"""Ctrl-C is held back while state is written, even when other threads could take the signal."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.interrupts import held_interrupts
from onnx_training_ops.training.fastpath import in_place_updates


@pytest.fixture(autouse=True)
def default_sigint_handler():
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def ctrl_c():
    """Send SIGINT and give whichever thread takes it time to run Python's C handler."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.02)
    for _ in range(1000):  # bytecodes: where Python runs the handler
        pass


def test_ctrl_c_inside_a_section_is_raised_when_it_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            ctrl_c()
            reached.append("end of section")
    assert reached == ["end of section"]
    with pytest.raises(KeyboardInterrupt):  # outside a section: as Python's default handler
        ctrl_c()


def test_nested_sections_raise_once_at_the_outermost_end():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            with held_interrupts():
                ctrl_c()
            reached.append("inner ended quietly")
    assert reached == ["inner ended quietly"]
    with held_interrupts():  # the note was taken back
        pass


def test_the_programs_own_handler_is_called_at_the_end_and_put_back():
    calls = []

    def mine(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGINT, mine)
    with held_interrupts():
        ctrl_c()
        assert calls == []
    assert calls == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is mine
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with held_interrupts():
        ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_other_threads_hold_nothing_and_change_nothing():
    seen = []

    def worker():
        with held_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]


def _session():
    training = ot.build_training_model(make_mlp((8, 16, 3), seed=2), "cross_entropy", ot.Adam(lr=1e-2))
    return ot.TrainingSession(training)


def test_ctrl_c_while_a_step_writes_the_state_lets_the_whole_step_land(monkeypatch):
    """The session's onnxruntime threads exist: a signal mask on the main thread would let
    them take the signal and KeyboardInterrupt would cut the write in half."""
    rng = np.random.default_rng(0)
    batch = {"input": rng.standard_normal((4, 8)).astype(np.float32),
             "labels": rng.integers(0, 3, 4).astype(np.int64)}
    reference, session = _session(), _session()
    reference.step(batch)
    session.step(batch)
    reference.step(batch)
    real_apply = in_place_updates.apply_plan

    def interrupted_apply(plan):
        ctrl_c()
        real_apply(plan)

    monkeypatch.setattr(in_place_updates, "apply_plan", interrupted_apply)
    with pytest.raises(KeyboardInterrupt):
        session.step(batch)
    got, want = session.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_under_sig_dfl_the_signal_is_sent_again_when_the_section_ends():
    import subprocess
    import sys

    child = (
        "import os, signal, time\n"
        "from onnx_training_ops.interrupts import held_interrupts\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "with held_interrupts():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.02)\n"
        "    print('section ended', flush=True)\n"
        "print('not reached', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGINT
    assert result.stdout == "section ended\n"
