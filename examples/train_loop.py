"""A full training loop in onnxruntime: validation, schedule, parameter groups, clipping,
gradient accumulation, checkpoints with properties, and a resume mid-run.

* model: a torch ``nn.Sequential`` with LayerNorm and Dropout, exported once by
  ``torch.onnx.export`` (torch is not needed to train) and built with ``mode="train"``;
* data: scikit-learn's digits (ships with scikit-learn), 75/25 split;
* ``AdamW`` with two parameter groups (no weight decay on biases and norms), gradient
  clipping by global norm, linear warm-up + cosine decay, 2 micro-batches per optimizer step;
* each epoch logs train and validation loss (a tqdm bar on a terminal), saves a checkpoint
  with ``epoch``/``best_val_loss`` properties; halfway the session is thrown away and a new
  one resumes from the checkpoint (schedule position and properties included);
* both curves are plotted to ``train_loop.png``.

Run: ``python examples/train_loop.py [OUT_DIR]`` (needs the ``demo`` extra and torch).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import warnings

import numpy as np

from onnx_training_ops import AdamW, TrainingSession, build_training_model
from onnx_training_ops.demo import load_digits_split
from onnx_training_ops.schedules import WarmupCosineLR

BATCH, MICRO = 64, 2  # one optimizer step = 2 micro-batches of 32


def export_model():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                              torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(net.eval(), (torch.zeros(1, 64),), buf, input_names=["pixels"],
                          output_names=["logits"], dynamic_axes={"pixels": {0: "batch"}},
                          opset_version=17, do_constant_folding=False, dynamo=False)
    return buf.getvalue()


def progress(total: int, desc: str):
    """A tqdm bar on a terminal, nothing in a log."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, leave=False)
    return None


def run_epochs(session, first: int, last: int, data, history) -> None:
    x_train, y_train, x_val, y_val = data
    steps = len(x_train) // BATCH
    rng = np.random.default_rng(session.properties.get("seed", 0) + first)
    for epoch in range(first, last):
        order = rng.permutation(len(x_train))
        bar = progress(steps, f"epoch {epoch + 1}")
        train_losses = []
        for s in range(steps):
            idx = order[s * BATCH:(s + 1) * BATCH]
            for micro in np.array_split(idx, MICRO):
                out = session.backward({"pixels": x_train[micro], "labels": y_train[micro]}, scale=1 / MICRO)
                train_losses.append(float(out["loss"]))
            session.optimizer_step()
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        val = session.evaluate({"pixels": x_val, "labels": y_val}, outputs=["logits"])
        accuracy = float(np.mean(np.argmax(val["logits"], axis=1) == y_val))
        history["train"].append(float(np.mean(train_losses)))
        history["val"].append(float(val["loss"]))
        best = min(session.properties.get("best_val_loss", np.inf), history["val"][-1])
        session.properties.update({"epoch": epoch + 1, "best_val_loss": best})
        print(f"epoch {epoch + 1:2d}  train {history['train'][-1]:.4f}  val {history['val'][-1]:.4f}  "
              f"val accuracy {accuracy:.3f}  lr {session.learning_rates['learning_rate']:.2e}", flush=True)
    history["accuracy"] = accuracy


def plot(history, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    epochs = np.arange(1, len(history["train"]) + 1)
    ax.plot(epochs, history["train"], marker="o", ms=3, label="train")
    ax.plot(epochs, history["val"], marker="o", ms=3, label="validation")
    ax.axvline(history["resumed_at"] + 0.5, color="gray", ls="--", lw=0.8, label="resumed from checkpoint")
    ax.set_xlabel("epoch")
    ax.set_ylabel("cross-entropy loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(out_dir: str | None = None, epochs: int = 12) -> dict:
    out_dir = out_dir or tempfile.mkdtemp(prefix="train_loop_")
    os.makedirs(out_dir, exist_ok=True)
    data = load_digits_split(seed=0)
    total_steps = epochs * (len(data[0]) // BATCH)
    model = build_training_model(
        export_model(), "cross_entropy", AdamW(lr=3e-3, weight_decay=0.05), mode="train",
        param_groups=[{"params": ["*.bias", "1.*"], "weight_decay": 0.0, "name": "no_decay"}],
        clip_grad_norm=1.0)
    session = TrainingSession(model)
    session.set_lr_schedule(WarmupCosineLR(warmup_steps=total_steps // 10, total_steps=total_steps))
    session.properties["seed"] = 0
    history = {"train": [], "val": []}
    checkpoint = os.path.join(out_dir, "checkpoint.onnx")

    half = epochs // 2
    run_epochs(session, 0, half, data, history)
    session.save(checkpoint)
    del session  # as if the job stopped here

    session = TrainingSession(checkpoint)
    print(f"resumed from {checkpoint}: epoch {session.properties['epoch']}, "
          f"schedule step {session.lr_schedule_step}/{total_steps}")
    history["resumed_at"] = session.properties["epoch"]
    run_epochs(session, session.properties["epoch"], epochs, data, history)
    session.save(checkpoint)
    history["plot"] = plot(history, os.path.join(out_dir, "train_loop.png"))
    history["checkpoint"] = checkpoint
    print(f"loss curves: {history['plot']}")
    return history


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
