"""Recipe: fine-tune a BERT-style sequence classifier (transformers) in onnxruntime.

Export ``BertForSequenceClassification`` through a wrapper ``forward(input_ids,
attention_mask, token_type_ids) -> logits`` with
:func:`~onnx_training_ops.export.from_torch.export_for_training` (``dynamo=True,
optimize=False`` or TorchScript with ``do_constant_folding=False``: every parameter kept under
torch's names), then ``build_training_model(path, "cross_entropy", AdamW(...))``: logits
``[N, num_labels]`` against int64 ``labels [N]``, as ``model(..., labels=labels).loss``.

Dropout: the export is in eval mode, so the step runs without dropout (the loss equals
transformers' in ``model.eval()``); ``build_training_model(..., mode="train")`` (CLI
``--mode train``) runs Dropout with fresh masks each step, as ``model.train()``.

Run: ``python examples/recipes/bert_classifier.py [--exporter dynamo|torchscript]``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
from _common import export_and_build, parser, perturbed, wrap

from onnx_training_ops import AdamW, TrainingSession

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def make_model(tiny: bool = True):
    """A random-init BERT classifier with 3 labels, every parameter perturbed to be distinct."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        vocab_size=100, max_position_embeddings=64, num_labels=3) if tiny else \
        BertConfig(num_labels=3)
    return perturbed(BertForSequenceClassification(config))


def main(exporter: str = "dynamo", steps: int = 3, out_dir: str | None = None, tiny: bool = True) -> dict:
    """Export, build, train ``steps`` steps on one batch; return losses and torch's loss for step 1."""
    import torch

    out_dir = out_dir or tempfile.mkdtemp(prefix="recipe_bert_")
    model = make_model(tiny)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (4, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[2:, 9:] = 0
    types = np.zeros_like(ids)
    types[:, 6:] = 1
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    feeds = dict(zip(INPUTS, (ids, mask, types)))
    with torch.no_grad():  # the reference, before the export
        torch_loss = float(model(**{k: torch.from_numpy(v) for k, v in feeds.items()},
                                 labels=torch.from_numpy(labels)).loss)
    path = os.path.join(out_dir, "model.onnx")
    training = export_and_build(wrap(model), feeds, path, exporter, "cross_entropy", AdamW(lr=1e-3))
    session = TrainingSession(training)
    losses = [float(session.step({**feeds, "labels": labels})["loss"]) for _ in range(steps)]
    print(f"bert ({exporter}): {session.summary().trainable_count:,} parameters trained; torch's loss "
          f"{torch_loss:.6f}, ours {losses[0]:.6f}; after {steps} steps {losses[-1]:.6f}")
    return {"losses": losses, "torch_loss": torch_loss, "session": session, "feeds": feeds, "path": path}


if __name__ == "__main__":
    a = parser(__doc__).parse_args()
    main(a.exporter, a.steps)
