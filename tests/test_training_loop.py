"""The training loop against torch: evaluate, gradient accumulation, schedules, parameter
groups, clipping, AdamW, checkpoint properties and feed introspection; fast path and full
graph bit-identical for each."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_parity import _max_relative_error, _params_onnx_layout, _torch_net  # noqa: E402

from onnx_training_ops import Adam, AdamW, Momentum, TrainingOpError, TrainingSession, build_training_model  # noqa: E402
from onnx_training_ops import schedules as S  # noqa: E402
from onnx_training_ops.demo import make_mlp  # noqa: E402

SIZES = (8, 16, 4)
NAMES = ["W0", "b0", "W1", "b1"]


def _model(dtype=np.float64):
    return make_mlp(SIZES, activation="Tanh", dtype=dtype, seed=3)


def _batches(n, batch=16, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, SIZES[0])).astype(dtype),
             rng.integers(0, SIZES[-1], batch).astype(np.int64)) for _ in range(n)]


def _ours(training_model, batches, fast=True, before_step=None):
    session = TrainingSession(training_model, fast=fast)
    trajectory, outputs = [], []
    for k, (x, y) in enumerate(batches):
        if before_step is not None:
            before_step(session, k)
        outputs.append(session.step({"input": x, "labels": y}))
        state = session.state_dict()
        trajectory.append([state[n] for n in NAMES])
    return trajectory, outputs, session


def _torch(model, make_opt, batches, after_backward=None, scheduler=None):
    net = _torch_net(model)
    opt = make_opt(net)
    sched = scheduler(opt) if scheduler else None
    loss_fn = torch.nn.CrossEntropyLoss()
    trajectory, returned = [], []
    for x, y in batches:
        opt.zero_grad()
        loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        if after_backward is not None:
            returned.append(after_backward(net))
        opt.step()
        if sched is not None:
            sched.step()
        trajectory.append([p.copy() for p in _params_onnx_layout(net)])
    return trajectory, returned


def _same(a, b):
    for sa, sb in zip(a, b):
        for x, y in zip(sa, sb):
            np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------ evaluate

@pytest.mark.parametrize("fast", [True, False])
def test_evaluate_is_bit_equal_to_the_step_loss_and_changes_nothing(fast):
    session = TrainingSession(build_training_model(_model(np.float32), "cross_entropy", Adam()), fast=fast)
    for x, y in _batches(3, dtype=np.float32):
        before = session.state_dict()
        evaluated = session.evaluate({"input": x, "labels": y})
        for name, value in session.state_dict().items():
            np.testing.assert_array_equal(value, before[name])
        stepped = session.step({"input": x, "labels": y})
        assert evaluated["loss"].tobytes() == stepped["loss"].tobytes()
    out = session.evaluate({"input": x, "labels": y}, outputs=["logits"])
    np.testing.assert_array_equal(out["logits"], session.run(["logits"], {"input": x})[0])


def _dropout_bn_model():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                              torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    torch.manual_seed(0)
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    import io

    import onnx
    buf = io.BytesIO()
    net.eval()
    torch.onnx.export(net, (torch.randn(4, 8),), buf, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "n"}}, opset_version=17, do_constant_folding=False,
                      dynamo=False)
    return net, onnx.load_from_string(buf.getvalue())


def test_evaluate_of_a_train_mode_model_is_the_eval_mode_loss():
    net, model = _dropout_bn_model()
    train = TrainingSession(build_training_model(model, "cross_entropy", Adam(), mode="train"))
    x, y = _batches(1, dtype=np.float32)[0]
    feeds = {"input": x, "labels": y}
    for _ in range(3):  # the weights and running statistics move; evaluate follows them
        train.step(feeds)
        before = train.state_dict()
        got = train.evaluate(feeds)["loss"]
        for name, value in train.state_dict().items():
            np.testing.assert_array_equal(value, before[name])
        # the same weights in an eval-mode training model: its step reports the same loss
        eval_mode = TrainingSession(build_training_model(train.export_inference_model(), "cross_entropy", Adam()))
        assert got.tobytes() == eval_mode.step(feeds)["loss"].tobytes()
    # ... and it is torch's eval-mode loss with those weights
    state = train.state_dict()
    with torch.no_grad():
        net.load_state_dict({k: torch.from_numpy(state[k].copy()) for k in net.state_dict() if k in state},
                            strict=False)
        net.eval()
        expected = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert float(got) == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------ accumulation

@pytest.mark.parametrize("fast", [True, False])
def test_one_backward_then_optimizer_step_is_a_step_bit_for_bit(fast):
    tm = build_training_model(_model(np.float32), "cross_entropy", Adam(lr=1e-2), clip_grad_norm=1.0)
    a, b = TrainingSession(tm, fast=fast), TrainingSession(tm, fast=fast)
    for x, y in _batches(5, dtype=np.float32):
        stepped = a.step({"input": x, "labels": y})
        loss = b.backward({"input": x, "labels": y})["loss"]
        applied = b.optimizer_step()
        assert loss.tobytes() == stepped["loss"].tobytes()
        assert applied["grad_norm"].tobytes() == stepped["grad_norm"].tobytes()
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[name], value, err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_k_micro_batches_equal_one_batch_of_k_times_b(dtype, tol):
    tm = build_training_model(_model(dtype), "cross_entropy", Adam(lr=1e-2, eps=0.0), clip_grad_norm=0.5)
    whole, micro = TrainingSession(tm), TrainingSession(tm)
    k = 4
    for x, y in _batches(6, batch=32, dtype=dtype):
        whole.step({"input": x, "labels": y})
        for xs, ys in zip(np.split(x, k), np.split(y, k)):
            micro.backward({"input": xs, "labels": ys}, scale=1 / k)
        assert micro.accumulated_batches == k
        micro.optimizer_step()
        assert micro.accumulated_batches == 0
    a, b = whole.state_dict(), micro.state_dict()
    err = max(float(np.max(np.abs(a[n] - b[n])) / np.max(np.abs(a[n]))) for n in NAMES)
    assert err < tol


def test_gradients_are_torchs_and_zero_grad_clears_them():
    model = _model()
    session = TrainingSession(build_training_model(model, "cross_entropy", Momentum(lr=0.1)))
    (x1, y1), (x2, y2) = _batches(2)
    assert all(not g.any() for g in session.gradients().values())
    session.backward({"input": x1, "labels": y1})
    session.backward({"input": x2, "labels": y2})
    net = _torch_net(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in ((x1, y1), (x2, y2)):  # torch's .grad accumulates the same way
        loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    theirs = [net[0].weight.grad.numpy().T, net[0].bias.grad.numpy(), net[2].weight.grad.numpy().T,
              net[2].bias.grad.numpy()]
    ours = session.gradients()
    for name, expected in zip(NAMES, theirs):
        np.testing.assert_allclose(ours[name], expected, rtol=1e-12, atol=1e-14)
    before = session.state_dict()
    session.zero_grad()
    assert all(not g.any() for g in session.gradients().values())
    for name, value in session.state_dict().items():  # backward never touched the parameters
        np.testing.assert_array_equal(value, before[name])
    with pytest.raises(TrainingOpError, match="no gradients accumulated"):
        session.optimizer_step()


def test_step_after_backward_adds_its_batch_to_the_accumulated_gradients():
    tm = build_training_model(_model(), "cross_entropy", Momentum(lr=0.1, momentum=0.0))
    a, b = TrainingSession(tm), TrainingSession(tm)
    (x1, y1), (x2, y2) = _batches(2)
    a.backward({"input": x1, "labels": y1})
    a.step({"input": x2, "labels": y2})
    b.backward({"input": x1, "labels": y1})
    b.backward({"input": x2, "labels": y2})
    b.optimizer_step()
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[name], value)
    assert int(a.state_dict()["optimizer.T"]) == 1


def test_a_non_finite_micro_batch_is_refused_and_the_accumulation_kept():
    session = TrainingSession(build_training_model(_model(), "cross_entropy", Adam()))
    (x, y), = _batches(1)
    session.backward({"input": x, "labels": y})
    kept = session.gradients()
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(TrainingOpError, match="not applied"):
        session.backward({"input": bad, "labels": y})
    for name, value in session.gradients().items():
        np.testing.assert_array_equal(value, kept[name])
    assert session.accumulated_batches == 1


# ------------------------------------------------------------------ schedules

def _torch_lrs(make_sched, steps, base=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make_sched(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(lrs)


def _transformers_schedule(name):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, name)


SCHEDULE_CASES = {
    "StepLR": (S.StepLR(step_size=70, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, 70, 0.5)),
    "MultiStepLR": (S.MultiStepLR(milestones=(100, 350, 800), gamma=0.3),
                    lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [100, 350, 800], 0.3)),
    "ExponentialLR": (S.ExponentialLR(gamma=0.997), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.997)),
    "CosineAnnealingLR": (S.CosineAnnealingLR(T_max=300, eta_min=1e-3),
                          lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 300, 1e-3)),
    "LinearLR": (S.LinearLR(start_factor=0.1, end_factor=0.9, total_iters=400),
                 lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, 0.9, 400)),
    "OneCycleLR": (S.OneCycleLR(max_lr=0.5, total_steps=1000),
                   lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.5, total_steps=1000, cycle_momentum=False)),
    "OneCycleLR_three_phase_linear": (
        S.OneCycleLR(max_lr=0.5, total_steps=1000, pct_start=0.25, anneal_strategy="linear", three_phase=True),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.5, total_steps=1000, pct_start=0.25,
                                                      anneal_strategy="linear", three_phase=True,
                                                      cycle_momentum=False)),
    "WarmupCosineLR": (S.WarmupCosineLR(warmup_steps=100, total_steps=1000),
                       lambda o: _transformers_schedule("get_cosine_schedule_with_warmup")(o, 100, 1000)),
    "WarmupLinearLR": (S.WarmupLinearLR(warmup_steps=100, total_steps=1000),
                       lambda o: _transformers_schedule("get_linear_schedule_with_warmup")(o, 100, 1000)),
}


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_schedule_matches_torch_over_1000_steps(case):
    ours, theirs = SCHEDULE_CASES[case]
    expected = _torch_lrs(theirs, 1000)
    got = np.array([S.rate(ours, 0.1, k, "learning_rate") for k in range(1000)])
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12 * 0.1)


@pytest.mark.parametrize("fast", [True, False])
def test_a_schedule_drives_every_group_and_resumes_from_a_checkpoint(tmp_path, fast):
    model = _model()
    tm = build_training_model(model, "cross_entropy", Momentum(lr=0.1, momentum=0.9),
                              param_groups=[{"params": ["b*"], "lr": 0.05}])
    schedule = S.StepLR(step_size=3, gamma=0.5)
    batches = _batches(12)

    def attach(session, k):
        if k == 0:
            session.set_lr_schedule(schedule)

    ours, _, session = _ours(tm, batches, fast, attach)
    theirs, _ = _torch(model, lambda net: torch.optim.SGD(
        [{"params": [net[0].weight, net[2].weight]}, {"params": [net[0].bias, net[2].bias], "lr": 0.05}],
        lr=0.1, momentum=0.9), batches, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5))
    assert _max_relative_error(ours, theirs) < 1e-7  # the learning rates are float64 inputs here
    # resume mid-run: the schedule and its position come back with the checkpoint
    first = TrainingSession(tm, fast=fast)
    first.set_lr_schedule(schedule)
    for x, y in batches[:5]:
        first.step({"input": x, "labels": y})
    first.save(tmp_path / "ckpt.onnx")
    resumed = TrainingSession(str(tmp_path / "ckpt.onnx"), fast=fast)
    assert resumed.lr_schedule == schedule and resumed.lr_schedule_step == 5
    for x, y in batches[5:]:
        resumed.step({"input": x, "labels": y})
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value)


def test_explicit_lr_overrides_the_schedule_and_bad_schedules_are_named():
    session = TrainingSession(build_training_model(_model(), "cross_entropy", Momentum(lr=0.1)))
    session.set_lr_schedule(S.ExponentialLR(gamma=0.5))
    assert session.learning_rates == {"learning_rate": pytest.approx(0.1)}
    with pytest.raises(TrainingOpError, match="set_lr_schedule: expected one of"):
        session.set_lr_schedule(lambda k: 0.1)
    with pytest.raises(TrainingOpError, match="step_size must be an int > 0"):
        S.StepLR(step_size=0)
    with pytest.raises(TrainingOpError, match="unknown learning-rate input"):
        (x, y), = _batches(1)
        session.step({"input": x, "labels": y}, lr={"nope": 0.1})


# ------------------------------------------------------------------ parameter groups, clipping, AdamW

@pytest.mark.parametrize("fast", [True, False])
def test_param_groups_match_torch_param_groups(fast):
    model = _model()
    groups = [{"params": ["b*"], "weight_decay": 0.0, "lr": 0.02},
              {"params": [re.compile(r"^W1$")], "lr": 0.005, "betas": (0.8, 0.99)}]
    tm = build_training_model(model, "cross_entropy", Adam(lr=0.01, eps=0.0, weight_decay=0.05),
                              param_groups=groups)
    assert sum(n.op_type == "Adam" for n in tm.training_info[0].algorithm.node) == 3
    batches = _batches(40)
    ours, _, _ = _ours(tm, batches, fast)
    theirs, _ = _torch(model, lambda net: torch.optim.Adam(
        [{"params": [net[0].bias, net[2].bias], "weight_decay": 0.0, "lr": 0.02},
         {"params": [net[2].weight], "lr": 0.005, "betas": (0.8, 0.99)},
         {"params": [net[0].weight]}], lr=0.01, eps=0.0, weight_decay=0.05), batches)
    assert _max_relative_error(ours, theirs) < 1e-5


def test_a_frozen_group_does_not_train_and_bad_groups_are_named():
    model = _model()
    tm = build_training_model(model, "cross_entropy", Adam(), param_groups=[{"params": ["*0"], "frozen": True}])
    session = TrainingSession(tm)
    assert "W0" not in session.state_names and "W0.V" not in session.state_names  # a constant now
    before = session.state_dict()
    (x, y), = _batches(1)
    session.step({"input": x, "labels": y})
    after = session.state_dict()
    assert not np.array_equal(after["W1"], before["W1"])
    from onnx import numpy_helper
    weights = {t.name: numpy_helper.to_array(t) for t in session.export_inference_model().graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(weights["W0"], original["W0"])
    with pytest.raises(TrainingOpError, match=r"param_groups\[0\] \(group0\) matches no trainable"):
        build_training_model(model, "cross_entropy", Adam(), param_groups=[{"params": ["*norm*"]}])
    with pytest.raises(TrainingOpError, match=r"param_groups\[0\]: unknown key\(s\) \['momentum'\]"):
        build_training_model(model, "cross_entropy", Adam(), param_groups=[{"params": ["b*"], "momentum": 0.9}])
    with pytest.raises(TrainingOpError, match="freeze every trainable"):
        build_training_model(model, "cross_entropy", Adam(), param_groups=[{"params": ["*"], "frozen": True}])


def _clip_norm(max_norm):
    return lambda net: float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm))


@pytest.mark.parametrize("fast", [True, False])
def test_clip_grad_norm_matches_torch_with_the_norm_returned(fast):
    model = _model()
    tm = build_training_model(model, "cross_entropy", Momentum(lr=0.5, momentum=0.875), clip_grad_norm=0.5)
    batches = _batches(30)
    ours, outputs, _ = _ours(tm, batches, fast)
    theirs, norms = _torch(model, lambda net: torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.875),
                           batches, after_backward=_clip_norm(0.5))
    assert _max_relative_error(ours, theirs) < 1e-10
    np.testing.assert_allclose([float(o["grad_norm"]) for o in outputs], norms, rtol=1e-10)
    assert min(norms) < 0.5 < max(norms)  # both sides of the limit were exercised


def test_clip_grad_value_matches_torch():
    model = _model()
    tm = build_training_model(model, "cross_entropy", Momentum(lr=0.5, momentum=0.0), clip_grad_value=0.02)
    batches = _batches(20)
    ours, _, _ = _ours(tm, batches)
    theirs, _ = _torch(model, lambda net: torch.optim.SGD(net.parameters(), lr=0.5), batches,
                       after_backward=lambda net: torch.nn.utils.clip_grad_value_(net.parameters(), 0.02))
    assert _max_relative_error(ours, theirs) < 1e-10
    with pytest.raises(TrainingOpError, match="clip_grad_norm must be a finite number > 0"):
        build_training_model(model, "cross_entropy", Adam(), clip_grad_norm=-1)


@pytest.mark.parametrize("fast", [True, False])
def test_adamw_matches_torch_adamw(fast):
    model = _model()
    tm = build_training_model(model, "cross_entropy", AdamW(lr=1e-2, eps=0.0, weight_decay=0.1))
    batches = _batches(100)
    ours, _, session = _ours(tm, batches, fast)
    # the fast path folds the decay (X * (1 - lr*wd)) into its in-place Adam update
    assert session.fast_path_nodes == (["Adam node 'optimizer/Adam'"] if fast else [])
    theirs, _ = _torch(model, lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2, eps=0.0,
                                                            weight_decay=0.1), batches)
    assert _max_relative_error(ours, theirs) < 1e-6
    # the first-order approximation it replaces is measurably different
    approx, _, _ = _ours(build_training_model(model, "cross_entropy",
                                              Adam(lr=1e-2, eps=0.0, post_weight_decay=1e-3)), batches)
    assert _max_relative_error(ours, approx) > 1e-5


@pytest.mark.parametrize("build", ["groups_clip_adamw", "train_mode"])
def test_fast_path_and_full_graph_stay_bit_identical(build):
    if build == "train_mode":
        _, model = _dropout_bn_model()
        tm = build_training_model(model, "cross_entropy", AdamW(lr=1e-2), mode="train", clip_grad_norm=1.0)
        names = None
    else:
        tm = build_training_model(_model(np.float32), "cross_entropy", AdamW(lr=1e-2, weight_decay=0.1),
                                  clip_grad_norm=0.5, clip_grad_value=0.1,
                                  param_groups=[{"params": ["b*"], "weight_decay": 0.0}])
        names = NAMES
    sessions = [TrainingSession(tm, fast=f) for f in (True, False)]
    for s in sessions:
        s.set_lr_schedule(S.WarmupCosineLR(warmup_steps=2, total_steps=8))
    for k, (x, y) in enumerate(_batches(6, dtype=np.float32)):
        for s in sessions:
            if k % 2:
                s.backward({"input": x[:8], "labels": y[:8]}, scale=0.5)
                s.backward({"input": x[8:], "labels": y[8:]}, scale=0.5)
                s.optimizer_step()
            else:
                s.step({"input": x, "labels": y})
    fast, full = (s.state_dict() for s in sessions)
    for name in names or fast:
        np.testing.assert_array_equal(fast[name], full[name], err_msg=name)


# ------------------------------------------------------------------ properties, feeds

def test_properties_are_saved_atomically_with_the_checkpoint_and_restored(tmp_path):
    session = TrainingSession(build_training_model(_model(), "cross_entropy", Adam()))
    session.properties.update({"epoch": 3, "best_accuracy": 0.875, "run": "a", "resumable": True})
    path = session.save(tmp_path / "ckpt.onnx")
    restored = TrainingSession(path)
    assert restored.properties == {"epoch": 3, "best_accuracy": 0.875, "run": "a", "resumable": True}
    assert "onnx_training_ops.properties" not in {
        m.key for m in restored.export_inference_model().metadata_props}
    session.properties["bad"] = [1, 2]
    with pytest.raises(TrainingOpError, match=r"properties\['bad'\] must be a str, int, bool or finite float"):
        session.save(tmp_path / "ckpt.onnx")
    assert TrainingSession(path).properties["epoch"] == 3  # the earlier checkpoint is whole


def test_feeds_list_name_dtype_shape_and_optional():
    session = TrainingSession(build_training_model(_model(np.float32), "cross_entropy", Adam(),
                                                   param_groups=[{"params": ["b*"], "name": "biases"}]))
    feeds = {f.name: f for f in session.feeds}
    assert feeds["input"].dtype == np.float32 and feeds["input"].shape == (None, 8) and not feeds["input"].optional
    assert feeds["labels"].dtype == np.int64 and feeds["labels"].shape == (None,)
    assert feeds["learning_rate"].optional and feeds["learning_rate.biases"].optional
    assert feeds["learning_rate.biases"].shape == ()
    assert [f.name for f in session.eval_feeds()] == ["input", "labels"]
    assert [f.name for f in session.eval_feeds(outputs=["logits"])] == ["input", "labels"]


def test_rmsprop_accumulation_counts_optimizer_steps_and_matches_one_batch():
    """RMSProp has no domain node: T (a counter, read by no optimizer) still moves once per
    optimizer step, and k micro-batches equal one batch."""
    from onnx_training_ops import RMSProp

    tm = build_training_model(_model(), "cross_entropy", RMSProp(lr=1e-2, momentum=0.5, centered=True))
    whole, micro = TrainingSession(tm), TrainingSession(tm)
    for x, y in _batches(3, batch=32):
        whole.step({"input": x, "labels": y})
        for xs, ys in zip(np.split(x, 2), np.split(y, 2)):
            micro.backward({"input": xs, "labels": ys}, scale=0.5)
        micro.optimizer_step()
    a, b = whole.state_dict(), micro.state_dict()
    assert int(b["optimizer.T"]) == 3
    for n in NAMES:
        np.testing.assert_allclose(b[n], a[n], rtol=1e-12, atol=1e-14)
