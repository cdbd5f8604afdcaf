"""DeviceTrainer: an export trained with its state resident on the execution device (OrtValues),
checked on the CPU against TrainingSession (bit for bit: the same step graph in onnxruntime).
tests/test_gpu.py runs the same trainer on CUDA where onnxruntime-gpu and a GPU are present."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import onnx_training_ops as ot
from onnx_training_ops import schedules
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.export import DeviceTrainer, export_step, load_state, session_from_export
from onnx_training_ops.training.graphs.static_shapes import static_step


def _model(optimizer=None, **kwargs):
    return ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy",
                                   optimizer or ot.AdamW(lr=1e-2, weight_decay=0.1), **kwargs)


def _batches(n=6, seed=0, rows=12):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, rows, 8)).astype(np.float32)
    return [{"input": x[i], "labels": np.argmax(x[i, :, :4], -1).astype(np.int64)} for i in range(n)]


def test_steps_equal_training_session_bit_for_bit_and_state_stays_on_the_device(tmp_path):
    model = _model(clip_grad_norm=0.5)
    export_step(model, tmp_path)
    reference = ot.TrainingSession(model)
    trainer = DeviceTrainer(tmp_path)
    assert trainer.providers == ["CPUExecutionProvider"]
    for batch in _batches():
        expected = reference.step(batch)
        got = trainer.step(batch)
        assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    mine = trainer.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)
    counter = trainer.manifest["counter"]
    assert int(mine[counter].reshape(-1)[0]) == 6 and trainer.schedule_step == 6


def test_evaluate_reads_the_current_state_and_changes_nothing(tmp_path):
    model = _model()
    export_step(model, tmp_path)
    reference = ot.TrainingSession(model)
    trainer = DeviceTrainer(tmp_path)
    batches = _batches(3)
    for batch in batches[:2]:
        reference.step(batch)
        trainer.step(batch)
    before = trainer.state_dict()
    for rows in (12, 5, 12):  # any batch size, any order
        batch = _batches(1, seed=rows, rows=rows)[0]
        got = trainer.evaluate(batch)
        fresh = ot.TrainingSession(model)  # the reference at this batch size, with the same state
        fresh.load_state_dict(reference.state_dict())
        expected = fresh.evaluate(batch)
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6)
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nonfinite_loss_keeps_the_old_state(tmp_path, policy):
    export_step(_model(), tmp_path)
    trainer = DeviceTrainer(tmp_path, on_nonfinite=policy)
    good, bad = _batches(2)
    trainer.step(good)
    before = trainer.state_dict()
    bad = {**bad, "input": np.full_like(bad["input"], np.nan)}
    if policy == "raise":
        with pytest.raises(ot.NonFiniteLossError):
            trainer.step(bad)
    else:
        assert np.isnan(trainer.step(bad)["loss"])
        assert trainer.skipped_steps == 1
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    trainer.step(good)  # and training goes on from the kept state
    reference = DeviceTrainer(tmp_path)
    reference.step(good)
    reference.step(good)
    for name, value in reference.state_dict().items():
        np.testing.assert_array_equal(trainer.state_dict()[name], value, err_msg=name)


def test_saved_state_resumes_in_a_training_session_bit_exact(tmp_path):
    export_step(_model(), tmp_path / "export")
    trainer = DeviceTrainer(tmp_path / "export")
    batches = _batches(4)
    for batch in batches[:2]:
        trainer.step(batch)
    trainer.save_state(tmp_path / "mid.safetensors")
    session = session_from_export(tmp_path / "export")
    load_state(session, tmp_path / "mid.safetensors")
    rate = {"learning_rate": np.array(1e-2, np.float32)}
    for batch in batches[2:]:
        assert session.step({**batch, **rate})["loss"] == trainer.step(batch)["loss"]


def test_schedule_of_the_export_drives_the_rates_like_the_session(tmp_path):
    model = _model()
    session = ot.TrainingSession(model)
    session.set_lr_schedule(schedules.StepLR(step_size=2, gamma=0.5))
    session.save(tmp_path / "ckpt.onnx")
    export_step(str(tmp_path / "ckpt.onnx"), tmp_path / "export")
    trainer = DeviceTrainer(tmp_path / "export")
    rates = []
    for batch in _batches(5):
        rates.append(trainer.learning_rates()["learning_rate"])
        # the session's native cross-entropy kernel may round the loss 1 ulp apart from the standard ops
        np.testing.assert_allclose(trainer.step(batch)["loss"], session.step(batch)["loss"], rtol=2e-6)
    assert rates == pytest.approx([1e-2, 1e-2, 5e-3, 5e-3, 2.5e-3])


def test_load_state_dict_is_checked_and_changes_nothing_on_error(tmp_path):
    export_step(_model(), tmp_path)
    trainer = DeviceTrainer(tmp_path)
    state = trainer.state_dict()
    with pytest.raises(TrainingOpError, match="missing"):
        trainer.load_state_dict({k: v for k, v in state.items() if k != "W0"})
    with pytest.raises(TrainingOpError, match="'W0' must be float32"):
        trainer.load_state_dict({**state, "W0": state["W0"].astype(np.float64)})
    trainer.step(_batches(1)[0])
    after = trainer.state_dict()
    trainer.load_state_dict(state)  # back to the start: the same first step again
    trainer.step(_batches(1)[0])
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, after[name])


def test_bad_feeds_and_rates_are_clear_errors(tmp_path):
    export_step(_model(), tmp_path)
    trainer = DeviceTrainer(tmp_path)
    batch = _batches(1)[0]
    with pytest.raises(TrainingOpError, match="'labels' is missing"):
        trainer.step({"input": batch["input"]})
    with pytest.raises(TrainingOpError, match="'input' must be a float32 array, found float64"):
        trainer.step({**batch, "input": batch["input"].astype(np.float64)})
    with pytest.raises(TrainingOpError, match=r"'input' must have shape \['N', 8\]"):
        trainer.step({**batch, "input": batch["input"][:, :5]})
    with pytest.raises(TrainingOpError, match="unknown input"):
        trainer.step({**batch, "extra": batch["labels"]})
    for lr in (float("nan"), -1.0, "abc"):
        with pytest.raises(TrainingOpError, match="'learning_rate' must be (finite and >= 0|a real number)"):
            trainer.step(batch, lr=lr)
    with pytest.raises(TrainingOpError, match="must be a mapping"):
        trainer.step(None)


def test_labels_are_checked_against_the_class_count_when_the_manifest_records_it(tmp_path):
    export_step(_model(), tmp_path)
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(classes=4, ignore_index=None)
    path.write_text(json.dumps(manifest))
    trainer = DeviceTrainer(tmp_path, **({"verify": False} if "verify" in DeviceTrainer.__init__.__code__.co_varnames
                                         else {}))
    batch = _batches(1)[0]
    for label in (4, -1, 99):
        labels = batch["labels"].copy()
        labels[3] = label
        with pytest.raises(TrainingOpError, match=rf"feed 'labels' holds class {label}, outside \[0, 4\)"):
            trainer.step({**batch, "labels": labels})


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="onnxruntime-gpu is installed")
def test_a_missing_provider_is_an_error_not_a_cpu_run(tmp_path):
    export_step(_model(), tmp_path)
    with pytest.raises(TrainingOpError, match="not available"):
        DeviceTrainer(tmp_path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


@pytest.mark.parametrize("flat", [False, True])
def test_in_place_state_equals_two_sets_bit_for_bit_and_keeps_the_state_on_a_nan_loss(tmp_path, flat):
    export_step(_model(clip_grad_norm=0.5), tmp_path, flat_optimizer=flat)
    in_place = DeviceTrainer(tmp_path, on_nonfinite="skip")
    two_sets = DeviceTrainer(tmp_path, on_nonfinite="skip", in_place=False)
    assert in_place.in_place and not two_sets.in_place and in_place.session._store.memory.spares == 0
    batches = _batches(5)
    batches[2] = {**batches[2], "input": np.full_like(batches[2]["input"], np.inf)}
    for batch in batches:
        got, want = in_place.step(batch), two_sets.step(batch)
        np.testing.assert_array_equal(got["loss"], want["loss"])
    assert in_place.skipped_steps == two_sets.skipped_steps == 1
    want = two_sets.state_dict()
    for name, value in in_place.state_dict().items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    with pytest.raises(ot.NonFiniteLossError):  # raise: the guarded in-place write kept the state too
        DeviceTrainer(tmp_path).step(batches[2])


def test_in_place_refuses_a_state_read_after_its_new_value_is_written():
    from onnx import TensorProto, helper

    from onnx_training_ops.passes.guard_feedback import in_place_unsafe

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [3])
    nodes = [helper.make_node("Reshape", ["X", "shape"], ["X_view"]),  # may alias X
             helper.make_node("Neg", ["X"], ["X_new"]),
             helper.make_node("Abs", ["X_view"], ["late"])]  # reads X through the view, not before X_new
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3])
                                                for n in ("X_new", "late")],
                              [helper.make_tensor("shape", TensorProto.INT64, [1], [3])])
    model = helper.make_model(graph)
    assert in_place_unsafe(model, {"X": "X_new"}) == ["X"]
    model.graph.node[1].input[0] = "late"  # now every read of X comes before X_new is written
    assert in_place_unsafe(model, {"X": "X_new"}) == []


def test_static_input_shapes_fold_the_shape_arithmetic_and_train_the_same(tmp_path):
    """With the batch shape fixed, the step's Shape/Size arithmetic is folded at load (on a GPU: no
    host round trip for it); the losses and state are those of the dynamic step."""
    import onnx

    from benchmarks import zoo
    from benchmarks.model_runners import training_model

    spec = zoo.spec("gpt2", layers=1, hidden=32, heads=2, vocab=64, batch=2, seq=8)
    export_step(training_model(spec, str(tmp_path / "zoo")), tmp_path / "export")
    shapes = {"input_ids": [2, 8], "attention_mask": [2, 8], "labels": [2, 8]}
    fixed = DeviceTrainer(tmp_path / "export", input_shapes=shapes)
    dynamic = DeviceTrainer(tmp_path / "export")
    step = onnx.load(tmp_path / "export" / "step.onnx")
    data = [vi.name for vi in step.graph.input if vi.name in shapes]
    folded = static_step(step, data, shapes, "test")
    count = lambda m: sum(n.op_type in ("Shape", "Size") for n in m.graph.node)  # noqa: E731
    assert count(step) > 0 and count(folded) == 0
    batches = zoo.batches(spec, 3)
    for batch in batches:
        np.testing.assert_allclose(fixed.step(batch)["loss"], dynamic.step(batch)["loss"], rtol=1e-6)
    want = dynamic.state_dict()
    for name, value in fixed.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    other = {k: np.concatenate([v, v]) for k, v in batches[0].items()}  # batch 4, not 2
    with pytest.raises(TrainingOpError, match=r"'input_ids' must have shape \[2, 8\]"):
        fixed.step(other)
    with pytest.raises(TrainingOpError, match=r"input_shapes\['input_ids'\] is \[2\]"):
        DeviceTrainer(tmp_path / "export", input_shapes={**shapes, "input_ids": [2]})


def test_in_place_falls_back_to_two_sets_where_an_update_may_run_before_a_read(tmp_path):
    """Per-tensor updates without clipping: W1's update depends only on W1's gradient, while the
    gradient flowing to W0 still reads W1, so onnxruntime may write W1 first. With the loss
    guard, the guard's condition waits for those reads (passes/order_writes.py): in place.
    Without a guard (on_nonfinite="ignore") nothing orders them: the trainer keeps two sets.
    One flat optimizer node reads every gradient: in place either way."""
    model = ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.Adam(lr=1e-2))
    export_step(model, tmp_path / "per_tensor")
    export_step(model, tmp_path / "flat", flat_optimizer=True)
    assert DeviceTrainer(tmp_path / "per_tensor").in_place
    assert not DeviceTrainer(tmp_path / "per_tensor", on_nonfinite="ignore").in_place
    with pytest.raises(TrainingOpError, match="in_place=True, but the step model may read"):
        DeviceTrainer(tmp_path / "per_tensor", on_nonfinite="ignore", in_place=True)
    assert DeviceTrainer(tmp_path / "flat").in_place
    assert DeviceTrainer(tmp_path / "flat", on_nonfinite="ignore").in_place


def test_open_export_is_a_training_session_on_the_one_engine(tmp_path):
    """issue 37 item 2: an export opens as a TrainingSession (its update in the graph), with
    the export's rates, schedule, label checks and eval model; it saves a training model that
    reopens anywhere, and DeviceTrainer is a thin alias over it."""
    from onnx_training_ops.export import open_export

    model = _model(clip_grad_norm=0.5)
    reference = ot.TrainingSession(model)
    reference.set_lr_schedule(schedules.StepLR(step_size=1, gamma=0.5))
    reference.step(_batches(1, seed=7)[0])
    export_step(reference, tmp_path / "export")
    session = open_export(tmp_path / "export")
    assert isinstance(session, ot.TrainingSession) and session.device == "cpu" and not session.fast
    assert session.learning_rate_names == ["learning_rate"] and session.lr_schedule_step == 1
    assert session.learning_rates == reference.learning_rates
    for batch in _batches(3):  # the host session's native loss kernel may round the loss 1 ulp apart
        np.testing.assert_allclose(session.step(batch)["loss"], reference.step(batch)["loss"], rtol=1e-6)
    _same = lambda a, b: all(np.array_equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())  # noqa: E731
    assert _same(session, reference) and session.lr_schedule_step == reference.lr_schedule_step == 4
    batch = _batches(1, seed=5, rows=7)[0]
    got = session.evaluate(batch, outputs=["logits"])
    want = reference.evaluate(batch, outputs=["logits"])
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-6)
    (live,) = session.state_views(["W0"])  # host arrays on the CPU: live views
    assert np.shares_memory(live, session.get_flat_parameters(copy=False))
    with pytest.raises(TrainingOpError, match="labels"):
        session.step({**_batches(1)[0], "labels": np.full(12, 9)})
    reopened = ot.TrainingSession(session.save(tmp_path / "ckpt.onnx"))
    assert reopened.lr_schedule_step == 4
    batch = _batches(1, seed=11)[0]
    np.testing.assert_array_equal(reopened.step(batch)["loss"], session.step(batch)["loss"])
    trainer = DeviceTrainer(tmp_path / "export")
    assert isinstance(trainer.session, ot.TrainingSession) and trainer.schedule_step == 1
