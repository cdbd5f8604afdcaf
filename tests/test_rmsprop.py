"""RMSProp (standard ONNX ops in the algorithm graph) against torch.optim.RMSprop: every
combination of weight_decay, momentum and centered, 50 steps of an MLP, float64 tight and
float32 within rounding; the fast path (fused numba kernel) and the graph path (the standard
ops in onnxruntime) bit for bit; state in checkpoints."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from onnx import numpy_helper  # noqa: E402

from onnx_training_ops import RMSProp, TrainingSession, build_training_model  # noqa: E402
from onnx_training_ops.demo import make_mlp  # noqa: E402
from onnx_training_ops.errors import TrainingOpError  # noqa: E402
from onnx_training_ops.optim.registry import from_json, to_json  # noqa: E402

SIZES = (6, 10, 3)
STEPS = 50
COMBOS = list(itertools.product((0.0, 0.05), (0.0, 0.9), (False, True)))


def _batches(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, SIZES[0])).astype(dtype), rng.integers(0, SIZES[-1], 8))
            for _ in range(STEPS)]


def _torch_params(model, batches, opt_kwargs, dtype):
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    net = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(),
                              torch.nn.Linear(SIZES[1], SIZES[2])).to(getattr(torch, np.dtype(dtype).name))
    with torch.no_grad():
        for i, layer in enumerate((net[0], net[2])):
            layer.weight.copy_(torch.from_numpy(init[f"W{i}"].T.copy()))
            layer.bias.copy_(torch.from_numpy(init[f"b{i}"].copy()))
    opt = torch.optim.RMSprop(net.parameters(), **opt_kwargs)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return {"W0": net[0].weight.detach().numpy().T, "b0": net[0].bias.detach().numpy(),
            "W1": net[2].weight.detach().numpy().T, "b1": net[2].bias.detach().numpy()}


@pytest.mark.parametrize("weight_decay,momentum,centered", COMBOS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rmsprop_matches_torch(weight_decay, momentum, centered, dtype):
    kwargs = dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=weight_decay, momentum=momentum,
                  centered=centered)
    model = make_mlp(SIZES, activation="Tanh", dtype=dtype, seed=3)
    training = build_training_model(model, "cross_entropy", RMSProp(**kwargs))
    batches = _batches(dtype)
    states = []
    for fast in (True, False):
        session = TrainingSession(training, fast=fast)
        # the fast path cuts every tensor's standard-op update and runs the fused kernel
        assert len(session._programs.steps[0].analysis.updates[2].groups) == (4 if fast else 0)
        for x, y in batches:
            session.step({"input": x, "labels": y})
        states.append(session.state_dict())
    for name in states[0]:
        np.testing.assert_array_equal(states[0][name], states[1][name])  # fast == graph path
    expected = _torch_params(model, batches, kwargs, dtype)
    rtol, atol = (1e-10, 1e-12) if dtype == np.float64 else (2e-4, 2e-5)
    for name, value in expected.items():
        np.testing.assert_allclose(states[0][name], value, rtol=rtol, atol=atol, err_msg=name)
    wanted = {"square_avg"} | ({"momentum_buffer"} if momentum else set()) | ({"grad_avg"} if centered else set())
    assert {n.split(".", 1)[1] for n in states[0] if n.startswith("W0.")} == wanted


def test_rmsprop_state_is_checkpointed(tmp_path):
    model = make_mlp(SIZES, activation="Tanh", dtype=np.float64, seed=3)
    training = build_training_model(model, "cross_entropy", RMSProp(momentum=0.5, centered=True))
    onnx.checker.check_model(training, full_check=True)
    batches = _batches(np.float64)
    session = TrainingSession(training)
    for x, y in batches[:10]:
        session.step({"input": x, "labels": y})
    path = str(tmp_path / "rms.onnx")
    session.save(path)
    resumed = TrainingSession(path)
    for x, y in batches[10:20]:
        session.step({"input": x, "labels": y}, lr=0.003)
        resumed.step({"input": x, "labels": y}, lr=0.003)
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value)
    resumed.initialize()
    assert not resumed.state_dict()["W0.square_avg"].any()


def test_rmsprop_options_are_checked_and_round_trip():
    opt = RMSProp(lr=0.1, alpha=0.5, momentum=0.2, centered=True)
    assert from_json(to_json(opt)) == opt
    for bad in (dict(alpha=1.5), dict(lr=-1.0), dict(centered="yes"), dict(momentum=float("nan"))):
        with pytest.raises(TrainingOpError):
            RMSProp(**bad)


@pytest.mark.parametrize("adaptive", [True, False])
def test_fused_kernel_above_the_parallel_threshold(adaptive, monkeypatch):
    """Tensors large enough for the parallel loop (and the adaptive serial/parallel choice)
    still give the graph path's bits."""
    from onnx_training_ops.kernels import fused

    monkeypatch.setattr(fused, "ADAPTIVE", adaptive)
    model = make_mlp((6, 3000, 3), activation="Tanh", dtype=np.float32, seed=1)
    training = build_training_model(model, "cross_entropy",
                                    RMSProp(lr=0.01, momentum=0.5, centered=True, weight_decay=0.01))
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(6)]
    states = []
    for fast in (True, False):
        session = TrainingSession(training, fast=fast)
        for x, y in batches:
            session.step({"input": x, "labels": y})
        states.append(session.state_dict())
    for name, value in states[1].items():
        np.testing.assert_array_equal(states[0][name], value, err_msg=name)
