"""The builder's metadata parsed once into a frozen, typed record (builder/metadata.py): the same strings
on disk as before, a malformed entry refused naming the key, what was expected and what was found."""

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnx_training_ops as ot
from onnx_training_ops.builder.metadata import LabelRange, TrainingMetadata
from onnx_training_ops.builder.model_metadata import META_PREFIX, metadata
from onnx_training_ops.errors import TrainingOpError


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.full((3, 2), 0.5, np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 2])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# what build_training_model wrote before the record existed (its exact text: the file format)
WRITTEN = {
    "optimizer": '{"type": "Adam", "lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0, '
                 '"post_weight_decay": 0.0}',
    "loss": "loss", "labels": "labels", "label_range": "2,-100",
    "label_shape": '{"output": "y", "output_shape": "[4, 2]", "shape": [4], "class_axis": 1, "shift": false}',
    "learning_rate": "learning_rate", "trainable": "W", "optimizer_state": '{"W": ["W.V", "W.H"]}',
    "mode": "eval", "seed": "0",
}


def test_the_builder_writes_the_same_entries_in_the_same_order():
    built = ot.build_training_model(_model(), "cross_entropy", ot.Adam(lr=0.1))
    assert list(metadata(built).items()) == list(WRITTEN.items())


def test_parse_types_every_entry_and_to_props_gives_the_text_back():
    meta = TrainingMetadata.parse(WRITTEN)
    assert meta.optimizer is not None and meta.optimizer["type"] == "Adam"
    assert meta.loss == ("loss",) and meta.trainable == ("W",) and meta.learning_rate == ("learning_rate",)
    assert meta.label_range == LabelRange(2, -100) and meta.seed == 0 and meta.mode == "eval"
    assert meta.optimizer_state == {"W": ("W.V", "W.H")} and meta.label_shape["class_axis"] == 1
    assert meta.to_props() == WRITTEN
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.loss = ("other",)  # type: ignore[misc]


def test_keys_it_does_not_know_are_kept_as_found():
    props = {**WRITTEN, "checksums": '{"a": 1}', "future_key": "x"}
    meta = TrainingMetadata.parse(props)
    assert meta.extra == {"checksums": '{"a": 1}', "future_key": "x"}
    assert meta.to_props() == props


def test_an_empty_record_writes_nothing():
    assert TrainingMetadata.parse({}).to_props() == {}
    assert TrainingMetadata.from_model(_model()) == TrainingMetadata()


@pytest.mark.parametrize("key, text, expected", [
    ("optimizer", "{not json", "a JSON object"),
    ("optimizer", "[1, 2]", "a JSON object"),
    ("label_range", "ten,-100", "'<classes>,<ignore_index or empty>'"),
    ("seed", "zero", "an integer"),
    ("optimizer_state", '{"W": "W.V"}', "a JSON object of lists of names"),
    ("param_groups", '[{"name": "a"}]', "'learning_rate' input"),
    ("nominal", '{"W": 1}', "a JSON list of names"),
])
def test_a_malformed_entry_is_refused_naming_the_key_the_expected_and_the_found(key, text, expected):
    with pytest.raises(TrainingOpError) as error:
        TrainingMetadata.parse({**WRITTEN, key: text})
    message = str(error.value)
    assert f"'{META_PREFIX}{key}'" in message and expected in message and text[:20] in message


def test_a_session_refuses_a_model_with_malformed_metadata_at_open():
    built = ot.build_training_model(_model(), "cross_entropy", ot.Adam(lr=0.1))
    props = {**metadata(built), "optimizer_state": "{broken"}
    TrainingMetadata.parse(metadata(built)).write(built)  # a rewrite keeps the model loadable
    ot.TrainingSession(built)
    for entry in built.metadata_props:
        if entry.key == META_PREFIX + "optimizer_state":
            entry.value = props["optimizer_state"]
    with pytest.raises(TrainingOpError, match="optimizer_state' is malformed"):
        ot.TrainingSession(built)


def test_session_from_export_refuses_a_state_file_clearly(tmp_path):
    """Found by mypy (read_state's manifest is None for a bare .safetensors file): a TypeError before."""
    from onnx_training_ops.export import session_from_export
    from onnx_training_ops.storage import safetensors

    path = tmp_path / "state.safetensors"
    path.write_bytes(safetensors.encode({"a": np.zeros(2, np.float32)}, {}))
    with pytest.raises(TrainingOpError, match="a state file, not an export directory"):
        session_from_export(path)
