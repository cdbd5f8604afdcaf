"""Fault suite, Ctrl-C (issue 20 item 5, issue 36 B.8): a Ctrl-C at every point of the state
write of ``step``, ``backward``, ``optimizer_step`` and ``zero_grad``, injected as
tests/test_interrupts.py does. The step's whole bookkeeping (T, the schedule position, the
accumulated-batch count, zeroed gradients) lands with the state or none of it does, on every
engine strategy: the fused kernels and the native ones on host arrays, and the update in the
graph (``device=``: onnxruntime writes the state during its run), in place or into two sets,
over host arrays or device memory. Before the fix, on the host: ``step`` advanced T but not
``lr_schedule_step``; ``optimizer_step`` advanced T, left ``accumulated_batches`` at 1 and
accepted a second ``optimizer_step``; ``backward`` added gradients without counting them. On
the in-graph engine (4 of 4 trials): T=197 with ``lr_schedule_step=196``; a ``backward``'s batch
in the gradients with ``accumulated_batches=0``; an interrupted ``optimizer_step`` moved T 2->3
with the gradients kept, so the next one applied them again."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from test_interrupts import ctrl_c, default_sigint_handler  # noqa: F401 - the fixture

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.schedules import StepLR
from onnx_training_ops.training.engine import checked_config
from onnx_training_ops.training.engine import graph as graph_module
from onnx_training_ops.training.engine.memory import DeviceMemory, HostMemory
from onnx_training_ops.training.fastpath import in_place_updates
from onnx_training_ops.training.graphs import step as step_module

BATCH = {"input": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32),
         "labels": np.array([0, 1, 2, 1], np.int64)}
POINTS = ["before_commit", "in_state_update", "after_commit", "in_bookkeeping"]


def host_points(test):
    """Each point of the write, on the fused kernels and the native kernels in the graph."""
    return pytest.mark.parametrize("fast", [True, False], ids=["fast", "native"])(
        pytest.mark.parametrize("point", POINTS)(test))


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


@host_points
def test_ctrl_c_in_a_steps_state_write_lands_the_whole_step(monkeypatch, point, fast):
    session, reference = _session(fast), _session(fast)
    reference.step(BATCH)
    _interrupted(monkeypatch, point, session.step, BATCH)
    _same_state(session, reference)


@host_points
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


# ---------------------------------------------------------------- the update in the graph (device=)

# where a Ctrl-C lands in a graph program's run: before onnxruntime (the feeds), during its run
# (it writes the state in place there), after it (the returned values), in the two-set commit,
# in the session's bookkeeping
GRAPH_POINTS = ["before_run", "in_run", "after_run", "in_commit", "in_bookkeeping"]
ENGINES = {"host/in_place": ("host", None), "host/two_sets": ("host", False),
           "device/in_place": ("device", None), "device/two_sets": ("device", False)}


def _graph_session(engine: str) -> ot.TrainingSession:
    memory, in_place = ENGINES[engine]
    training = ot.build_training_model(make_mlp((8, 16, 3), seed=2), "cross_entropy", ot.Adam(lr=1e-2),
                                       clip_grad_norm=1.0)  # one flat chain: in place when allowed
    config = checked_config(["CPUExecutionProvider"], None, "raise", None, None, None, "cpu", 0, None, None,
                            in_place, memory)
    session = ot.TrainingSession._opened(training, config)
    session.set_lr_schedule(StepLR(step_size=1, gamma=0.5))
    assert session._programs.in_place() is (in_place is None)
    assert isinstance(session._store.memory, HostMemory if memory == "host" else DeviceMemory)
    return session


def _inject_graph(monkeypatch, point: str) -> None:
    """Send Ctrl-C at ``point`` of the next graph program's run."""
    if point == "before_run":
        real = graph_module.Feeds.host
        monkeypatch.setattr(graph_module.Feeds, "host", lambda *a: (ctrl_c(), real(*a))[1])
    elif point == "in_run":  # inside onnxruntime's own run (our InferenceSession holds Ctrl-C around it)
        real = ort.InferenceSession.run_with_iobinding
        monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", lambda *a: (ctrl_c(), real(*a))[1])
    elif point == "after_run":
        real = graph_module._host
        monkeypatch.setattr(graph_module, "_host", lambda *a: (ctrl_c(), real(*a))[1])
    elif point == "in_commit":
        for cls in (HostMemory, DeviceMemory):
            real = cls.commit
            monkeypatch.setattr(cls, "commit", lambda *a, _real=real: (ctrl_c(), _real(*a))[1])
    else:
        real = graph_module.GraphProgram.run

        def run(self, feeds, rates=None, then=None):
            return real(self, feeds, rates, None if then is None else lambda skipped: (ctrl_c(), then(skipped)))

        monkeypatch.setattr(graph_module.GraphProgram, "run", run)


