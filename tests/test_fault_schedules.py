"""Fault suite, schedule-made rates (issue 20 item 4): a schedule's arguments are checked as
``step(lr=...)`` checks a rate, and so is the rate it makes at every step. Before the fix
``OneCycleLR(max_lr=nan)`` trained with NaN and negative factors gave negative rates."""

from __future__ import annotations

import math

import numpy as np
import pytest

import onnx_training_ops as ot
from onnx_training_ops import schedules
from onnx_training_ops.demo import make_mlp

BAD_ARGUMENTS = [
    (schedules.OneCycleLR, dict(max_lr=math.nan, total_steps=10)),
    (schedules.OneCycleLR, dict(max_lr=-0.1, total_steps=10)),
    (schedules.OneCycleLR, dict(max_lr=0.1, total_steps=10, div_factor=-2)),
    (schedules.OneCycleLR, dict(max_lr=0.1, total_steps=10, final_div_factor=-1)),
    (schedules.OneCycleLR, dict(max_lr=0.1, total_steps=10, div_factor=0)),
    (schedules.OneCycleLR, dict(max_lr={"learning_rate": math.inf}, total_steps=10)),
    (schedules.OneCycleLR, dict(max_lr=0.1, total_steps=10, pct_start=math.nan)),
    (schedules.StepLR, dict(step_size=2, gamma=math.nan)),
    (schedules.StepLR, dict(step_size=2, gamma=-0.5)),
    (schedules.ExponentialLR, dict(gamma=math.inf)),
    (schedules.CosineAnnealingLR, dict(T_max=5, eta_min=-1e-3)),
    (schedules.LinearLR, dict(start_factor=math.nan)),
    (schedules.MultiStepLR, dict(milestones=(2,), gamma=-1.0)),
    (schedules.WarmupCosineLR, dict(warmup_steps=2, total_steps=10, num_cycles=math.nan)),
]


@pytest.mark.parametrize("cls,kwargs", BAD_ARGUMENTS, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_bad_schedule_arguments_are_refused_at_construction(cls, kwargs):
    with pytest.raises(ot.TrainingOpError, match=cls.__name__):
        cls(**kwargs)


def _session():
    return ot.TrainingSession(ot.build_training_model(make_mlp((4, 3), seed=0), "mse", ot.Adam(lr=0.1)))


def test_a_rate_the_schedule_cannot_make_stops_the_step_before_it_runs():
    """A three-phase OneCycleLR of 2 steps with pct_start 0.5 has phases of length 0: its
    rate is 0/0 (in torch too). It is refused like step(lr=nan), the state untouched."""
    session = _session()
    session.set_lr_schedule(schedules.OneCycleLR(max_lr=0.1, total_steps=2, pct_start=0.5, three_phase=True))
    batch = {"input": np.ones((2, 4), np.float32), "target": np.zeros((2, 3), np.float32)}
    before = session.state_dict()
    with pytest.raises(ot.TrainingOpError, match="OneCycleLR: the learning rate of 'learning_rate' at optimizer "
                                                 "step 0 is not computable"):
        session.step(batch)
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert session.lr_schedule_step == 0


def test_every_rate_of_a_valid_schedule_is_finite_and_not_negative():
    for schedule in (schedules.OneCycleLR(max_lr=0.1, total_steps=7, three_phase=True),
                     schedules.WarmupCosineLR(warmup_steps=2, total_steps=7, num_cycles=1.5),
                     schedules.CosineAnnealingLR(T_max=3, eta_min=0.01)):
        rates = [schedules.rate(schedule, 0.1, k, "learning_rate") for k in range(7)]
        assert all(math.isfinite(r) and r >= 0 for r in rates), rates


def test_a_negative_rate_past_the_schedules_end_stops_the_step():
    """A linear OneCycleLR read at step total_steps (one past its last) extrapolates below 0."""
    schedule = schedules.OneCycleLR(max_lr=0.2, total_steps=4, anneal_strategy="linear")
    assert schedules.rate(schedule, 0.1, 4, "learning_rate") < 0  # the formula, as torch's
    session = _session()
    session.set_lr_schedule(schedule, step=4)
    with pytest.raises(ot.TrainingOpError, match=r"at optimizer step 4 is -[0-9.e-]+; a rate must be a finite"):
        session.step({"input": np.ones((2, 4), np.float32), "target": np.zeros((2, 3), np.float32)})
