"""Fault suite, files (issue 29 items 8-10, 17, 18): external data reached through a symlink out of
the model's folder, damaged onnxruntime-training artifacts and checkpoints for ``import-ortt``,
a checkpoint property ``train --nproc`` cannot read, and concurrent saves to one path. Before
the fixes: the symlinked data loaded (onnx's loader refuses it), ``alpha="abc"`` and a bad
``epoch`` exited 3 with a traceback, step -10 imported as T = -10 (NaN parameters after one
step), and a concurrent save removed the data file another save had just committed."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import onnx
import pytest
from onnx import helper
from ortt_fixtures import ORTT

import onnx_training_ops as ot
from onnx_training_ops.cli import main
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.migrate import checkpoint_schema as fbs
from onnx_training_ops.migrate import import_onnxruntime_training, read_checkpoint
from onnx_training_ops.storage.model_files import load_model


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


# ------------------------------------------------------------------ external data through a symlink

@pytest.fixture
def external_model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "mlp.onnx"
    onnx.save(make_mlp((64, 32, 4)), path, save_as_external_data=True, location="mlp.onnx.data", size_threshold=256)
    return path


def test_external_data_symlinked_out_of_the_folder_is_refused_as_onnx_does(external_model, tmp_path):
    outside = tmp_path / "elsewhere.data"
    shutil.move(external_model.parent / "mlp.onnx.data", outside)
    os.symlink(outside, external_model.parent / "mlp.onnx.data")
    with pytest.raises(Exception, match=r"(?i)symlink|outside|escape"):  # the reference: onnx's own loader
        onnx.load(str(external_model))
    with pytest.raises(TrainingOpError, match=r"external data location 'mlp.onnx.data' resolves to .*outside the "
                                              r"model's directory"):
        load_model(str(external_model))
    with pytest.raises(TrainingOpError, match=r"outside the model's directory"):
        load_model(str(external_model), large=True)  # memory-mapped by this package


def test_external_data_through_a_symlink_inside_the_folder_is_refused_as_onnx_does(external_model, monkeypatch):
    """onnx's loader refuses a symlink even inside the folder; small (onnx-loaded) and large
    (memory-mapped by this package) models answer alike."""
    inner = external_model.parent / "weights"
    inner.mkdir()
    shutil.move(external_model.parent / "mlp.onnx.data", inner / "mlp.onnx.data")
    os.symlink(os.path.join("weights", "mlp.onnx.data"), external_model.parent / "mlp.onnx.data")
    with pytest.raises(Exception, match=r"symbolic link"):
        onnx.load(str(external_model))
    with pytest.raises(TrainingOpError, match=r"symbolic link"):
        load_model(str(external_model))
    monkeypatch.setenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", "1024")
    with pytest.raises(TrainingOpError, match=r"external data location 'mlp.onnx.data' is a symbolic link"):
        load_model(str(external_model), large=True)


# ------------------------------------------------------------------ import-ortt

@pytest.fixture
def artifacts(tmp_path):
    folder = tmp_path / "artifacts"
    shutil.copytree(ORTT / "mlp", folder)
    return folder


def _set_attribute(folder, name, value):
    model = onnx.load(str(folder / "optimizer_model.onnx"))
    [node] = [n for n in model.graph.node if n.op_type == "AdamWOptimizer"]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value)])
    onnx.save(model, str(folder / "optimizer_model.onnx"))


@pytest.mark.parametrize("name, value, found", [("alpha", "abc", "STRING b'abc'"), ("epsilon", [1.0, 2.0], "FLOATS"),
                                                ("adam_mode", 0.5, "FLOAT 0.5")])
def test_an_optimizer_attribute_of_the_wrong_type_exits_2(artifacts, tmp_path, capsys, name, value, found):
    _set_attribute(artifacts, name, value)
    with pytest.raises(TrainingOpError, match=rf"optimizer_model.onnx: node .* attribute '{name}' must be .*found "
                                              rf"{found}"):
        import_onnxruntime_training(artifacts)
    assert main(["import-ortt", str(artifacts), str(tmp_path / "out.onnx")]) == 2
    _one_line_error(capsys, f"attribute '{name}'")
    assert not (tmp_path / "out.onnx").exists()


def _group_field(buf: bytes, field: int) -> int:
    """The byte position of field ``field`` of optimizer group 0 (read through the schema)."""
    group = fbs.Checkpoint.root(buf).optimizer_groups()[0]
    slot = group._slot(field)
    assert slot
    return group._tab.Pos + slot


def test_a_negative_optimizer_step_is_refused(artifacts, tmp_path, capsys):
    path = artifacts / "checkpoint_10"
    data = bytearray(path.read_bytes())
    at = _group_field(bytes(data), 1)
    assert int.from_bytes(data[at:at + 8], "little", signed=True) == 10
    data[at:at + 8] = (-10).to_bytes(8, "little", signed=True)
    path.write_bytes(bytes(data))
    with pytest.raises(TrainingOpError, match=r"checkpoint_10: optimizer group 'group0' has step -10"):
        read_checkpoint(path)
    assert main(["import-ortt", str(artifacts), str(tmp_path / "out.onnx"), "--checkpoint", "checkpoint_10"]) == 2
    _one_line_error(capsys, "step -10")


def _tensor_bytes(buf: bytes, array: np.ndarray) -> int:
    at = buf.find(array.tobytes())
    assert at > 0 and buf.find(array.tobytes(), at + 1) < 0
    return at


@pytest.mark.parametrize("damage, message", [
    ("nan parameter", r"parameter '0\.weight' holds NaN or infinite values"),
    ("negative second moment", r"moment 'momentum1' of '0\.weight' holds a negative value"),
    ("infinite moment", r"moment '0\.bias/momentum0' holds NaN or infinite values"),
    ("negative learning rate", r"initial learning rate -"),
])
def test_flipped_bytes_that_the_format_lets_us_detect(artifacts, damage, message):
    path = artifacts / "checkpoint_10"
    buf = path.read_bytes()
    ckpt = read_checkpoint(path)
    moments = ckpt.optimizer_groups[0].moments
    data = bytearray(buf)
    if damage == "nan parameter":
        at = _tensor_bytes(buf, ckpt.trainable["0.weight"])
        data[at + 3] |= 0x7F  # exponent all ones: NaN or infinity
        data[at + 2] |= 0x80
    elif damage == "negative second moment":
        at = _tensor_bytes(buf, moments["0.weight"]["momentum1"])
        data[at + 7] |= 0x80  # the sign bit of the second float
    elif damage == "infinite moment":
        at = _tensor_bytes(buf, moments["0.bias"]["momentum0"])
        data[at:at + 4] = np.array([np.inf], np.float32).tobytes()
    else:
        at = _group_field(buf, 2)
        data[at + 3] |= 0x80  # the float's sign bit
    path.write_bytes(bytes(data))
    with pytest.raises(TrainingOpError, match=message):
        import_onnxruntime_training(artifacts, checkpoint="checkpoint_10")


def test_byte_flips_in_a_checkpoint_never_crash_or_give_nonfinite_state(artifacts):
    """One flip at each of 300 spread positions: refused with the file named, or read as a
    checkpoint whose values are all finite and whose step is >= 0 (the undetectable case: a
    changed tensor value, documented in migrate/checkpoint.py)."""
    path = artifacts / "checkpoint_10"
    original = path.read_bytes()
    refused = 0
    for at in np.linspace(8, len(original) - 1, 300).astype(int):
        data = bytearray(original)
        data[at] ^= 0x40
        path.write_bytes(bytes(data))
        try:
            ckpt = read_checkpoint(path)
        except TrainingOpError as error:
            assert str(path) in str(error)
            refused += 1
            continue
        for array in [*ckpt.trainable.values(), *ckpt.frozen.values()]:
            assert np.isfinite(array).all()
        for group in ckpt.optimizer_groups:
            assert group.step >= 0
            for found in group.moments.values():
                assert all(np.isfinite(v).all() for v in found.values())
    assert refused > 0


# ------------------------------------------------------------------ train --nproc over a bad checkpoint

@pytest.mark.parametrize("epoch", ["abc", 2.5, True, -1])
def test_train_nproc_over_a_checkpoint_with_a_bad_epoch_exits_2(tmp_path, capsys, epoch):
    pytest.importorskip("sklearn")
    pytest.importorskip("torch")
    session = ot.TrainingSession(ot.build_training_model(make_mlp((64, 8, 10)), "cross_entropy", ot.Adam()))
    session.properties["epoch"] = epoch
    session.save(tmp_path / "checkpoint.onnx")
    assert main(["train", "--nproc", "2", "--out", str(tmp_path), "--epochs", "3"]) == 2
    _one_line_error(capsys, "property 'epoch' is", "expected an integer >= 0")


def test_train_nproc_over_a_checkpoint_with_a_bad_history_exits_2(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("torch")
    session = ot.TrainingSession(ot.build_training_model(make_mlp((64, 8, 10)), "cross_entropy", ot.Adam()))
    session.properties.update(epoch=1, history="{not json")
    session.save(tmp_path / "checkpoint.onnx")
    assert main(["train", "--nproc", "2", "--out", str(tmp_path), "--epochs", "3"]) == 2
    _one_line_error(capsys, "property 'history'")


# ------------------------------------------------------------------ concurrent saves to one path

@pytest.mark.parametrize("large", [False, True], ids=["inline", "external-data"])
def test_concurrent_saves_to_one_path_all_succeed(tmp_path, monkeypatch, large):
    if large:
        monkeypatch.setenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", str(16 * 1024))
    sessions = [ot.TrainingSession(ot.build_training_model(make_mlp((64, 96, 10), seed=seed), "cross_entropy",
                                                           ot.Adam())) for seed in range(3)]
    path = tmp_path / "ck.onnx"
    failures: list[str] = []
    start = threading.Barrier(len(sessions))

    def save_many(session):
        start.wait()
        for _ in range(10):
            try:
                session.save(path)
            except Exception as error:  # noqa: BLE001 - every failure counts
                failures.append(repr(error))

    threads = [threading.Thread(target=save_many, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    loaded = ot.TrainingSession(str(path)).state_dict()  # complete and checksummed: one of the saves
    matches = [s for s in sessions if all(np.array_equal(loaded[k], v) for k, v in s.state_dict().items())]
    assert len(matches) == 1
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert leftovers == []
    if large:
        assert len([n for n in os.listdir(tmp_path) if n.endswith(".data")]) == 1