# every point for every engine, but the commit of an in-place write (there is none)
GRAPH_CASES = pytest.mark.parametrize(("engine", "point"), [
    (e, p) for e in ENGINES for p in GRAPH_POINTS if not (p == "in_commit" and ENGINES[e][1] is None)])


def _lands(engine: str, point: str) -> bool:
    """Whether a Ctrl-C at ``point`` lets the write land (else the call is cancelled, nothing
    written): once onnxruntime may write the state in place, or once the commit started."""
    if point == "before_run":
        return False
    if point in ("in_run", "after_run"):
        return ENGINES[engine][1] is None
    return True


def _interrupted_graph(monkeypatch, point: str, call, *args) -> None:
    _inject_graph(monkeypatch, point)
    with pytest.raises(KeyboardInterrupt):
        call(*args)
    monkeypatch.undo()


def _pair(engine: str, call: str, *args) -> tuple[ot.TrainingSession, ot.TrainingSession]:
    """Two sessions of ``engine`` that both made ``call(*args)``: one to interrupt, a reference."""
    pair = _graph_session(engine), _graph_session(engine)
    for session in pair:
        getattr(session, call)(*args)
    return pair


def _interrupted_like(monkeypatch, engine: str, point: str, call: str, session, reference, *args) -> None:
    """``session.<call>(*args)`` with a Ctrl-C at ``point``; ``reference`` makes the same call
    uninterrupted when the write lands, not when the call is cancelled; then both agree."""
    if _lands(engine, point):
        getattr(reference, call)(*args)
    _interrupted_graph(monkeypatch, point, getattr(session, call), *args)
    _consistent(session, reference)


def _consistent(got: ot.TrainingSession, want: ot.TrainingSession) -> None:
    _same_state(got, want)
    assert got.accumulated_batches == want.accumulated_batches
    for name, grad in want.gradients().items():
        np.testing.assert_array_equal(got.gradients()[name], grad, err_msg=name)


@GRAPH_CASES
def test_ctrl_c_in_a_graph_step_lands_the_whole_step_or_none(monkeypatch, engine, point):
    session, reference = _pair(engine, "step", BATCH)
    _interrupted_like(monkeypatch, engine, point, "step", session, reference, BATCH)
    session.step(BATCH)  # and training goes on from there
    reference.step(BATCH)
    _consistent(session, reference)


@GRAPH_CASES
def test_ctrl_c_in_graph_backward_optimizer_step_and_zero_grad_keeps_the_bookkeeping(monkeypatch, engine, point):
    session, reference = _pair(engine, "backward", BATCH)
    _interrupted_like(monkeypatch, engine, point, "backward", session, reference, BATCH)
    _interrupted_like(monkeypatch, engine, point, "optimizer_step", session, reference)
    if session.accumulated_batches:
        session.optimizer_step()
        reference.optimizer_step()
    with pytest.raises(ot.TrainingOpError, match="no gradients accumulated"):
        session.optimizer_step()  # the gradients are never applied twice
    _consistent(session, reference)


@pytest.mark.parametrize("engine", ENGINES)
def test_ctrl_c_in_zero_grad_zeroes_every_gradient_and_the_count(monkeypatch, engine):
    session = _graph_session(engine)
    session.backward(BATCH)
    memory = type(session._store.memory)
    real = memory.zero
    monkeypatch.setattr(memory, "zero", lambda *a: (ctrl_c(), real(*a))[1])
    with pytest.raises(KeyboardInterrupt):
        session.zero_grad()
    assert session.accumulated_batches == 0
    assert all(not g.any() for g in session.gradients().values())
