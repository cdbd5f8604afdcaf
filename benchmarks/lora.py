"""LoRA on a ~1B-parameter Llama-style model: the export, torch + peft, and the memory bench case.

    python -m benchmarks memory --models llama-1b-lora [--contenders ours,torch]

The model is TinyLlama-1.1B's configuration (22 layers, hidden 2048, MLP 5632, 32 heads with
4 key/value heads, vocabulary 32000; 1.10 B parameters, 4.4 GB in float32), randomly
initialized, with ``peft`` LoRA adapters (rank 8, alpha 16, on ``q_proj`` and ``v_proj``;
1.1 M trainable parameters). Only the adapters train: torch + peft freeze the base, and the
builder gets ``trainable=`` the adapter tensors, so the base weights carry no optimizer
state, no gradient, and stay memory-mapped from the export's external data file.

``peft`` initializes every ``lora_B`` to zero; the TorchScript exporter merges equal
initializers, which would tie all of them into one tensor, so the adapters are perturbed
(as the zoo perturbs every weight) before the export and before torch trains.

Exporting needs ``torch``, ``transformers`` and ``peft`` (``pip install
'onnx-training-ops[lora]'``) and about 12 GB of memory once; the export is cached like the
zoo's (:func:`.zoo.cache_dir`), its weights in one external data file.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from . import zoo

SPEC = zoo.Spec("llama-1b-lora", family="llama", layers=22, hidden=2048, heads=32, vocab=32000, batch=4, seq=128,
                extra={"intermediate_size": 5632, "num_key_value_heads": 4, "rank": 8, "alpha": 16,
                       "targets": "q_proj,v_proj"})
ADAPTER = "lora_"  # what names an adapter tensor, in torch and in the export


def is_lora(name: str) -> bool:
    return name == SPEC.name or name.startswith(SPEC.name + "[")


def batches(s: zoo.Spec, count: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Causal-LM batches: token ids, an all-ones mask, labels = the ids (shifted by the loss)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(2, s.vocab, (s.batch, s.seq), dtype=np.int64)
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids.copy()})
    return out


def torch_model(s: zoo.Spec):
    """The peft-wrapped Llama (seed 0), adapters perturbed, in train mode; ``module(ids, mask)``
    returns the logits."""
    import peft
    import torch
    import transformers

    extra = dict(s.extra)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                                   num_attention_heads=s.heads, intermediate_size=extra["intermediate_size"],
                                   num_key_value_heads=extra["num_key_value_heads"], use_cache=False,
                                   attention_dropout=0.0)
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=extra["rank"], lora_alpha=extra["alpha"], lora_dropout=0.0,
                           target_modules=extra["targets"].split(","))
    model = peft.get_peft_model(base, lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ADAPTER in name:
                p.add_(zoo.PERTURBATION * torch.randn(p.shape, generator=g))
    return zoo._Logits(model, ["input_ids", "attention_mask"]).train()


def export(s: zoo.Spec, cache: str | None = None) -> str:
    """The cached export of ``s`` (made first if missing, :func:`.zoo.export`): ``model.onnx``
    and one data file beside it."""
    return zoo.export(s, cache, exporter=_export_to)


def _export_to(s: zoo.Spec, path: str) -> None:
    import warnings

    import torch

    from onnx_training_ops.storage import load_model, save_model

    module = torch_model(s).eval()
    feed = batches(s, 1)[0]
    args = (torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"]))
    raw = os.path.join(os.path.dirname(path), "raw")
    os.makedirs(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, os.path.join(raw, "model.onnx"), dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"])
    del module, args
    # one data file, whatever the exporter wrote (one file per tensor past 2 GB), streamed
    # from the memory-mapped tensors: never the whole model in memory
    save_model(load_model(os.path.join(raw, "model.onnx"), large=True), path, external=True)
    shutil.rmtree(raw)


def trainable(path: str) -> list[str]:
    """The adapter tensors of the export at ``path`` (its message only is read)."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    return [t.name for t in graph.initializer if ADAPTER in t.name]


def loss(s: zoo.Spec):
    from onnx_training_ops.builder.losses import CrossEntropyLoss

    return CrossEntropyLoss(class_axis=-1, shift_labels=True)


def torch_loss(logits, labels):
    """The causal-LM loss in torch: ``logits[:, :-1]`` against ``labels[:, 1:]``, mean."""
    import torch

    logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
