"""Fault suite, empty batches (issue 20 item 3), and the messages of evaluate and run (item
13). An empty batch is a TrainingOpError for every loss, in step, backward and evaluate,
whatever ``on_nonfinite`` says, and the state is untouched. Before the fix only
cross-entropy's labels were checked: under MSE a zero-row batch advanced T and changed W."""

from __future__ import annotations

import numpy as np
import pytest

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp

LOSSES = ["cross_entropy", "mse", "l1", "huber", "smooth_l1", "bce_with_logits"]


def _session(loss: str, on_nonfinite: str = "raise") -> ot.TrainingSession:
    return ot.TrainingSession(ot.build_training_model(make_mlp((8, 6, 3), seed=1), loss, ot.Adam(lr=0.1)),
                              on_nonfinite=on_nonfinite)


def _batch(loss: str, rows: int) -> dict:
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 8)).astype(np.float32)
    if loss == "cross_entropy":
        return {"input": x, "labels": rng.integers(0, 3, rows).astype(np.int64)}
    target = rng.random((rows, 3)).astype(np.float32)
    return {"input": x, "target": target.round() if loss == "bce_with_logits" else target}


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
@pytest.mark.parametrize("loss", LOSSES)
def test_an_empty_batch_is_refused_and_changes_nothing(loss, on_nonfinite):
    session = _session(loss, on_nonfinite)
    before = session.state_dict()
    for where, call in (("step", session.step), ("backward", session.backward), ("evaluate", session.evaluate)):
        with pytest.raises(ot.TrainingOpError, match=f"^{where}: feed '.*' is empty: a batch needs at least one"):
            call(_batch(loss, 0))
    assert session.accumulated_batches == 0 and session.skipped_steps == 0
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert np.isfinite(session.step(_batch(loss, 4))["loss"])  # and the session goes on


def test_evaluate_names_itself_in_its_errors():
    session = _session("mse")
    bad = dict(_batch("mse", 4), input=np.zeros((4, 7), np.float32))
    with pytest.raises(ot.TrainingOpError, match=r"^evaluate: feed 'input' must have shape \[.*, 8\], found \[4, 7\]"):
        session.evaluate(bad)
    with pytest.raises(ot.TrainingOpError, match="^evaluate: unknown feed"):
        session.evaluate(dict(_batch("mse", 4), extra=np.zeros(1)))


def test_run_with_a_wrong_shape_is_one_line_as_in_step():
    session = _session("mse")
    with pytest.raises(ot.TrainingOpError) as info:
        session.run(None, {"input": np.zeros((4, 7), np.float32)})
    assert str(info.value).startswith("run: feed 'input' must have shape") and "\n" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None  # no chained traceback
