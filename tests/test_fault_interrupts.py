"""Fault suite, Ctrl-C (issue 20 item 5): a Ctrl-C at every point of the state write of
``step``, ``backward`` and ``optimizer_step``, injected as tests/test_interrupts.py does. The
step's whole bookkeeping (T, the schedule position, the accumulated-batch count, zeroed
gradients) lands with the state or none of it does. Before the fix: ``step`` advanced T but
not ``lr_schedule_step``; ``optimizer_step`` advanced T, left ``accumulated_batches`` at 1 and
accepted a second ``optimizer_step``; ``backward`` added gradients without counting them."""

from __future__ import annotations

import numpy as np
import pytest
from test_interrupts import ctrl_c, default_sigint_handler  # noqa: F401 - the fixture

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.training import in_place_updates
from onnx_training_ops.training import step as step_module
from onnx_training_ops.training.schedules import StepLR

BATCH = {"input": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32),
         "labels": np.array([0, 1, 2, 1], np.int64)}
POINTS = ["before_commit", "in_state_update", "after_commit", "in_bookkeeping"]
# every test here: each point of the write, on the fast path and the full graph
pytestmark = [pytest.mark.parametrize("fast", [True, False], ids=["fast", "graph"]),
              pytest.mark.parametrize("point", POINTS)]


def _session(fast: bool) -> ot.TrainingSession:
    training = ot.build_training_model(make_mlp((8, 16, 3), seed=2), "cross_entropy", ot.Adam(lr=1e-2))
    session = ot.TrainingSession(training, fast=fast)
    session.set_lr_schedule(StepLR(step_size=1, gamma=0.5))
    return session


def _inject(monkeypatch, point: str) -> None:
    """Send Ctrl-C at ``point`` of the next state write."""
    if point == "in_state_update":
        for module, name in ((in_place_updates, "apply_plan"), (in_place_updates, "apply_step_with_feeds"),
                             (step_module, "finish_binding")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _real=real: (ctrl_c(), _real(*a))[1])
        return
    if point == "in_bookkeeping":
        real_committed = step_module._committed

        def committed(outcome, then):
            return real_committed(outcome, None if then is None else lambda skipped: (ctrl_c(), then(skipped)))

        monkeypatch.setattr(step_module, "_committed", committed)
        return
    real_commit = step_module._commit

    def commit(*args):
        if point == "before_commit":
            ctrl_c()
        out = real_commit(*args)
        if point == "after_commit":
            ctrl_c()
        return out

    monkeypatch.setattr(step_module, "_commit", commit)


def _interrupted(monkeypatch, point: str, call, *args) -> None:
    """``call(*args)`` with a Ctrl-C at ``point`` of its state write: KeyboardInterrupt."""
    _inject(monkeypatch, point)
    with pytest.raises(KeyboardInterrupt):
        call(*args)
    monkeypatch.undo()


def _t(session) -> int:
    return int(next(v for k, v in session.state_dict().items() if k.endswith("optimizer.T")))


def _same_state(got: ot.TrainingSession, want: ot.TrainingSession) -> None:
    a, b = got.state_dict(), want.state_dict()
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert got.lr_schedule_step == want.lr_schedule_step == _t(want)


def test_ctrl_c_in_a_steps_state_write_lands_the_whole_step(monkeypatch, point, fast):
    session, reference = _session(fast), _session(fast)
    reference.step(BATCH)
    _interrupted(monkeypatch, point, session.step, BATCH)
    _same_state(session, reference)


def test_ctrl_c_in_backward_and_optimizer_step_lands_their_bookkeeping(monkeypatch, point, fast):
    session, reference = _session(fast), _session(fast)
    reference.backward(BATCH)
    _interrupted(monkeypatch, point, session.backward, BATCH)
    assert session.accumulated_batches == 1
    for name, grad in reference.gradients().items():
        np.testing.assert_array_equal(session.gradients()[name], grad, err_msg=name)
    reference.optimizer_step()
    _interrupted(monkeypatch, point, session.optimizer_step)
    assert session.accumulated_batches == 0
    assert all(not g.any() for g in session.gradients().values())
    _same_state(session, reference)
    with pytest.raises(ot.TrainingOpError, match="no gradients accumulated"):
        session.optimizer_step()
