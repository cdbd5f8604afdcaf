"""onnxruntime-training's on-device API, call by call, against what it did (docs/migrating.md).

Each test checks one row of the migration table against the value onnxruntime-training 1.19.2
itself produced when the fixtures were made.
"""

from __future__ import annotations

import numpy as np
import pytest
from ortt_fixtures import ORTT, batch, trajectory

import onnx_training_ops as ot
from onnx_training_ops.schedules import WarmupLinearLR


def _session(case: str = "mlp", checkpoint: str = "checkpoint_10", lr: float | None = None) -> ot.TrainingSession:
    return ot.TrainingSession(ot.import_onnxruntime_training(ORTT / case, checkpoint=checkpoint,
                                                             lr=float(trajectory(case)["lr"]) if lr is None else lr))


def test_linear_lr_scheduler_is_warmup_linear_with_its_two_counts_swapped():
    """``LinearLRScheduler(optimizer, warmup_step_count=3, total_step_count=10, initial_lr=0.01)``:
    its 1.19.2 Python binding declares (total, warmup) and receives (warmup, total), so it warms
    up over 10 steps and is 0 from step 10 on; WarmupLinearLR(10, 3) is what it does."""
    theirs = trajectory("mlp")["linear_lr_schedule"]
    session = _session(checkpoint="checkpoint", lr=0.01)
    session.set_lr_schedule(WarmupLinearLR(warmup_steps=10, total_steps=3))
    ours = []
    for k in range(12):
        ours.append(session.learning_rates["learning_rate"])
        session.step(dict(zip(["input", "labels"], batch("mlp", k))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
    as_documented = [WarmupLinearLR(warmup_steps=3, total_steps=10).lr(0.01, k) for k in range(12)]
    assert not np.allclose(as_documented, theirs)


def test_the_guides_loop_runs_and_follows_their_loop():
    """docs/migrating.md, right column: the same 20 steps as their loop (the fixture script's
    train_theirs), from the checkpoint generate_artifacts wrote."""
    batches = [batch("mlp", k) for k in range(20)]
    # --- the guide's loop (ours) ---
    session = ot.TrainingSession(ot.import_onnxruntime_training(ORTT / "mlp", lr=0.01))
    losses = []
    for x, y in batches:
        out = session.step({"input": x, "labels": y})
        losses.append(float(out["loss"]))
    # ---
    theirs = trajectory("mlp")["losses"]
    assert np.max(np.abs(np.array(losses) / theirs - 1)) < 1e-5


@pytest.mark.parametrize("case", ["mlp", "bert"])
def test_input_names_are_the_feeds(case):
    """``Module.input_names()`` (training: user inputs and labels) -> ``session.feeds``."""
    names = [f.name for f in _session(case).feeds if not f.optional]
    assert names == {"mlp": ["input", "labels"], "bert": ["input_ids", "attention_mask", "labels"]}[case]
