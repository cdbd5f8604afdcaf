"""Parameters the TorchScript exporter merged by value train apart (issue 20 item 8), checked
against torch's ``named_parameters`` on transformers' BERT-tiny, DistilBERT and GPT-2 (random
init, unperturbed: fresh LayerNorm weights and zero biases are equal tensors). Before the fix
BERT-tiny's 41 parameters were 21 trainables, DistilBERT's 40 were 20."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import onnx_training_ops as ot  # noqa: E402
from onnx_training_ops.builder.model_metadata import metadata  # noqa: E402

CONFIGS = {
    "bert": ("BertForSequenceClassification", "BertConfig",
             dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100)),
    "distilbert": ("DistilBertForSequenceClassification", "DistilBertConfig",
                   dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=100)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False)),
}


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _export(name: str):
    cls, config, kwargs = CONFIGS[name]
    torch.manual_seed(0)
    module = Logits(getattr(transformers, cls)(getattr(transformers, config)(**kwargs))).eval()
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (ids, torch.ones_like(ids)), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"])
    return module, onnx.load_from_string(f.getvalue()), ids


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_torch_parameter_is_a_trainable_of_its_own(name):
    module, model, _ = _export(name)
    loss = "cross_entropy" if name != "gpt2" else ot.CrossEntropyLoss(class_axis=-1)
    with pytest.warns(UserWarning, match="TorchScript exporter had merged"):
        training = ot.build_training_model(model, loss, ot.Adam())
    trainables = set(metadata(training)["trainable"].split(","))
    assert trainables == {n for n, _ in module.named_parameters()}  # GPT-2: lm_head stays wte's


def test_untied_bert_gradients_match_torch():
    module, model, ids = _export("bert")
    labels = np.array([0, 1], np.int64)
    with pytest.warns(UserWarning):
        session = ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.Adam()))
    session.backward({"input_ids": ids.numpy(), "attention_mask": np.ones((2, 6), np.int64), "labels": labels})
    ours = session.gradients()
    module.zero_grad()
    torch.nn.functional.cross_entropy(module(ids, torch.ones_like(ids)), torch.from_numpy(labels)).backward()
    for name, p in module.named_parameters():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=2e-3, atol=2e-5, err_msg=name)
