"""Train a small transformers GPT-2 as a character-level language model, in onnxruntime.

The text ships with Python: the Zen of Python (``this``) and the docstrings of a few standard
modules. A tiny GPT-2 (random init, no download) is exported by ``torch.onnx.export``,
:func:`onnx_training_ops.build_training_model` adds the shifted next-token cross-entropy
(``CrossEntropyLoss(shift_labels=True)``, as transformers computes it) and AdamW-style Adam,
and :class:`onnx_training_ops.TrainingSession` trains it with a progress bar; the loss curve
is plotted to ``loss.png`` and a greedy sample is printed from the trained inference model.

Run: ``python examples/finetune_transformer.py [OUT_DIR] [STEPS]``.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import sys
import tempfile
import warnings

import numpy as np
import onnxruntime as ort
import torch

from onnx_training_ops import Adam, CrossEntropyLoss, TrainingSession, build_training_model

SEQ, BATCH = 32, 16


def corpus() -> str:
    """Text bundled with Python itself: no download."""
    import json
    import textwrap
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    zen = codecs.decode(this.s, "rot13")
    docs = [textwrap.dedent(m.__doc__ or "") for m in (json, textwrap, contextlib, codecs)]
    return "\n".join([zen] + docs)


def batches(ids: np.ndarray, rng: np.random.Generator):
    starts = rng.integers(0, len(ids) - SEQ, BATCH)
    return np.stack([ids[s:s + SEQ] for s in starts]).astype(np.int64)


def export_gpt2(vocab: int, path: str) -> None:
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab,
                                     n_positions=SEQ, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # no constant folding: it would fold parameters into constants nothing can train
        torch.onnx.export(Logits(), (ids, torch.ones_like(ids)), path, dynamo=False,
                          opset_version=17, do_constant_folding=False,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"])


def main(out_dir: str | None = None, steps: int = 300) -> dict:
    from tqdm import tqdm
    out_dir = out_dir or tempfile.mkdtemp(prefix="finetune_transformer_")
    os.makedirs(out_dir, exist_ok=True)
    text = corpus()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text])
    exported = os.path.join(out_dir, "gpt2.onnx")
    export_gpt2(len(chars), exported)

    training = build_training_model(exported, CrossEntropyLoss(shift_labels=True),
                                    Adam(lr=3e-3, weight_decay=0.0), labels="labels")
    session = TrainingSession(training)
    rng = np.random.default_rng(0)
    mask = np.ones((BATCH, SEQ), np.int64)
    losses = []
    for _ in tqdm(range(steps), desc="training", unit="step", disable=not sys.stderr.isatty()):
        x = batches(ids, rng)
        losses.append(float(session.step({"input_ids": x, "attention_mask": mask,
                                          "labels": x})["loss"]))
    path = os.path.join(out_dir, "gpt2_trained.onnx")
    session.export_inference_model(path)
    sample = generate(path, "Beautiful is", chars)
    plot = os.path.join(out_dir, "loss.png")
    _plot(losses, plot)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"{len(chars)} characters, {len(text)} characters of text; loss {first:.3f} -> {last:.3f} "
          f"(uniform guess: {np.log(len(chars)):.3f})")
    print(f"sample: {sample!r}")
    print(f"loss curve: {plot}; trained model: {path}")
    return {"first": first, "last": last, "sample": sample, "plot": plot}


def generate(path: str, prompt: str, chars: list[str], length: int = 40) -> str:
    """Greedy decoding with the trained inference model in plain onnxruntime."""
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ids = [chars.index(c) for c in prompt]
    for _ in range(length):
        window = ids[-SEQ:]
        x = np.zeros((BATCH, SEQ), np.int64)
        x[0, :len(window)] = window
        mask = np.zeros((BATCH, SEQ), np.int64)
        mask[0, :len(window)] = 1
        logits = sess.run(None, {"input_ids": x, "attention_mask": mask})[0]
        ids.append(int(np.argmax(logits[0, len(window) - 1])))
    return "".join(chars[i] for i in ids)


def _plot(losses: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("next-character cross-entropy")
    ax.set_title("tiny GPT-2 trained in onnxruntime")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None,
         int(sys.argv[2]) if len(sys.argv) > 2 else 300)
