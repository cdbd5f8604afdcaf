"""read_checkpoint: onnxruntime-training's checkpoint flatbuffer, read against its schema.

Every value is checked against what onnxruntime-training's own CheckpointState returned when
the fixtures were made (trajectory.npz); damaged and foreign files end in a TrainingOpError
naming the file.
"""

from __future__ import annotations

import numpy as np
import pytest
from ortt_fixtures import ORTT, params

from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.migrate import read_checkpoint


@pytest.mark.parametrize("case, name, step", [("mlp", "checkpoint", 0), ("mlp", "checkpoint_10", 10),
                                              ("bert", "checkpoint", 0), ("bert", "checkpoint_10", 10)])
def test_parameters_equal_what_their_checkpoint_state_held(case, name, step):
    ckpt = read_checkpoint(ORTT / case / name)
    assert ckpt.version == 2 and not ckpt.nominal
    theirs = params(case, step, trainable_only=False)
    assert set(ckpt.trainable) | set(ckpt.frozen) == set(theirs)
    for n, value in {**ckpt.trainable, **ckpt.frozen}.items():
        assert value.dtype == theirs[n].dtype and np.array_equal(value, theirs[n]), n
    assert list(ckpt.frozen) == (["bert.embeddings.position_embeddings.weight"] if case == "bert" else [])


def test_optimizer_group_and_properties():
    ckpt = read_checkpoint(ORTT / "mlp" / "checkpoint_10")
    (group,) = ckpt.optimizer_groups
    assert (group.name, group.step) == ("group0", 10)
    assert group.initial_learning_rate == np.float32(1e-3)  # set_learning_rate(0.01) is not saved
    assert set(group.moments) == set(ckpt.trainable)
    for n, moments in group.moments.items():
        assert set(moments) == {"momentum0", "momentum1"}
        assert moments["momentum0"].shape == ckpt.trainable[n].shape
        assert np.all(moments["momentum1"] >= 0)
    assert ckpt.properties == {"epoch": 1, "best_loss": 0.5, "note": "ten steps"}
    assert read_checkpoint(ORTT / "mlp" / "checkpoint_10_no_opt").optimizer_groups == []


def test_a_nominal_checkpoint_has_names_and_types_only():
    ckpt = read_checkpoint(ORTT / "mlp" / "nominal_checkpoint")
    assert ckpt.nominal and ckpt.trainable == {} and ckpt.frozen == {}
    assert {n: dtype for n, (dtype, _) in ckpt.shapes.items()} == dict.fromkeys(params("mlp", 0), np.float32)


def test_foreign_files_are_named(tmp_path):
    with pytest.raises(TrainingOpError, match=r"eval_model\.onnx: not an onnxruntime-training checkpoint "
                                              r"\(expected the flatbuffer file identifier 'ODTC'"):
        read_checkpoint(ORTT / "mlp" / "eval_model.onnx")
    with pytest.raises(TrainingOpError, match="a directory; onnxruntime-training .* writes its checkpoint as one file"):
        read_checkpoint(ORTT / "mlp")
    with pytest.raises(TrainingOpError, match="cannot read the checkpoint"):
        read_checkpoint(tmp_path / "absent")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(TrainingOpError, match="not an onnxruntime-training checkpoint"):
        read_checkpoint(tmp_path / "empty")


def test_truncated_and_corrupted_checkpoints_fail_cleanly(tmp_path):
    data = (ORTT / "mlp" / "checkpoint_10").read_bytes()
    rng = np.random.default_rng(0)
    outcomes = {"refused": 0, "read": 0}
    for k in range(60):
        damaged = bytearray(data)
        if k < 20:
            damaged = damaged[: int(rng.integers(8, len(data)))]
        else:
            for _ in range(4):
                at = int(rng.integers(8, len(data)))
                damaged[at] = int(rng.integers(0, 256))
        path = tmp_path / f"damaged{k}"
        path.write_bytes(bytes(damaged))
        try:
            read_checkpoint(path)
            outcomes["read"] += 1  # a flip inside tensor bytes is a valid (different) checkpoint
        except TrainingOpError as e:
            assert str(path) in str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] >= 20


def test_a_size_mismatch_names_the_tensor(tmp_path):
    data = bytearray((ORTT / "mlp" / "checkpoint").read_bytes())
    ckpt = read_checkpoint(ORTT / "mlp" / "checkpoint")
    bias = ckpt.trainable["2.bias"].tobytes()
    at = bytes(data).index(bias)
    length_at = at - 4  # the raw_data vector's uint32 length precedes its bytes
    assert int.from_bytes(data[length_at:at], "little") == len(bias)
    data[length_at:at] = (len(bias) - 4).to_bytes(4, "little")
    (tmp_path / "ckpt").write_bytes(bytes(data))
    with pytest.raises(TrainingOpError, match=r"tensor '2\.bias' of shape \[4\] and dtype float32 needs 16 "
                                              r"bytes, found 12"):
        read_checkpoint(tmp_path / "ckpt")
