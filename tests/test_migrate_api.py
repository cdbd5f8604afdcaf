"""onnxruntime-training's on-device API, call by call, against what it did (docs/migrating.md).

Each test checks one row of the migration table against the value onnxruntime-training 1.19.2
itself produced when the fixtures were made.
"""

from __future__ import annotations

import numpy as np
import pytest
from ortt_fixtures import ORTT, batch, params, trajectory

import onnx_training_ops as ot
from onnx_training_ops.schedules import WarmupLinearLR


def _session(case: str = "mlp", checkpoint: str = "checkpoint_10", lr: float | None = None) -> ot.TrainingSession:
    return ot.TrainingSession(ot.import_onnxruntime_training(ORTT / case, checkpoint=checkpoint,
                                                             lr=float(trajectory(case)["lr"]) if lr is None else lr))


def test_linear_lr_scheduler_is_warmup_linear_with_its_two_counts_swapped():
    """``LinearLRScheduler(optimizer, warmup_step_count=3, total_step_count=10, initial_lr=0.01)``:
    its 1.19.2 Python binding declares (total, warmup) and receives (warmup, total), so it warms
    up over 10 steps and is 0 from step 10 on; WarmupLinearLR(10, 3, allow_warmup_past_total=True) is what
    it does."""
    theirs = trajectory("mlp")["linear_lr_schedule"]
    session = _session(checkpoint="checkpoint", lr=0.01)
    session.set_lr_schedule(WarmupLinearLR(warmup_steps=10, total_steps=3, allow_warmup_past_total=True))
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


# ---------------------------------------------------------------- additional outputs


def test_step_returns_extra_outputs_of_the_same_run_as_additional_output_names():
    """Their mlp artifacts were generated with ``additional_output_names=["logits"]``: step 10's
    ``module(x, y)`` returned (loss, logits). ``step(feeds, outputs=["logits"])`` returns them."""
    t = trajectory("mlp")
    session = _session()
    x, y = batch("mlp", 10)
    before = session.evaluate({"input": x, "labels": y}, outputs=["logits"])
    out = session.step({"input": x, "labels": y}, outputs=["logits"])
    assert np.array_equal(out["logits"], before["logits"])  # computed before the update
    assert np.array_equal(out["loss"], before["loss"])
    np.testing.assert_allclose(out["logits"], t["extra_output_step10"], rtol=1e-5, atol=1e-6)
    after = session.step({"input": x, "labels": y}, outputs=["logits", "/1/Relu_output_0"])
    assert after["/1/Relu_output_0"].shape == (8, 16) and not np.array_equal(after["logits"], out["logits"])
    plain = session.step({"input": x, "labels": y})
    assert set(plain) == {"loss"}


def test_step_outputs_follow_the_same_trajectory_as_plain_steps():
    plain, extra = _session(), _session()
    for k in range(10, 14):
        feeds = dict(zip(["input", "labels"], batch("mlp", k)))
        a, b = plain.step(feeds), extra.step(feeds, outputs=["logits"])
        assert np.array_equal(a["loss"], b["loss"])
    for name, value in plain.state_dict().items():
        assert np.array_equal(value, extra.state_dict()[name]), name


def test_step_outputs_name_an_unknown_value():
    with pytest.raises(ot.TrainingOpError, match=r"step\(outputs=\.\.\.\): 'nope' is not a value of the model"):
        _session().step(dict(zip(["input", "labels"], batch("mlp", 10))), outputs=["nope"])


# ---------------------------------------------------------------- the flat parameter vector


@pytest.mark.parametrize("case", ["mlp", "bert"])
def test_flat_parameters_equal_get_contiguous_parameters(case):
    t = trajectory(case)
    session = _session(case)
    assert session.parameters_size() == int(t["size_trainable"])
    assert session.parameters_size(trainable_only=False) == int(t["size_all"])
    assert np.array_equal(session.get_flat_parameters(), t["flat_trainable_10"])
    assert np.array_equal(session.get_flat_parameters(trainable_only=False), t["flat_all_10"])


def test_the_live_vector_is_the_parameters_without_a_copy():
    session = _session()
    live = session.get_flat_parameters(copy=False)
    assert np.array_equal(live, trajectory("mlp")["flat_trainable_10"])
    live[0] = 42.0  # the parameters themselves
    assert session.state_dict()["0.weight"].reshape(-1)[0] == 42.0
    session.step(dict(zip(["input", "labels"], batch("mlp", 10))))
    assert np.shares_memory(live, session.state_views(["2.bias"])[0])
    with pytest.raises(ot.TrainingOpError, match="frozen parameters are constants of the model"):
        _session("bert").get_flat_parameters(trainable_only=False, copy=False)


