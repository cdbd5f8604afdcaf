"""Decoder LLMs built by onnxruntime-genai's model builder, offline, for the tests and the benchmarks.

One helper for both (the benchmarks import it from here, ``sys.path`` pointing at ``tests/``):
random-init models and a word-level tokenizer are test fixtures, not the package's API, and
both users live in the checkout. :func:`hf_folder` saves a random-init Hugging Face causal LM
(``transformers``; the 1-D weights perturbed: no all-ones norms, no zero biases the builder
would drop) with a ``tokenizers``-made ``tokenizer.json`` (the builder needs one);
:func:`build` runs the builder on it in this process (``python -m onnxruntime_genai.models.builder
-i HF -o OUT -p int4|fp32 -e cpu``: ``genai_config.json``, ``model.onnx`` (``MatMulNBits``,
``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization``...) and ``model.onnx.data``).

* :func:`genai_model`: one of :data:`FAMILIES` at :data:`TINY`'s size, cached under a root;
* :func:`tiny`: a Llama (or Phi-3) with :class:`Built` folders, for the LoRA tests;
* :data:`TINYLLAMA`, :data:`LLAMA7B`: the benchmarks' configurations;
* :func:`torch_model`: the Hugging Face model in float64; :func:`dequantized`: every
  ``MatMulNBits`` weight read back from its initializers (numpy);
  :func:`dequantized_weights` / :func:`dequantized_hf_model`: the same through onnxruntime's own
  kernel, as Hugging Face linear weights.

Needs ``pip install 'onnx-training-ops[genai]'`` (onnxruntime-genai, torch, transformers).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

VOCAB = 256  # no linear layer may have VOCAB outputs: the builder takes any such one for the LM head
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1,
            pad_token_id=0)
FAMILIES = {  # transformers class name prefix, extra config
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": None}),  # as Mistral 7B v0.2+ (the builder drops a window)
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 16}),
    "phi3": ("Phi3", {"original_max_position_embeddings": 128}),
    "gemma": ("Gemma", {"head_dim": 16}),
    "gemma2": ("Gemma2", {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 20.0,
                          "final_logit_softcapping": 15.0}),
}
# TinyLlama-1.1B's configuration (the LoRA benchmark's model)
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
# Llama-2-7B's configuration (the 7B estimate measures a few layers and extrapolates)
LLAMA7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


@dataclass(frozen=True)
class Built:
    """A built model: the Hugging Face folder it came from and onnxruntime-genai's folder."""

    hf: str
    onnx: str
    config: dict = field(default_factory=dict)


def hf_folder(path: str | os.PathLike, family: str = "llama", config: dict | None = None, seed: int = 0,
              perturb: bool = True) -> Path:
    """Save a random-init ``<Family>ForCausalLM`` (:data:`FAMILIES`; its config :data:`TINY`,
    the family's extras, then ``config``) and a word-level tokenizer into ``path`` (kept if it
    holds one already); returns the path. ``perturb``: the 1-D weights (norms, biases) get
    ``0.1 * N(0, 1)`` added, so that a test sees them."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(path)
    if (folder / "config.json").exists():
        return folder
    prefix, extra = FAMILIES[family]
    merged = {**TINY, **extra, **(config or {})}
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**merged)).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(merged["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokens = {f"{kind}_token": f"t{merged[f'{kind}_token_id']}" for kind in ("bos", "eos", "pad")
              if merged.get(f"{kind}_token_id") is not None}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", **tokens).save_pretrained(folder)
    return folder


def build(hf: str | os.PathLike, out: str | os.PathLike, precision: str = "int4", execution_provider: str = "cpu",
          accuracy_level: int | None = 1, **extra: str) -> str:
    """Run onnxruntime-genai's model builder on the Hugging Face folder ``hf`` into ``out`` (in
    this process: importing it costs seconds, building a tiny model a fraction of one).

    ``accuracy_level=1`` keeps ``MatMulNBits``' input in float32; None leaves the builder's
    CPU default (4: the input quantized to int8 inside the kernel); ``extra``: more
    ``--extra_options``. Returns ``out``.
    """
    try:
        from onnxruntime_genai.models import builder
    except ImportError as error:
        raise ImportError("the genai builder needs onnxruntime-genai: pip install 'onnx-training-ops[genai]'") \
            from error
    hf, out = os.fspath(hf), os.fspath(out)
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


def genai_model(family: str, precision: str, root: Path, config: dict | None = None, **extra_options) -> Path:
    """The builder's folder of ``family`` (:func:`hf_folder` under ``root/family/hf``, built once
    per precision and options under ``root/family/<tag>``); ``extra_options`` as
    ``--extra_options key=value`` (``accuracy_level`` too: the builder's default unless given)."""
    tag = "_".join([precision] + [f"{k}{v}" for k, v in sorted(extra_options.items())])
    out = Path(root) / family / tag
    if not (out / "model.onnx").exists():
        hf = hf_folder(Path(root) / family / "hf", family, config)
        level = extra_options.pop("accuracy_level", None)
        build(hf, out, precision, accuracy_level=level, **extra_options)
    return out


def tiny(root: str | os.PathLike, config: dict | None = None, seed: int = 0, architecture: str = "llama",
         **build_options) -> Built:
    """A tiny Llama (:data:`TINY`, ``config`` overrides; or ``architecture="phi3"``) as a Hugging
    Face folder and built by the builder (int4, ``accuracy_level=1`` unless said), under ``root``."""
    merged = {**TINY, **(config or {})}
    hf = hf_folder(os.path.join(root, "hf"), architecture, merged, seed)
    return Built(os.fspath(hf), build(hf, os.path.join(root, "onnx"), **build_options), merged)


def torch_model(hf: Path):
    """The Hugging Face model in float64 with eager attention."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype="float64", attn_implementation="eager")
    return model.eval()


def dequantized(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """``{MatMulNBits node name: dequant(B) [N, K]}`` (4-bit, uint8 or no zero points, no g_idx:
    what the genai builder writes), read from the initializers."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, k, block, bits = attrs["N"], attrs["K"], attrs["block_size"], attrs.get("bits", 4)
        assert bits == 4 and len(node.input) < 5, node.name
        packed = numpy_helper.to_array(inits[node.input[1]]).reshape(n, -1)
        q = np.stack([packed & 15, packed >> 4], -1).reshape(n, -1).astype(np.float64)
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1).astype(np.float64)
        blocks = scales.shape[1]
        if len(node.input) > 3 and node.input[3]:
            zp = numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1)
            zp = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :blocks].astype(np.float64)
        else:
            zp = np.full((n, blocks), 8.0)
        out[node.name] = ((q.reshape(n, blocks, block) - zp[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]
    return out


def dequantized_weights(onnx_folder: str) -> dict[str, np.ndarray]:
    """The Hugging Face linear weights (``[out, in]`` float32 arrays, by module path) that the
    builder's ``MatMulNBits`` nodes hold, dequantized by onnxruntime itself: the node run on
    the identity (``y = x @ dequant(B).T``), split per module for a fused ``qkv_proj``."""
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
        graph = helper.make_graph(
            [helper.make_node("MatMulNBits", ["x", *node.input[1:]], ["y"], domain="com.microsoft",
                              **{a.name: helper.get_attribute_value(a) for a in node.attribute})],
            "dequantize", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [k, k])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [k, linear.out_features])],
            [inits[n] for n in node.input[1:] if n])
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
