"""Any batch size in any order (issue 29, core B): ``evaluate`` with a batch of 32 then 5
failed ("output 'logits' has shape {32,4} but the computed output shape for this run is
{5,4}": onnxruntime's output of the last run stayed bound and was offered again). Each
call's results are checked against numpy's forward pass on the session's current weights,
and the arrays returned earlier must not change under later calls."""

from __future__ import annotations

import numpy as np
import pytest

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp

SIZES = (32, 5, 1, 7, 32, 2)


def _session():
    model = make_mlp(sizes=(6, 8, 4))
    return ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.Adam(lr=1e-2)))


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 4, n)


def _logits(state, x):
    h = np.maximum(x.astype(np.float64) @ state["W0"] + state["b0"], 0)
    return h @ state["W1"] + state["b1"]


def _cross_entropy(logits, y):
    z = logits - logits.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]))


@pytest.mark.parametrize("order", [SIZES, SIZES[::-1]])
def test_evaluate_and_run_take_any_batch_size(order):
    s = _session()
    x, y = _data()
    kept = []
    for n in order:
        state = s.state_dict()
        result = s.evaluate({"input": x[:n], "labels": y[:n]}, outputs=["logits"])
        expected = _logits(state, x[:n])
        np.testing.assert_allclose(result["logits"], expected, rtol=1e-5, atol=1e-6)
        assert result["logits"].shape == (n, 4)
        np.testing.assert_allclose(float(result["loss"]), _cross_entropy(expected, y[:n]), rtol=1e-5)
        plain = s.evaluate({"input": x[:n], "labels": y[:n]})  # the loss alone, same batch
        np.testing.assert_allclose(float(plain["loss"]), float(result["loss"]), rtol=1e-6)
        (ran,) = s.run(["logits"], {"input": x[:n]})
        np.testing.assert_allclose(ran, expected, rtol=1e-5, atol=1e-6)
        kept.append((result["logits"].copy(), result["logits"]))
    for copy, returned in kept:  # a later call never wrote into an array handed out before
        np.testing.assert_array_equal(copy, returned)


@pytest.mark.parametrize("order", [SIZES, SIZES[::-1]])
def test_step_and_backward_take_any_batch_size(order):
    s = _session()
    x, y = _data()
    for n in order:
        state = s.state_dict()
        out = s.step({"input": x[:n], "labels": y[:n]}, outputs=["logits"])
        expected = _logits(state, x[:n])  # computed before the update
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(out["loss"]), _cross_entropy(expected, y[:n]), rtol=1e-5)
        assert not np.array_equal(s.state_dict()["W1"], state["W1"])
    for n in order:
        state = s.state_dict()
        out = s.backward({"input": x[:n], "labels": y[:n]})
        np.testing.assert_allclose(float(out["loss"]), _cross_entropy(_logits(state, x[:n]), y[:n]), rtol=1e-5)
    s.optimizer_step()


def test_evaluate_between_steps_of_other_sizes():
    """Interleaved: a step of 32, evaluate 5, a step of 7, evaluate 32 (each program keeps its own binding)."""
    s = _session()
    x, y = _data()
    for step_n, eval_n in ((32, 5), (7, 32), (1, 1), (5, 7)):
        s.step({"input": x[:step_n], "labels": y[:step_n]})
        state = s.state_dict()
        out = s.evaluate({"input": x[:eval_n], "labels": y[:eval_n]}, outputs=["logits"])
        np.testing.assert_allclose(out["logits"], _logits(state, x[:eval_n]), rtol=1e-5, atol=1e-6)
