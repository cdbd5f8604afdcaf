"""Recipe: LoRA fine-tuning with peft: only the adapters train, the base weights stay frozen.

``peft.get_peft_model(base, LoraConfig(...))`` adds ``lora_A``/``lora_B`` to the chosen
projections and freezes the rest. Export the peft model like any module (through a wrapper
returning the logits, with :func:`~onnx_training_ops.export.from_torch.export_for_training`),
then train the parameters torch trains: ``trainable=[name for name, p in
named_parameters() if p.requires_grad]`` (CLI: ``--trainable '*lora_*'``). The base weights
get no gradient and no optimizer state.

Settings that matter here: peft starts every ``lora_B`` at zero, so they are all equal.
TorchScript (``do_constant_folding=False``) merges equal initializers into one read through
``Identity`` aliases; the builder gives each back its own tensor (it warns "untied ...").
The dynamo exporter's default ``optimize=True`` may fold or merge them away: then the
trainable names match no initializer and the builder says which; ``optimize=False`` keeps
one initializer per parameter.

Run: ``python examples/recipes/lora.py [--exporter dynamo|torchscript]``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
from _common import export_and_build, parser, wrap
from causal_lm import make_model

from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingSession


def make_lora_model(rank: int = 4):
    """A tiny random-init Llama with peft LoRA adapters on ``q_proj`` and ``v_proj`` (lora_B at zero)."""
    import peft
    import torch

    base = make_model("llama")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, config).eval()


def main(exporter: str = "dynamo", steps: int = 3, out_dir: str | None = None) -> dict:
    """Export, build with only the adapters trainable, train; return losses, torch's loss, trainables."""
    import torch

    out_dir = out_dir or tempfile.mkdtemp(prefix="recipe_lora_")
    model = make_lora_model()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (2, 16)).astype(np.int64)
    mask = np.ones_like(ids)
    with torch.no_grad():
        torch_loss = float(model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 labels=torch.from_numpy(ids)).loss)
    wrapped = wrap(model)
    trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]  # torch's names
    path = os.path.join(out_dir, "model.onnx")
    training = export_and_build(wrapped, {"input_ids": ids, "attention_mask": mask}, path, exporter,
                                CrossEntropyLoss(shift_labels=True), AdamW(lr=1e-2), trainable=trainable)
    session = TrainingSession(training)
    feeds = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    losses = [float(session.step(feeds)["loss"]) for _ in range(steps)]
    s = session.summary()
    print(f"lora ({exporter}): {len(s.trainable)} adapter tensors ({s.trainable_count:,} parameters) trained, "
          f"{s.frozen_count:,} base weights frozen; torch's loss {torch_loss:.6f}, ours {losses[0]:.6f}; "
          f"after {steps} steps {losses[-1]:.6f}")
    return {"losses": losses, "torch_loss": torch_loss, "session": session, "trainable": trainable, "path": path}


if __name__ == "__main__":
    a = parser(__doc__).parse_args()
    main(a.exporter, a.steps)
