"""export_step: the standard-op step model, its manifest and state, and the way back (Python side;
the JavaScript trainer is tested in test_export_js.py)."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnx_training_ops as ot
from onnx_training_ops import schedules
from onnx_training_ops.cli import main
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.export import export_step, load_state, read_state, session_from_export
from onnx_training_ops.export.ort_format import model_ops, read_config
from onnx_training_ops.storage import safetensors


def _model(**kwargs):
    return ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", kwargs.pop("optimizer", ot.Adam(lr=1e-2)),
                                   **kwargs)


def _batches(n=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 12, 8)).astype(np.float32)
    return [{"input": x[i], "labels": np.argmax(x[i, :, :4], -1).astype(np.int64)} for i in range(n)]


def test_step_model_is_standard_ops_with_plain_inputs(tmp_path):
    manifest = export_step(_model(clip_grad_norm=1.0), tmp_path)
    step = onnx.load(tmp_path / "step.onnx")
    onnx.checker.check_model(step, full_check=True)
    assert {n.domain for n in step.graph.node} == {""}
    assert [o.domain for o in step.opset_import] == [""]
    inputs = {vi.name for vi in step.graph.input}
    assert not inputs & {t.name for t in step.graph.initializer}, "no input has a stored default"
    state = [e["name"] for e in manifest["state"]]
    assert set(state) <= inputs and set(manifest["feedback"]) == set(state)
    assert set(manifest["feedback"].values()) <= {o.name for o in step.graph.output}
    assert manifest["returned"] == ["loss", "grad_norm"]
    assert manifest["inputs"] == [{"name": "input", "dtype": "float32", "shape": ["N", 8]},
                                  {"name": "labels", "dtype": "int64", "shape": ["N"]}]
    [rate] = manifest["learning_rates"]
    assert rate["name"] == "learning_rate" and rate["base"] == float(np.float32(1e-2)) and rate["name"] in inputs
    roles = {e["name"]: e["role"] for e in manifest["state"]}
    assert roles["W0"] == "parameter" and roles["W0.V"] == "optimizer" and roles[manifest["counter"]] == "counter"
    step_ops = {n.op_type for n in step.graph.node}
    assert manifest["files"]["step"]["operators"] == sorted(f"ai.onnx:{op}" for op in step_ops)


def test_step_model_steps_like_training_session_bit_for_bit(tmp_path):
    model = _model(optimizer=ot.AdamW(lr=1e-2, weight_decay=0.1), clip_grad_norm=0.5)
    export_step(model, tmp_path)
    reference = ot.TrainingSession(model)
    exported = session_from_export(tmp_path, fast=False)
    for batch in _batches():
        expected = reference.step(batch)
        got = exported.step({**batch, "learning_rate": np.array(1e-2, np.float32)})
        assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    mine = exported.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)


def test_plain_onnxruntime_feeds_the_learning_rate(tmp_path):
    """The learning rate is a plain input: a fed 0 freezes the weights (onnxruntime ignores a
    value fed to an input that has a stored default)."""
    manifest = export_step(_model(), tmp_path)
    session = ort.InferenceSession(str(tmp_path / "step.onnx"))
    state, _ = read_state(tmp_path)
    feeds = {**_batches(1)[0], **state, "learning_rate": np.array(0.0, np.float32)}
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_array_equal(out[manifest["feedback"]["W0"]], state["W0"])
    feeds["learning_rate"] = np.array(0.1, np.float32)
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert not np.array_equal(out[manifest["feedback"]["W0"]], state["W0"])


@pytest.mark.parametrize("source", ["directory", "file"])
def test_import_continues_bit_exact_with_the_schedule(tmp_path, source):
    """A mid-run export loaded into a fresh session continues exactly as the session would have."""
    batches = _batches(10)
    model = _model()
    schedule = schedules.WarmupCosineLR(warmup_steps=3, total_steps=10)
    reference = ot.TrainingSession(model)
    reference.set_lr_schedule(schedule)
    for batch in batches[:5]:
        reference.step(batch)
    manifest = export_step(reference, tmp_path / "export")
    assert manifest["schedule"]["step_offset"] == 0 and manifest["schedule"]["type"] == "WarmupCosineLR"
    resumed = ot.TrainingSession(model)
    resumed.set_lr_schedule(schedule)
    load_state(resumed, tmp_path / "export" if source == "directory" else tmp_path / "export" / "state.safetensors")
    assert resumed.lr_schedule_step == 5
    for batch in batches[5:]:
        assert resumed.step(batch)["loss"] == reference.step(batch)["loss"]
    for name, value in reference.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)


def test_a_from_graph_session_exports_its_step_alone(tmp_path):
    """An exported step, opened as a TrainingSession (from_graph) and exported again: no loss
    and no main-graph outputs, so no eval or inference model; the same step."""
    export_step(_model(), tmp_path / "first")
    session = session_from_export(tmp_path / "first")
    manifest = export_step(session, tmp_path / "second")
    assert set(manifest["files"]) == {"step", "state"} and manifest["eval_outputs"] == []
    assert "learning_rate" in [e["name"] for e in manifest["inputs"]]  # a plain data input here
    feeds = {**_batches(1)[0], "learning_rate": np.array(1e-2, np.float32)}
    again = session_from_export(tmp_path / "second")
    assert again.step(feeds)["loss"] == session.step(feeds)["loss"]


def test_load_state_names_what_does_not_fit(tmp_path):
    export_step(_model(), tmp_path)
    other = ot.TrainingSession(ot.build_training_model(make_mlp((8, 16, 5)), "cross_entropy", ot.Adam()))
    with pytest.raises(TrainingOpError, match=r"'W1' has shape \[16, 5\], found \[16, 4\]"):
        load_state(other, tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "onnx-training-ops/export", "version": 99}))
    with pytest.raises(TrainingOpError, match="manifest version 99"):
        read_state(tmp_path)


def test_safetensors_agree_with_the_reference_implementation():
    from safetensors import numpy as st  # the reference implementation (installed with transformers)

    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((3, 5)).astype(np.float32), "T": np.array(7, np.int64),
               "d": rng.standard_normal(4), "mask": np.array([True, False]), "h": np.arange(3, dtype=np.float16),
               "é": np.zeros((0, 2), np.int32)}
    ours = safetensors.encode(tensors, {"format": "x"})
    for name, value in st.load(ours).items():
        np.testing.assert_array_equal(value, tensors[name])
        assert value.dtype == tensors[name].dtype
    decoded, metadata = safetensors.decode(st.save(tensors, {"format": "y"}))
    assert metadata == {"format": "y"}
    for name, value in decoded.items():
        np.testing.assert_array_equal(value, tensors[name])
    assert safetensors.encode(decoded) == safetensors.encode(tensors), "the layout depends on the tensors alone"


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:5], "not a safetensors file"),
    (lambda b: b[:-1], r"tensor .b.: F32 \[3\] needs 12 bytes.*holds 19 bytes"),
    (lambda b: b + b"\0", "1 bytes after the last tensor"),
    (lambda b: b.replace(b'"data_offsets":[0,8]', b'"data_offsets":[4,12]'), "does not|starts at|needs"),
    (lambda b: b[:8] + b"[" + b[9:], "not JSON|not a JSON object"),
])
def test_damaged_safetensors_are_named(damage, message):
    data = safetensors.encode({"a": np.arange(2, dtype=np.float32), "b": np.arange(3, dtype=np.float32)})
    with pytest.raises(TrainingOpError, match=message):
        safetensors.decode(damage(data))


def test_inference_model_reads_the_state_once(tmp_path):
    """inference.onnx holds no weights: it reads them from state.safetensors by offset."""
    session = ot.TrainingSession(_model())
    for batch in _batches(3):
        session.step(batch)
    export_step(session, tmp_path)
    inference = onnx.load(tmp_path / "inference.onnx", load_external_data=False)
    weights = [t for t in inference.graph.initializer if t.name in session.state_names]
    assert weights and all(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in weights)
    x = _batches(1, seed=3)[0]["input"]
    got = ort.InferenceSession(str(tmp_path / "inference.onnx")).run(None, {"input": x})[0]
    np.testing.assert_array_equal(got, session.run(None, {"input": x})[0])


def test_exported_files_store_each_tensor_once(tmp_path):
    """No tensor is written twice: the graphs hold no state, the state file holds it once. What
    the files add is graph structure (the expanded gradient's nodes, the manifest): about 5 KB
    here, 0.6% of this training model (docs/export.md has the sizes of the test models)."""
    model = ot.build_training_model(make_mlp((256, 256, 10)), "cross_entropy", ot.Adam())
    export_step(model, tmp_path)
    state_bytes = sum(t.ByteSize() for t in model.graph.initializer)
    for name in ("step.onnx", "eval.onnx"):
        initializers = onnx.load(tmp_path / name).graph.initializer
        # what is left: small int64 constants (the flat optimizer's slice bounds and shapes), no state
        assert all(t.data_type == onnx.TensorProto.INT64 and np.prod(t.dims) <= 8 for t in initializers)
        assert sum(t.ByteSize() for t in initializers) < 600 * len(model.graph.initializer)
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert (tmp_path / "state.safetensors").stat().st_size < state_bytes * 3 + 4096  # P, V, H once each
    assert total <= 1.01 * len(model.SerializeToString())


def test_train_mode_eval_model_uses_running_statistics(tmp_path):
    """mode="train": the step updates BatchNorm's running statistics (state, role buffer); the
    eval model reads them, as TrainingSession.evaluate does."""
    import js_fixtures

    training, batches, _ = js_fixtures.MODELS["cnn"](np.random.default_rng(1))
    session = ot.TrainingSession(training)
    batch = {k: v[0] for k, v in batches.items()}
    session.step(batch)
    manifest = export_step(session, tmp_path)
    roles = {e["name"]: e["role"] for e in manifest["state"]}
    assert roles["bn.mean"] == roles["bn.var"] == "buffer"
    evaluation = ort.InferenceSession(str(tmp_path / "eval.onnx"))
    state, _ = read_state(tmp_path)
    feeds = {**batch, **{i.name: state[i.name] for i in evaluation.get_inputs() if i.name in state}}
    loss = evaluation.run(["loss"], feeds)[0]
    assert loss == session.evaluate(batch)["loss"]


def test_cli_export_step_with_ort_format(tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint.onnx"
    session = ot.TrainingSession(_model())
    session.step(_batches(1)[0])
    session.save(checkpoint)
    assert main(["export-step", str(checkpoint), str(tmp_path / "out"), "--ort"]) == 0
    assert "step.ort" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["files"]["step_ort"]["path"] == "step.ort"
    for entry in manifest["files"].values():  # every file's digest, by hashlib
        assert entry["sha256"] == hashlib.sha256((tmp_path / "out" / entry["path"]).read_bytes()).hexdigest()
    config = read_config((tmp_path / "out" / "required_operators.config").read_text())
    step = onnx.load(tmp_path / "out" / "step.onnx")
    for domain, versions in model_ops(step).items():
        for opset, ops in versions.items():
            assert ops <= config[domain][opset], (domain, opset, ops - config[domain][opset])
    # the ORT-format step runs and computes what the ONNX one does
    state, _ = read_state(tmp_path / "out")
    feeds = {**_batches(1, seed=5)[0], **state, "learning_rate": np.array(1e-2, np.float32)}
    expected = ort.InferenceSession(str(tmp_path / "out" / "step.onnx")).run(None, feeds)
    got = ort.InferenceSession(str(tmp_path / "out" / "step.ort")).run(None, feeds)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_cli_export_step_errors(tmp_path, capsys):
    plain = tmp_path / "plain.onnx"
    onnx.save(make_mlp((4, 3)), plain)
    assert main(["export-step", str(plain), str(tmp_path / "out")]) == 2
    assert re.search(r"one training_info .* found 0", capsys.readouterr().err)


def test_packed_step_is_the_same_step(tmp_path):
    """step.packed.onnx: the state in one input and one output per dtype; the same numbers."""
    manifest = export_step(_model(clip_grad_norm=1.0), tmp_path, packed=True)
    [floats, ints] = manifest["packs"]
    assert (floats["dtype"], ints["dtype"]) == ("float32", "int64") and ints["members"][0]["name"] == "optimizer.T"
    packed_step = onnx.load(tmp_path / "step.packed.onnx")
    assert [vi.name for vi in packed_step.graph.input] == ["input", "labels", "learning_rate", "state.float32",
                                                           "state.int64"]
    plain, packed = session_from_export(tmp_path, fast=False), session_from_export(tmp_path, packed=True, fast=False)
    for batch in _batches(4):
        feeds = {**batch, "learning_rate": np.array(1e-2, np.float32)}
        a, b = plain.step(feeds), packed.step(feeds)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    flat = packed.state_dict()["state.float32"]
    for member in floats["members"]:
        value = plain.state_dict()[member["name"]]
        np.testing.assert_array_equal(flat[member["offset"]:member["offset"] + value.size].reshape(value.shape), value)
