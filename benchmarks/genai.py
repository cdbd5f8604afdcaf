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
import logging
import os
import shutil
from dataclasses import dataclass, field

# TinyLlama-1.1B's configuration (the benchmark's model)
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
# Llama-2-7B's configuration (32 layers; the 7B estimate measures a few layers and extrapolates)
LLAMA7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


@dataclass(frozen=True)
class Built:
    """A built model: the Hugging Face folder it came from and onnxruntime-genai's folder."""

    hf: str
    onnx: str
    config: dict = field(default_factory=dict)


def hf_folder(path: str, config: dict | None = None, seed: int = 0, perturb_norms: bool = True,
              architecture: str = "llama") -> str:
    """Save a random-init causal LM (``architecture``: ``"llama"`` or ``"phi3"``; ``config``:
    its config's fields, default :data:`TINY`) and a word-level tokenizer into ``path``;
    returns ``path``.

    ``perturb_norms``: the RMSNorm weights (all ones at init) get random values around 1,
    so that a test sees them.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = {**TINY, **(config or {})}
    torch.manual_seed(seed)
    if architecture == "phi3":
        cfg = transformers.Phi3Config(tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2,
                                      original_max_position_embeddings=config["max_position_embeddings"], **config)
        model = transformers.Phi3ForCausalLM(cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **config))
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
    quantizer = logging.getLogger("onnxruntime.quantization")  # an INFO line per layer otherwise
    level = quantizer.level
    quantizer.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            kwargs = builder.parse_extra_options(None, hf, out, precision, execution_provider, cache, options)
            builder.create_model(None, hf, out, precision, execution_provider, cache, **kwargs)
    finally:
        quantizer.setLevel(level)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def tiny(root: str, config: dict | None = None, seed: int = 0, architecture: str = "llama",
         **build_options) -> Built:
    """A tiny Llama (:data:`TINY`, ``config`` overrides; or Phi-3) as a Hugging Face folder and
    built by onnxruntime-genai's builder (int4, ``accuracy_level=1`` unless said), under ``root``."""
    merged = {**TINY, **(config or {})}
    hf = hf_folder(os.path.join(root, "hf"), merged, seed, architecture=architecture)
    return Built(hf, build(hf, os.path.join(root, "onnx"), **build_options), merged)


def dequantized_weights(onnx_folder: str) -> dict[str, object]:
    """The Hugging Face linear weights (``[out, in]`` float32 arrays, by module path) that the
    builder's ``MatMulNBits`` nodes hold, dequantized by onnxruntime itself: the node run on
    the identity (``y = x @ dequant(B).T``), split per module for a fused ``qkv_proj``."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from onnx_training_ops.lora.inject import read_genai_config
    from onnx_training_ops.lora.targets import linear_nodes
    from onnx_training_ops.storage import load_model

    model = load_model(onnx_folder)
    inits = {t.name: t for t in model.graph.initializer}
    decoder = (read_genai_config(os.path.abspath(onnx_folder)) or {}).get("model", {}).get("decoder")
    out = {}
    for linear in linear_nodes(model, decoder):
        node = linear.node
        if node.op_type != "MatMulNBits":
            continue
        k = linear.in_features
        inputs = [n for n in node.input[1:] if n]
        graph = helper.make_graph(
            [helper.make_node("MatMulNBits", ["x", *node.input[1:]], ["y"], domain="com.microsoft",
                              **{a.name: helper.get_attribute_value(a) for a in node.attribute})],
            "dequantize", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [k, k])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [k, linear.out_features])],
            [inits[n] for n in inputs])
        one = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)], ir_version=9)
        y = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.eye(k, dtype=np.float32)})[0]
        for s in linear.slices:
            out[s.module] = np.ascontiguousarray(y.T[s.start:s.stop])
    return out


def dequantized_hf_model(built: Built):
    """The Hugging Face model of ``built`` with its linear weights replaced by the dequantized
    weights of the int4 model (:func:`dequantized_weights`): what the ONNX model computes.
    A module Hugging Face fuses where the builder did not (Phi-3's ``gate_up_proj``) gets its
    parts' weights stacked."""
    import numpy as np
    import torch
    import transformers

    from onnx_training_ops.lora.targets import FUSED

    model = transformers.AutoModelForCausalLM.from_pretrained(built.hf, dtype=torch.float32)
    weights = dequantized_weights(built.onnx)
    for prefix_and_fused in list(weights):
        prefix, _, last = prefix_and_fused.rpartition(".")
        for fused, parts in FUSED.items():
            names = [f"{prefix}.{p}" for p in parts]
            if last == parts[0] and all(n in weights for n in names):
                weights[f"{prefix}.{fused}"] = np.concatenate([weights[n] for n in names])
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.from_numpy(weights[name]))
    return model.eval()
