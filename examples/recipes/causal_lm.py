"""Recipe: fine-tune a GPT-2 or Llama-style causal language model (transformers) in onnxruntime.

``GPT2LMHeadModel(GPT2Config())`` as a user first exports it fails with both exporters: the
model returns a ``DynamicCache`` (TorchScript: "Only tuples, lists and Variables are supported
as JIT inputs/outputs ... DynamicCache"; dynamo: torch.export fails), and without an
``attention_mask`` TorchScript stops at ``aten::diff`` ("not supported" at opset 17 and 18).
What works, with both exporters:

1. ``config.use_cache = False`` (no cache to return);
2. a wrapper whose ``forward(input_ids, attention_mask)`` passes both by keyword and returns
   ``.logits`` (one tensor, no ``logits_to_keep`` input);
3. :func:`~onnx_training_ops.export.from_torch.export_for_training`: ``dynamo=True,
   optimize=False`` or ``dynamo=False, do_constant_folding=False`` (every parameter kept,
   torch's names recorded);
4. the causal-LM loss: ``CrossEntropyLoss(shift_labels=True)`` (logits ``[N, T, C]``, class
   axis last, ``logits[:, :-1]`` against ``labels[:, 1:]``), labels = the input ids, as
   transformers computes ``model(input_ids, labels=input_ids).loss``.

Run: ``python examples/recipes/causal_lm.py [--family gpt2|llama] [--exporter dynamo|torchscript]``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
from _common import export_and_build, parser, perturbed, wrap

from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingSession


def make_model(family: str, tiny: bool = True):
    """A random-init transformers causal LM with ``use_cache=False`` (tiny: seconds to export)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64) if tiny else GPT2Config()
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=100,
                             max_position_embeddings=64) if tiny else LlamaConfig()
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return perturbed(model)  # fresh LayerNorm weights of 1 and zero biases: make every parameter distinct


def main(family: str = "gpt2", exporter: str = "dynamo", steps: int = 3, out_dir: str | None = None,
         tiny: bool = True) -> dict:
    """Export, build, train ``steps`` steps on one batch; return losses and torch's loss for step 1."""
    import torch

    out_dir = out_dir or tempfile.mkdtemp(prefix=f"recipe_{family}_")
    model = make_model(family, tiny)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (2, 16)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 12:] = 0  # padding at the end of the second row: ignored by attention and loss
    labels = np.where(mask == 1, ids, -100)  # transformers' convention: -100 is ignored
    with torch.no_grad():  # the reference: transformers' own loss, before any export touches the module
        torch_loss = float(model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 labels=torch.from_numpy(labels)).loss)
    wrapped = wrap(model)
    path = os.path.join(out_dir, "model.onnx")
    training = export_and_build(wrapped, {"input_ids": ids, "attention_mask": mask}, path, exporter,
                                CrossEntropyLoss(shift_labels=True), AdamW(lr=1e-3))
    session = TrainingSession(training)
    feeds = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    losses = [float(session.step(feeds)["loss"]) for _ in range(steps)]
    print(f"{family} ({exporter}): {session.summary().trainable_count:,} parameters trained; torch's loss "
          f"{torch_loss:.6f}, ours {losses[0]:.6f}; after {steps} steps {losses[-1]:.6f}")
    return {"losses": losses, "torch_loss": torch_loss, "session": session, "module": wrapped,
            "feeds": feeds, "path": path}


if __name__ == "__main__":
    ap = parser(__doc__)
    ap.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--full-size", action="store_true", help="the default configs (124M GPT-2): minutes")
    a = ap.parse_args()
    main(a.family, a.exporter, a.steps, tiny=not a.full_size)
