"""The benchmarks' real models: torch modules, their ONNX exports (cached on disk) and
cycles of distinct batches.

Every entry of :data:`SPECS` is a random-init model people train, at the size a benchmark
quotes (BERT 4L/256 batch 8 x 128, GPT-2 4L/256 causal LM batch 4 x 128, a ResNet-18 at
64 x 64 with train-mode BatchNorm batch 16, MLPs) or by configuration (GPT-2 124M and 355M,
BERT-base). :func:`spec` takes overrides (``spec("gpt2", layers=2, batch=2)``).

* :func:`torch_model`: the module, seeded, **weights perturbed** so that no two tensors are
  equal (the TorchScript exporter merges equal initializers and would tie parameters;
  LayerNorm weights of 1 and zero biases are equal in a fresh model). Dropout is 0 so that
  train and eval mode do the same work in every contender.
* :func:`export`: ``torch.onnx.export`` with the TorchScript exporter, opset 17,
  ``do_constant_folding=False``, in eval mode (``mode="train"`` in the builder gives
  BatchNorm its batch statistics). Cached under :func:`cache_dir` by a key of the spec and
  the torch/transformers versions, written atomically; models past 1 GiB of weights keep
  them in external data beside the ``.onnx`` (exporting GPT-2 355M peaks near 8 GB RSS in
  the TorchScript exporter: run it under the heavy lock).
* :func:`batches`: ``count`` distinct feed dicts (numpy), the same for every caller. A loop
  that repeats one batch memorizes it and onnxruntime-training then speeds up (see
  :mod:`.dataset`); benchmarks cycle through these instead.
* :func:`torch_loss`: the loss of the spec's head in torch, the same as :func:`loss`'s in
  the builder.

Module level imports are numpy and the standard library only: onnxruntime-training's
worker (another Python) loads this file by path for :func:`batches` and :func:`spec`.
torch, transformers and onnx are imported when a model is built or exported.

    python -m benchmarks.zoo [NAME ...] [--cache DIR]   (export, print paths)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

PERTURBATION = 0.05  # added to every parameter (times a standard normal): no equal tensors
EXTERNAL_DATA_BYTES = 2**30  # weights past this go to external data beside the .onnx


@dataclass(frozen=True)
class Spec:
    """One benchmark model: family, size, batch and head.

    ``family``: "bert" (sequence classification, 2 labels), "gpt2" (causal LM: logits
    ``[B, S, V]`` against the input ids shifted by one), "resnet" (image classification,
    train-mode BatchNorm), "mlp" (ReLU MLP, ``sizes`` = layer widths).
    """

    name: str
    family: str
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    batch: int = 1
    seq: int = 0  # tokens per sample (bert, gpt2)
    image: int = 0  # pixels per side (resnet)
    sizes: tuple[int, ...] = ()  # mlp widths; resnet stage widths
    depths: tuple[int, ...] = ()  # resnet blocks per stage
    classes: int = 0
    extra: dict = field(default_factory=dict, hash=False)  # further config keys

    @property
    def mode(self) -> str:
        """The builder's ``mode``: "train" where the model has BatchNorm."""
        return "train" if self.family == "resnet" else "eval"

    @property
    def input_names(self) -> list[str]:
        return {"bert": ["input_ids", "attention_mask"], "gpt2": ["input_ids", "attention_mask"],
                "resnet": ["pixel_values"], "mlp": ["input"]}[self.family]

    def key(self, versions: dict) -> str:
        """A short hash naming the export in the cache."""
        text = json.dumps([dataclasses.asdict(self), versions, PERTURBATION], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


_BERT = dict(family="bert", vocab=30522, classes=2)
_GPT2 = dict(family="gpt2", vocab=50257)
SPECS: dict[str, Spec] = {s.name: s for s in [
    Spec("bert", layers=4, hidden=256, heads=4, batch=8, seq=128, **_BERT),
    Spec("gpt2", layers=4, hidden=256, heads=4, batch=4, seq=128, **_GPT2),
    Spec("resnet18", family="resnet", image=64, batch=16, sizes=(64, 128, 256, 512),
         depths=(2, 2, 2, 2), classes=10),
    Spec("mlp", family="mlp", sizes=(64, 128, 10), batch=64),
    Spec("mlp_large", family="mlp", sizes=(784, 1024, 1024, 10), batch=128),
    Spec("gpt2-124m", layers=12, hidden=768, heads=12, batch=4, seq=128, **_GPT2),
    Spec("gpt2-355m", layers=24, hidden=1024, heads=16, batch=4, seq=128, **_GPT2),
    Spec("bert-base", layers=12, hidden=768, heads=12, batch=4, seq=128, **_BERT),
    Spec("resnet50", family="resnet", image=224, batch=64, sizes=(256, 512, 1024, 2048), depths=(3, 4, 6, 3),
         classes=1000, extra={"layer_type": "bottleneck"}),
]}


def spec(name: str, **overrides) -> Spec:
    """The spec called ``name`` (a key of :data:`SPECS`), with fields replaced by
    ``overrides``; a changed spec gets ``name`` suffixed by its changes."""
    if name not in SPECS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(SPECS)}")
    base = SPECS[name]
    if not overrides:
        return base
    suffix = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return dataclasses.replace(base, name=f"{name}[{suffix}]", **overrides)


