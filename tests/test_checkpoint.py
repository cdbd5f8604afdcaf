"""Checkpoints: save -> (kill) -> load -> continue is bit-exact; writes are atomic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest

from onnx_training_ops import Adam, Momentum, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.storage import checkpoint

STEPS = 40


def _model(optimizer=None):
    return build_training_model(make_mlp((16, 32, 4), seed=7), "cross_entropy", optimizer or Adam(lr=5e-3))


def _batch(step: int):
    """The batch of 1-based step ``step``: a pure function of the step, so any process can replay it."""
    rng = np.random.default_rng(1000 + step)
    return {"input": rng.standard_normal((8, 16)).astype(np.float32), "labels": rng.integers(0, 4, 8).astype(np.int64)}


def _lr(step: int) -> float:
    return 5e-3 * 0.97 ** step  # a schedule, so the learning rate is part of what must resume


def _train(session: TrainingSession, until: int) -> None:
    done = int(session.state_dict()["optimizer.T"])
    for step in range(done + 1, until + 1):
        session.step(_batch(step), lr=_lr(step))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), f"{name} differs"


@pytest.mark.parametrize("optimizer", [Adam(lr=5e-3), Momentum(lr=0.05, nesterov=True)], ids=["adam", "nesterov"])
def test_save_load_continue_is_bit_exact(tmp_path, optimizer):
    model = _model(optimizer)
    straight = TrainingSession(model)
    _train(straight, STEPS)
    first = TrainingSession(model)
    _train(first, STEPS // 2)
    path = first.save(tmp_path / "ckpt.onnx")
    resumed = TrainingSession(path)
    _same(resumed.state_dict(), first.state_dict())
    _train(resumed, STEPS)
    _same(resumed.state_dict(), straight.state_dict())
    # the checkpoint is a regular training model
    saved = onnx.load(path)
    onnx.checker.check_model(saved, full_check=True)
    assert len(saved.training_info) == 1


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_checkpoint import _model, _train
    from onnx_training_ops import TrainingSession
    session = TrainingSession(_model())
    path = {path!r}
    step = 0
    while True:  # train and checkpoint after every step, until killed
        step += 1
        _train(session, step)
        session.save(path)
        if step == 5:
            print("checkpointing", flush=True)
    """
)


def test_checkpoint_survives_kill_and_resumes_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt.onnx")
    code = CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), path=path)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "checkpointing"
        time.sleep(0.3)  # the child is now saving continuously: the kill lands at a random point
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    # whatever the kill interrupted, the file is a complete checkpoint ...
    leftovers = [f for f in os.listdir(tmp_path) if f != "ckpt.onnx"]
    resumed = TrainingSession(path)
    done = int(resumed.state_dict()["optimizer.T"])
    assert done >= 5
    # ... and continuing it is bit for bit the uninterrupted run
    until = done + 10
    _train(resumed, until)
    straight = TrainingSession(_model())
    _train(straight, until)
    _same(resumed.state_dict(), straight.state_dict())
    # a temp file may remain from the killed write; it never replaces the checkpoint
    assert all(f.startswith(".ckpt.onnx.") and f.endswith(".tmp") for f in leftovers)


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "file.bin"
    checkpoint.atomic_write(path, b"old")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.atomic_write(path, b"new content")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.bin"]  # the temp file is cleaned up


def test_checkpoint_holds_state_as_initializers(tmp_path):
    session = TrainingSession(_model())
    _train(session, 3)
    saved = onnx.load(session.save(tmp_path / "c.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in saved.graph.initializer}
    inits.update({t.name: onnx.numpy_helper.to_array(t) for t in saved.training_info[0].algorithm.initializer})
    for name, value in session.state_dict().items():
        assert inits[name].shape == value.shape
        assert inits[name].tobytes() == value.tobytes()
    assert int(inits["optimizer.T"]) == 3
    # initialize() on a checkpoint resets the optimizer state (spec), keeps the trained weights as its initializers
    again = TrainingSession(tmp_path / "c.onnx")
    again.initialize()
    assert int(again.state_dict()["optimizer.T"]) == 0
    assert not np.any(again.state_dict()["W0.V"])
    np.testing.assert_array_equal(again.state_dict()["W0"], session.state_dict()["W0"])
