"""LoRA fine-tuning of a Llama-style model in onnxruntime: only the adapters train.

A random-init Llama (``--size 1b``: TinyLlama-1.1B's configuration, 4.4 GB of float32
weights; ``--size tiny``: two small layers, seconds) gets ``peft`` LoRA adapters on its
attention's q and v projections, is exported by ``torch.onnx.export`` with its weights in
external data (``benchmarks/lora.py`` of this checkout, shared with the memory benchmark),
and trained with only the adapters trainable: the 1.1 B base weights stay memory-mapped from
the export's data file, with no optimizer state and no gradient. Then the session is saved (the model's tensors in one
external data file beside ``checkpoint.onnx``, written atomically) and a second session
resumes from the file, bit-exact.

Run: ``python examples/finetune_lora.py [--size tiny|1b] [--steps 4] [--out DIR]``
(``pip install 'onnx-training-ops[lora]'``: torch, transformers, peft; the 1b export needs
about 12 GB of memory once and is cached).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import numpy as np

from onnx_training_ops import AdamW, TrainingSession, build_training_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`
from benchmarks import lora

TINY = dataclasses.replace(lora.SPEC, name="llama-tiny-lora", layers=2, hidden=64, heads=4, vocab=500, batch=2,
                           seq=16, extra={**lora.SPEC.extra, "intermediate_size": 128, "num_key_value_heads": 2})


def main(size: str = "tiny", steps: int = 4, out_dir: str | None = None) -> dict:
    spec = lora.SPEC if size == "1b" else TINY
    out_dir = out_dir or tempfile.mkdtemp(prefix="finetune_lora_")
    export = lora.export(spec)                    # model.onnx + its data file, cached
    adapters = lora.trainable(export)             # the lora_A / lora_B tensors
    training = build_training_model(export, lora.loss(spec), AdamW(lr=1e-4, weight_decay=0.01),
                                    labels="labels", trainable=adapters)
    session = TrainingSession(training)
    batches = lora.batches(spec, steps + 1)
    losses = [float(session.step(batches[i])["loss"]) for i in range(steps)]
    path = os.path.join(out_dir, "checkpoint.onnx")
    session.save(path)
    resumed = TrainingSession(path)
    next_loss = float(session.step(batches[steps])["loss"])
    resumed_loss = float(resumed.step(batches[steps])["loss"])
    same = all(np.array_equal(a, b) for a, b in zip(session.state_views(adapters), resumed.state_views(adapters)))
    print(f"{len(adapters)} adapter tensors trained ({sum(v.size for v in session.state_views(adapters)):,} "
          f"parameters); losses {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"saved {path}; resumed in a new session: next loss {resumed_loss:.6f} vs {next_loss:.6f}, "
          f"adapters bit-exact: {same}")
    return {"losses": losses, "next_loss": next_loss, "resumed_loss": resumed_loss, "bit_exact": same,
            "checkpoint": path}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("tiny", "1b"), default="tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    main(args.size, args.steps, args.out)
