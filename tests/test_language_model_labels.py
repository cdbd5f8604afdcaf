"""A language model's labels checked against the logits the loss reads (issue 20 items 9, 12),
on transformers' GPT-2 (random init, tiny config) exported by TorchScript with dynamic axes.

Before: labels were compared with the first input, so logits already flattened to ``[N*T, V]``
were refused ("one label per example"); labels ``[2, 8]`` for ``input_ids`` ``[2, 16]`` failed
in a gradient ``Sub`` inside onnxruntime; a sequence of 1 under ``shift_labels`` gave NaN."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import onnx_training_ops as ot  # noqa: E402

VOCAB = 64


class Head(torch.nn.Module):
    def __init__(self, flat: bool):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                         use_cache=False, bos_token_id=0, eos_token_id=0)
        self.model, self.flat = transformers.GPT2LMHeadModel(config), flat

    def forward(self, input_ids, attention_mask):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits.reshape(-1, VOCAB) if self.flat else logits


def _ids(batch, seq, seed=0):
    return np.random.default_rng(seed).integers(1, VOCAB, (batch, seq)).astype(np.int64)


def _export(flat: bool, name_output_axes: bool = True) -> onnx.ModelProto:
    """The head by TorchScript; ``name_output_axes=False``: the logits' dims are left for the
    exporter to name (``MatMullogits_dim_1``)."""
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    if name_output_axes:
        axes["logits"] = {0: "tokens"} if flat else {0: "batch", 1: "seq"}
    ids = torch.from_numpy(_ids(2, 8))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Head(flat), (ids, torch.ones_like(ids)), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_axes=axes)
    return onnx.load_from_string(f.getvalue())


def _feeds(batch, seq, labels):
    ids = _ids(batch, seq)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}


@pytest.fixture(scope="module")
def sessions():
    flat = ot.TrainingSession(ot.build_training_model(_export(True), "cross_entropy", ot.Adam(lr=1e-3)))
    shifted = ot.TrainingSession(ot.build_training_model(
        _export(False), ot.CrossEntropyLoss(class_axis=-1, shift_labels=True), ot.Adam(lr=1e-3)))
    return flat, shifted


def test_logits_already_flattened_to_tokens_train(sessions):
    flat, _ = sessions
    labels = _ids(2, 8, seed=1).reshape(-1)  # one label per token: 16 rows for input_ids [2, 8]
    loss = float(flat.step(_feeds(2, 8, labels))["loss"])
    assert np.isfinite(loss) and abs(loss - np.log(VOCAB)) < 1.0


def test_labels_of_another_sequence_length_are_one_feed_error(sessions):
    _, shifted = sessions
    with pytest.raises(ot.TrainingOpError) as info:
        shifted.step(_feeds(2, 16, _ids(2, 8, seed=1)))
    message = str(info.value)
    assert "\n" not in message and "feed 'labels' has 8 at axis 1, input 'input_ids' has 16 at axis 1" in message
    assert "must have shape [batch, seq]" in message


def test_a_sequence_of_one_token_under_shift_labels_is_a_feed_error(sessions):
    _, shifted = sessions
    with pytest.raises(ot.TrainingOpError, match="sequence length 1: shift_labels .* at least 2"):
        shifted.step(_feeds(2, 1, _ids(2, 1, seed=1)))
    assert np.isfinite(float(shifted.step(_feeds(2, 8, _ids(2, 8, seed=1)))["loss"]))


def test_labels_against_logits_whose_dimensions_the_export_left_unnamed():
    """Without dynamic axes for the output, TorchScript names the logits' dims
    ``MatMullogits_dim_1``: known only once the batch runs. onnxruntime's broadcast error in a
    gradient Sub becomes the one-line feed error, the logits' shape computed for this batch."""
    with pytest.warns(UserWarning):  # fresh LayerNorms: untied
        session = ot.TrainingSession(ot.build_training_model(
            _export(False, name_output_axes=False), ot.CrossEntropyLoss(class_axis=-1, shift_labels=True), ot.Adam()))
    for call in (session.step, session.backward, session.evaluate):
        with pytest.raises(ot.TrainingOpError) as info:
            call(_feeds(2, 16, _ids(2, 8, seed=1)))
        assert str(info.value).endswith(f"feed 'labels' has shape [2, 8]; the loss reads 'logits', of shape "
                                        f"[2, 16, {VOCAB}] for this batch, so 'labels' must have shape [2, 16]")
    assert session.state_dict()["optimizer.T"] == 0 and session.accumulated_batches == 0
