"""Tiny decoder LLMs through onnxruntime-genai's model builder, offline: a random-init Hugging Face
model (weights perturbed: no all-ones norms, no zero biases the builder would drop) saved with a
``tokenizers``-made tokenizer, then the builder run in this process (``-p int4|fp32 -e cpu``).

``genai_model(family, precision, root)`` returns the output folder (``model.onnx`` + data,
``genai_config.json``); ``torch_model(folder_of_hf)`` the Hugging Face model in float64.
``dequantized(model)`` reads every MatMulNBits weight back as ``{node name: [N, K] float64}``.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

VOCAB = 256  # no linear layer may have VOCAB outputs: the builder takes any such one for the LM head
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0)
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


def hf_folder(family: str, root: Path, seed: int = 0) -> Path:
    """A saved random-init ``<Family>ForCausalLM`` with a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = root / family / "hf"
    if (folder / "config.json").exists():
        return folder
    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms' weights and biases: away from 1 and 0
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1",
                                         bos_token="t2", pad_token="t0").save_pretrained(folder)
    return folder


def genai_model(family: str, precision: str, root: Path, **extra_options: str) -> Path:
    """``python -m onnxruntime_genai.models.builder -i HF -o OUT -p precision -e cpu`` in this
    process; ``extra_options`` as ``--extra_options key=value``."""
    tag = "_".join([precision] + [f"{k}{v}" for k, v in sorted(extra_options.items())])
    out = root / family / tag
    if (out / "model.onnx").exists():
        return out
    from onnxruntime_genai.models import builder
    hf = hf_folder(family, root)
    cache = root / "cache"
    options = [f"{k}={v}" for k, v in extra_options.items()]
    with contextlib.redirect_stdout(io.StringIO()):
        prepared = builder.parse_extra_options(None, str(hf), str(out), precision, "cpu", str(cache), options)
        builder.create_model(None, str(hf), str(out), precision, "cpu", str(cache), **prepared)
    return out


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