def test_loading_their_vector_gives_their_parameters_and_frozen_ones_reopen_the_session():
    t = trajectory("bert")
    session = _session("bert", checkpoint="checkpoint")
    session.load_flat_parameters(t["flat_trainable_10"])
    for name, value in params("bert", 10).items():
        assert np.array_equal(session.state_dict()[name], value), name
    ids, mask, y = batch("bert", 10)
    feeds = {"input_ids": ids, "attention_mask": mask, "labels": y}
    loss = session.evaluate(feeds)["loss"]
    changed = t["flat_all_10"].copy()
    everything = params("bert", 10, trainable_only=False)  # in their (declaration) order
    offset = sum(v.size for v in list(everything.values())[:list(everything).index(
        "bert.embeddings.position_embeddings.weight")])
    changed[offset:offset + 64] += 0.5  # the frozen position embeddings
    session.load_flat_parameters(changed, trainable_only=False)
    assert np.array_equal(session.get_flat_parameters(trainable_only=False), changed)
    assert session.evaluate(feeds)["loss"] != loss
    assert int(session.state_dict()["optimizer.T"]) == 0  # the state survived the reopening


def test_federated_averaging_of_two_sessions():
    a, b = _session(), _session(checkpoint="checkpoint")
    mean = (a.get_flat_parameters() + b.get_flat_parameters()) / 2
    a.load_flat_parameters(mean)
    b.load_flat_parameters(mean)
    assert np.array_equal(a.get_flat_parameters(), b.get_flat_parameters())


def test_a_vector_of_the_wrong_size_or_dtype_is_named():
    session = _session()
    with pytest.raises(ot.TrainingOpError, match=r"expected a 1-D float32 vector of 212 elements \(4 "
                                                  r"parameters\), found float32 of shape \[211\]"):
        session.load_flat_parameters(np.zeros(211, np.float32))
    with pytest.raises(ot.TrainingOpError, match="found float64"):
        session.load_flat_parameters(np.zeros(212))


# ---------------------------------------------------------------- export


def test_export_with_outputs_is_export_model_for_inferencing(tmp_path):
    t = trajectory("mlp")
    session = _session()
    for k in range(10, 20):
        session.step(dict(zip(["input", "labels"], batch("mlp", k))))
    model = session.export_inference_model(tmp_path / "infer.onnx", outputs=["logits"])
    assert [i.name for i in model.graph.input] == list(t["exported_inputs"])
    assert [o.name for o in model.graph.output] == ["logits"]
    import onnxruntime as ort
    logits = ort.InferenceSession(str(tmp_path / "infer.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input": batch("mlp", 0)[0]})[0]
    np.testing.assert_allclose(logits, t["exported_logits_batch0"], rtol=1e-5, atol=1e-6)
    hidden = session.export_inference_model(outputs=["/1/Relu_output_0"])
    assert [n.op_type for n in hidden.graph.node] == ["Gemm", "Relu"]
    assert {i.name for i in hidden.graph.initializer} == {"0.weight", "0.bias"}


# ---------------------------------------------------------------- nominal checkpoints


def test_a_nominal_checkpoint_has_shapes_no_values_and_trains_once_filled(tmp_path):
    t = trajectory("bert")
    session = _session("bert")
    path = tmp_path / "nominal.onnx"
    session.save(path, nominal=True)
    import onnx
    saved = onnx.load(str(path))
    tensors = {t_.name: t_ for t_ in (*saved.graph.initializer, *saved.training_info[0].algorithm.initializer)}
    emptied = set(session.state_names) | set(params("bert", 10, trainable_only=False))
    assert len(emptied) == 3 * 24 + 1 + 1  # parameters, V, H; T; the frozen position embeddings
    for name in emptied:
        assert list(tensors[name].dims) == list(session.state_dict().get(name, params("bert", 10, False)
                                                                         .get(name)).shape)
        assert not (tensors[name].raw_data or tensors[name].float_data or tensors[name].int64_data), name
    device = ot.TrainingSession(str(path))
    assert device.nominal
    ids, mask, y = batch("bert", 10)
    feeds = {"input_ids": ids, "attention_mask": mask, "labels": y}
    with pytest.raises(ot.TrainingOpError, match="opened from a nominal checkpoint and 25 parameter"):
        device.step(feeds)
    device.load_flat_parameters(t["flat_all_10"], trainable_only=False)
    assert not device.nominal
    reference = _session("bert")
    reference.initialize()  # their parameters after 10 steps, a fresh optimizer
    for k in range(10, 13):
        f = dict(zip(["input_ids", "attention_mask", "labels"], batch("bert", k)))
        assert np.array_equal(device.step(f)["loss"], reference.step(f)["loss"])


def test_their_nominal_checkpoint_imports_as_a_nominal_model_with_a_warning():
    t = trajectory("mlp")
    with pytest.warns(UserWarning, match=r"nominal_checkpoint: a nominal checkpoint: .* only the names and "
                                         r"types of 4 parameters, no values"):
        model = ot.import_onnxruntime_training(ORTT / "mlp", checkpoint="nominal_checkpoint", lr=0.01)
    device = ot.TrainingSession(model)
    assert device.nominal and device.parameters_size(trainable_only=False) == int(t["size_all"])
    device.load_flat_parameters(t["flat_all_10"], trainable_only=False)
    fresh = _session(checkpoint="checkpoint_10_no_opt")
    for k in range(10, 13):
        feeds = dict(zip(["input", "labels"], batch("mlp", k)))
        assert np.array_equal(device.step(feeds)["loss"], fresh.step(feeds)["loss"])