# --- batches (numpy only) ---------------------------------------------------------------

def batches(s: Spec, count: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` distinct feed dicts for ``s``: the model inputs plus ``labels`` (int64).

    bert: token ids in [2, vocab), an all-ones attention mask, labels in [0, classes).
    gpt2: the same ids and mask; ``labels`` are the ids (the loss shifts them by one).
    resnet: standard-normal pixels, labels in [0, classes). mlp: standard-normal inputs
    labelled by a random linear teacher (learnable, not memorized within a few epochs).
    """
    rng = np.random.default_rng(seed)
    out = []
    teacher = rng.standard_normal((s.sizes[0], s.sizes[-1])) if s.family == "mlp" else None
    for _ in range(count):
        if s.family in ("bert", "gpt2"):
            ids = rng.integers(2, s.vocab, (s.batch, s.seq), dtype=np.int64)
            feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            feed["labels"] = ids.copy() if s.family == "gpt2" else \
                rng.integers(0, s.classes, s.batch, dtype=np.int64)
        elif s.family == "resnet":
            feed = {"pixel_values": rng.standard_normal((s.batch, 3, s.image, s.image)).astype(np.float32),
                    "labels": rng.integers(0, s.classes, s.batch, dtype=np.int64)}
        else:
            x = rng.standard_normal((s.batch, s.sizes[0])).astype(np.float32)
            feed = {"input": x, "labels": np.argmax(x @ teacher, axis=1).astype(np.int64)}
        out.append(feed)
    return out


# --- torch ------------------------------------------------------------------------------

def torch_model(s: Spec):
    """The torch module for ``s`` (seed 0, weights perturbed, dropout 0), in train mode;
    ``module(*inputs)`` takes the inputs in :attr:`Spec.input_names` order and returns the
    logits."""
    import torch

    torch.manual_seed(0)
    module = _Logits(_build(s), s.input_names) if s.family != "mlp" else _build(s)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(PERTURBATION * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():  # equal running statistics get merged too
            if name.endswith("running_mean"):
                b.add_(PERTURBATION * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.mul_(1 + 0.2 * torch.rand(b.shape, generator=g))
    return module.train()


def _build(s: Spec):
    import torch

    if s.family == "mlp":
        layers = []
        for fan_in, fan_out in zip(s.sizes[:-1], s.sizes[1:]):
            layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])
    import transformers

    if s.family == "bert":
        cfg = transformers.BertConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                                      num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                                      num_labels=s.classes, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, **s.extra)
        return transformers.BertForSequenceClassification(cfg)
    if s.family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=s.vocab, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      **s.extra)
        return transformers.GPT2LMHeadModel(cfg)
    if s.family == "resnet":
        extra = {"layer_type": "basic", **s.extra}  # ResNet-50: layer_type="bottleneck"
        cfg = transformers.ResNetConfig(embedding_size=s.sizes[0] if extra["layer_type"] == "basic" else 64,
                                        hidden_sizes=list(s.sizes), depths=list(s.depths), num_labels=s.classes,
                                        **extra)
        return transformers.ResNetForImageClassification(cfg)
    raise ValueError(f"unknown family {s.family!r}")


def _logits_module():
    import torch

    class Logits(torch.nn.Module):
        """Positional inputs in, the logits tensor out (``.logits`` of transformers outputs)."""

        def __init__(self, model, names: list[str]):
            super().__init__()
            self.model, self.names = model, names

        def forward(self, *args):
            return self.model(**dict(zip(self.names, args))).logits

    return Logits


def _Logits(model, names):  # noqa: N802  a class made on first use (torch is imported lazily)
    return _logits_module()(model, names)


def torch_loss(s: Spec, logits, labels):
    """The head's loss in torch: cross-entropy; for gpt2 ``logits[:, :-1]`` against
    ``labels[:, 1:]`` (transformers' causal-LM loss)."""
    import torch

    if s.family == "gpt2":
        logits, labels = logits[:, :-1], labels[:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return torch.nn.functional.cross_entropy(logits, labels)


def loss(s: Spec):
    """The builder's loss for ``s`` (same math as :func:`torch_loss`)."""
    from onnx_training_ops.builder.losses import CrossEntropyLoss

    if s.family == "gpt2":
        return CrossEntropyLoss(class_axis=-1, shift_labels=True)
    return CrossEntropyLoss()


# --- export and cache -------------------------------------------------------------------

def cache_dir() -> str:
    """``$ONNX_TRAINING_OPS_ZOO`` or ``~/.cache/onnx_training_ops/zoo``."""
    return os.environ.get("ONNX_TRAINING_OPS_ZOO") or os.path.join(
        os.path.expanduser("~"), ".cache", "onnx_training_ops", "zoo")


def export(s: Spec, cache: str | None = None, exporter=None) -> str:
    """The path of ``s``'s ONNX export, exporting it first if the cache lacks it
    (``exporter(s, path)``, default :func:`_export_to`, writes it)."""
    versions = _versions()
    root = cache or cache_dir()
    final = os.path.join(root, f"{_safe(s.name)}-{s.key(versions)}")
    path = os.path.join(final, "model.onnx")
    if os.path.exists(path):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=root)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by processes
    try:
        (exporter or _export_to)(s, os.path.join(tmp, "model.onnx"))
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump({"spec": dataclasses.asdict(s), "versions": versions}, f, indent=1)
        try:
            os.replace(tmp, final)  # atomic: a reader sees all of it or nothing
        except OSError:
            if not os.path.exists(path):  # another process won the race: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _versions() -> dict[str, str]:
    """torch's and transformers' versions, read from their metadata: a worker that finds its
    export in the cache never imports them (their memory would count in its peak RSS)."""
    from importlib.metadata import version

    return {"torch": version("torch"), "transformers": version("transformers")}


def _export_to(s: Spec, path: str) -> None:
    import warnings

    import onnx
    import torch

    module = torch_model(s).eval()
    args = tuple(torch.from_numpy(v) for k, v in batches(s, 1)[0].items() if k != "labels")
    big = sum(p.numel() * p.element_size() for p in module.parameters()) > EXTERNAL_DATA_BYTES
    raw = path + ".raw" if big else path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, raw, dynamo=False, opset_version=17, do_constant_folding=False,
                          input_names=s.input_names, output_names=["logits"])
    del module, args  # the weights once in memory while they move to external data
    if big:  # one file of weights beside the graph, whatever the exporter chose
        model = onnx.load(raw)
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        for name in os.listdir(os.path.dirname(path)):
            if name not in ("model.onnx", "model.onnx.data"):
                os.remove(os.path.join(os.path.dirname(path), name))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["bert", "gpt2", "resnet18", "mlp"], help=f"of {', '.join(SPECS)}")
    ap.add_argument("--cache", default=None, help=f"cache directory (default: {cache_dir()})")
    args = ap.parse_args(argv)
    for name in args.names:
        if name not in SPECS:
            ap.error(f"unknown model {name!r}; known: {', '.join(SPECS)}")
        print(export(SPECS[name], args.cache), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
