"""Llama-shaped models built by onnxruntime-genai's model builder, offline, for the LoRA tests and benchmark.

:func:`hf_folder` saves a random-init ``LlamaForCausalLM`` (``transformers``) with a small
word-level ``tokenizer.json`` (``tokenizers``: the builder needs a tokenizer), and
:func:`build` runs the builder on it (``python -m onnxruntime_genai.models.builder -i HF -o OUT
-p int4 -e cpu``, here called in-process: importing it costs seconds, building a tiny model a
fraction of one): ``genai_config.json``, ``model.onnx`` (``MatMulNBits``,
``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization``...) and ``model.onnx.data``.
Needs ``pip install 'onnx-training-ops[genai]'`` (onnxruntime-genai, torch, transformers).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from dataclasses import dataclass, field

# TinyLlama-1.1B's configuration (the benchmark's model)
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


@dataclass(frozen=True)
class Built:
    """A built model: the Hugging Face folder it came from and onnxruntime-genai's folder."""

    hf: str
    onnx: str
    config: dict = field(default_factory=dict)


def hf_folder(path: str, config: dict | None = None, seed: int = 0, perturb_norms: bool = True) -> str:
    """Save a random-init ``LlamaForCausalLM`` (``config``: LlamaConfig fields, default
    :data:`TINY`) and a word-level tokenizer into ``path``; returns ``path``.

    ``perturb_norms``: the RMSNorm weights (all ones at init) get random values around 1,
    so that a test sees them.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = {**TINY, **(config or {})}
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(tie_word_embeddings=False, **config)
    model = transformers.LlamaForCausalLM(cfg)
    if perturb_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(path)
    return path


def build(hf: str, out: str, precision: str = "int4", execution_provider: str = "cpu",
          accuracy_level: int | None = 1, **extra: str) -> str:
    """Run onnxruntime-genai's model builder on the Hugging Face folder ``hf`` into ``out``.

    ``accuracy_level=1`` keeps ``MatMulNBits``' input in float32 (the builder's CPU default,
    4, quantizes it to int8 inside the kernel); ``extra``: more ``--extra_options``.
    Returns ``out``.
    """
    try:
        from onnxruntime_genai.models import builder
    except ImportError as error:
        raise ImportError("the genai builder needs onnxruntime-genai: pip install 'onnx-training-ops[genai]'") \
            from error
    options = [f"{k}={v}" for k, v in extra.items()]
    if accuracy_level is not None:
        options.append(f"accuracy_level={accuracy_level}")
    cache = os.path.join(out, ".cache")
    with contextlib.redirect_stdout(io.StringIO()):
        kwargs = builder.parse_extra_options(None, hf, out, precision, execution_provider, cache, options)
        builder.create_model(None, hf, out, precision, execution_provider, cache, **kwargs)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def tiny(root: str, config: dict | None = None, seed: int = 0, **build_options) -> Built:
    """A tiny Llama (:data:`TINY`, ``config`` overrides) as a Hugging Face folder and built
    by onnxruntime-genai's builder (int4, ``accuracy_level=1`` unless said), under ``root``."""
    merged = {**TINY, **(config or {})}
    hf = hf_folder(os.path.join(root, "hf"), merged, seed)
    return Built(hf, build(hf, os.path.join(root, "onnx"), **build_options), merged)
