"""export_step of a model past protobuf's 2 GB (issue 36 E): the exported models keep their big
constants (frozen weights) in one ``constants.data`` read as ONNX external data, written once,
as a checkpoint's data file; nothing goes through a whole serialized message. The thresholds are
forced down here (a model with a few KB of frozen weights takes the path a 2 GB one takes); a real
run past 2 GB (three 720 MB frozen weights) is in the report of the change, not in the suite."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_training_ops as ot
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.export import export_step, session_from_export, writer
from onnx_training_ops.storage import as_model, safetensors, tensors

FROZEN = ("W0", "W1")  # 4 KB and 8 KB: detached (>= 1 KB) once the model counts as large


def _force(monkeypatch):
    """The large-model and external-data thresholds below this model's size."""
    monkeypatch.delenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", raising=False)
    monkeypatch.setattr(tensors, "LARGE_MODEL_BYTES", 1024)
    monkeypatch.setattr(writer, "EXTERNAL_BYTES", 1024)


@pytest.fixture
def past_2gb(monkeypatch):
    _force(monkeypatch)


def _session():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("W0", (16, 64)), ("W1", (64, 32)), ("head", (32, 4)), ("bias", (4,)))]
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h0"]), helper.make_node("Relu", ["h0"], ["r0"]),
             helper.make_node("MatMul", ["r0", "W1"], ["h1"]), helper.make_node("Tanh", ["h1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "head"], ["h2"]), helper.make_node("Add", ["h2", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "frozen_base", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    training = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2, weight_decay=0.1),
                                       trainable=["head", "bias"])
    return ot.TrainingSession(training)


def _batch(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    return {"x": x, "labels": rng.integers(0, 4, 8).astype(np.int64)}


def test_a_model_past_2gb_exports_its_frozen_weights_once_in_constants_data(tmp_path, monkeypatch):
    small = _session()  # every tensor inline: the reference
    small.step(_batch(0))
    export_step(small, tmp_path / "inline", packed=True)
    _force(monkeypatch)
    session = _session()
    session.step(_batch(0))
    manifest = export_step(session, tmp_path / "external", packed=True)
    out = tmp_path / "external"
    files = manifest["files"]
    assert files["constants"]["path"] == "constants.data"
    models = ("step", "step_packed", "eval", "inference")
    assert all(files[k]["constants"] == "constants.data" for k in models)
    data = (out / "constants.data").read_bytes()
    frozen_values = _frozen_values(session)
    for kind in models:
        model = onnx.load(out / files[kind]["path"], load_external_data=False)
        frozen = {t.name: t for t in model.graph.initializer if t.name in FROZEN}
        assert set(frozen) == set(FROZEN), kind
        for name, tensor in frozen.items():  # no values in the message; constants.data holds them
            entries = {e.key: e.value for e in tensor.external_data}
            assert tensor.data_location == TensorProto.EXTERNAL and not tensor.raw_data
            assert entries["location"] == "constants.data" and int(entries["offset"]) % 4096 == 0
            start, length = int(entries["offset"]), int(entries["length"])
            np.testing.assert_array_equal(np.frombuffer(data[start:start + length], np.float32),
                                          frozen_values[name].reshape(-1))
    assert len(data) < 2 * (4096 + 8192), "each frozen weight once"
    # the way back: the export's step (and the packed one) trains bit for bit like the inline export's
    rate = {"learning_rate": np.array(1e-2, np.float32)}
    for packed in (False, True):
        theirs, ours = session_from_export(tmp_path / "inline", packed=packed), session_from_export(out, packed=packed)
        for i in range(1, 4):
            assert ours.step({**_batch(i), **rate})["loss"] == theirs.step({**_batch(i), **rate})["loss"]
        mine = ours.state_dict()
        for key, value in theirs.state_dict().items():
            np.testing.assert_array_equal(mine[key], value, err_msg=key)
    # plain onnxruntime runs the inference model by its path (state.safetensors and constants.data beside it)
    x = _batch(9)["x"]
    expected = ort.InferenceSession(str(tmp_path / "inline" / "inference.onnx")).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ort.InferenceSession(str(out / "inference.onnx")).run(None, {"x": x})[0], expected)


def _frozen_values(session):
    opened = as_model(session.training_model(), copy=False)
    return {t.name: tensors.tensor_value(t, opened.large_initializers) for t in opened.model_proto.graph.initializer
            if t.name in FROZEN}


def test_an_export_past_2gb_refuses_webgpu_and_ort_format_before_writing(tmp_path, past_2gb):
    session = _session()
    for kwargs, what in (({"target": "webgpu", "input_shapes": {"x": [8, 16], "labels": [8]}}, "onnxruntime-web"),
                         ({"ort": True}, "the ORT format")):
        with pytest.raises(TrainingOpError, match=f"past protobuf's 2 GB.*constants.data, which {what}"):
            export_step(session, tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists()


def test_a_damaged_constants_file_is_named(tmp_path, past_2gb):
    export_step(_session(), tmp_path)
    with open(tmp_path / "constants.data", "r+b") as f:
        f.seek(8)
        f.write(b"\x01")
    with pytest.raises(TrainingOpError, match=r"constants.data.*SHA-256 differs.*files.constants.sha256"):
        session_from_export(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["files"]["step"]["constants"] = "../elsewhere.data"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainingOpError, match=r"files\['step'\].constants.*relative"):
        session_from_export(tmp_path)


def test_a_small_model_keeps_every_tensor_inline(tmp_path):
    manifest = export_step(_session(), tmp_path)
    assert "constants" not in manifest["files"] and not (tmp_path / "constants.data").exists()
    assert all("constants" not in entry for entry in manifest["files"].values())
    step = onnx.load(tmp_path / "step.onnx", load_external_data=False)
    assert all(t.data_location == TensorProto.DEFAULT for t in step.graph.initializer)
    assert safetensors.read(tmp_path / "state.safetensors")[0]
