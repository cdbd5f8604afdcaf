"""A zoo of tiny, random-init models people train, exported by ``torch.onnx.export``.

Each entry builds a torch module (fixed seed, weights perturbed so no two tensors are equal:
the TorchScript exporter merges equal initializers), example inputs, and the loss its head
takes. :func:`export` runs either exporter; :func:`parameter_map` matches ONNX initializers
to torch parameters by value (the exporters may rename or transpose them).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from torch import nn

EXPORTERS = ("torchscript", "dynamo")


@dataclass
class Entry:
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    loss: str  # "cross_entropy" ([N, C] logits + labels) or "mse" (any output + target)
    classes: int = 0


class Logits(nn.Module):
    """Keyword inputs in, one tensor out (``.logits`` of transformers outputs)."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)))
        return out.logits if hasattr(out, "logits") else out


class First(nn.Module):
    """The first output of a module returning a tuple (RNNs, attention)."""

    def __init__(self, module: nn.Module, self_attention: bool = False):
        super().__init__()
        self.module, self.self_attention = module, self_attention

    def forward(self, x):
        out = self.module(x, x, x) if self.self_attention else self.module(x)
        return out[0] if isinstance(out, tuple) else out


def _ids(shape, vocab=100, seed=0):
    """Token ids >= 2: torch's Embedding(padding_idx=...) (BART's pad id is 1) gives the
    padding row no gradient, a rule the exported Gather does not carry (see docs/finetuning.md)."""
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _text(**extra):
    return lambda: {"input_ids": _ids((2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long),
                    **{k: v() for k, v in extra.items()}}


def _image(size=32):
    return lambda: {"pixel_values": torch.randn(2, 3, size, size,
                                                generator=torch.Generator().manual_seed(0))}


def _seq(shape=(2, 6, 4)):
    return lambda: {"x": torch.randn(*shape, generator=torch.Generator().manual_seed(0))}


def _hf(cls_name: str, config_name: str, inputs, **config):
    def build():
        import transformers
        cfg = getattr(transformers, config_name)(**config)
        model = getattr(transformers, cls_name)(cfg)
        return Logits(model, list(inputs().keys()))
    return build


TEXT = dict(vocab_size=100, max_position_embeddings=32)
ZOO: dict[str, Entry] = {
    "gpt2": Entry(_hf("GPT2LMHeadModel", "GPT2Config", _text(), n_layer=2, n_embd=32, n_head=2,
                      vocab_size=100, n_positions=32, use_cache=False, bos_token_id=0,
                      eos_token_id=0), _text(), "mse"),
    "bert": Entry(_hf("BertForSequenceClassification", "BertConfig", _text(), num_hidden_layers=2,
                      hidden_size=32, num_attention_heads=2, intermediate_size=64, num_labels=3,
                      **TEXT), _text(), "cross_entropy", 3),
    "distilbert": Entry(_hf("DistilBertForSequenceClassification", "DistilBertConfig", _text(),
                            n_layers=2, dim=32, n_heads=2, hidden_dim=64, num_labels=3, **TEXT),
                        _text(), "cross_entropy", 3),
    "vit": Entry(_hf("ViTForImageClassification", "ViTConfig", _image(16), num_hidden_layers=2,
                     hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16,
                     patch_size=4, num_labels=3), _image(16), "cross_entropy", 3),
    "bart": Entry(_hf("BartForConditionalGeneration", "BartConfig",
                      _text(decoder_input_ids=lambda: _ids((2, 6), seed=1)), encoder_layers=1,
                      decoder_layers=1, d_model=32, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                      use_cache=False, **TEXT),
                  _text(decoder_input_ids=lambda: _ids((2, 6), seed=1)), "mse"),
    "t5": Entry(_hf("T5ForConditionalGeneration", "T5Config",
                    _text(decoder_input_ids=lambda: _ids((2, 6), seed=1)), num_layers=1,
                    d_model=32, d_kv=16, num_heads=2, d_ff=64, vocab_size=100,
                    decoder_start_token_id=0, use_cache=False),
                _text(decoder_input_ids=lambda: _ids((2, 6), seed=1)), "mse"),
    "resnet": Entry(_hf("ResNetForImageClassification", "ResNetConfig", _image(),
                        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3),
                    _image(), "cross_entropy", 3),
    "mobilenet_v2": Entry(_hf("MobileNetV2ForImageClassification", "MobileNetV2Config", _image(),
                              depth_multiplier=0.25, image_size=32, num_labels=3),
                          _image(), "cross_entropy", 3),
    "convnext": Entry(_hf("ConvNextForImageClassification", "ConvNextConfig", _image(),
                          hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3),
                      _image(), "cross_entropy", 3),
    "lstm": Entry(lambda: First(nn.LSTM(4, 5, num_layers=2, bidirectional=True,
                                        batch_first=True)), _seq(), "mse"),
    "gru": Entry(lambda: First(nn.GRU(4, 5, batch_first=True)), _seq(), "mse"),
    "rnn": Entry(lambda: First(nn.RNN(4, 5, batch_first=True)), _seq(), "mse"),
    "rnn_relu": Entry(lambda: First(nn.RNN(4, 5, nonlinearity="relu", bidirectional=True)),
                      _seq(), "mse"),
    "multihead_attention": Entry(lambda: First(nn.MultiheadAttention(8, 2, batch_first=True),
                                               self_attention=True), _seq((2, 5, 8)), "mse"),
    "transformer_encoder": Entry(
        lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True,
                                                                 dropout=0.0), 1,
                                      enable_nested_tensor=False), _seq((2, 5, 8)), "mse"),
    "embedding_layernorm": Entry(
        lambda: nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3)),
        lambda: {"x": _ids((2, 5), vocab=10)}, "mse"),
    "norms_convtranspose_upsample": Entry(
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4),
                              nn.InstanceNorm2d(4, affine=True), nn.ConvTranspose2d(4, 3, 3, stride=2),
                              nn.Upsample(scale_factor=2, mode="bilinear"),
                              nn.Upsample(scale_factor=2, mode="nearest")),
        lambda: {"x": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))},
        "mse"),
}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The eval-mode module with perturbed weights, and its example inputs."""
    torch.manual_seed(0)
    entry = ZOO[name]
    module = entry.build().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():  # equal running statistics get merged too
            if name.endswith("running_mean"):
                b.add_(0.05 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.mul_(1 + 0.2 * torch.rand(b.shape, generator=g))
    return module, entry.inputs()


def export(module: nn.Module, inputs: dict[str, torch.Tensor], exporter: str) -> onnx.ModelProto:
    names = list(inputs)
    args = tuple(inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            # optimize=False: the exporter's optimizer folds parameters into constants
            # (eval-mode BatchNorm into Conv, position embeddings, LSTM weights), which
            # leaves nothing to train; TorchScript's do_constant_folding=False likewise
            program = torch.onnx.export(module, args, dynamo=True, opset_version=18,
                                        input_names=names, output_names=["output"],
                                        verbose=False, optimize=False)
            return program.model_proto
        f = io.BytesIO()
        torch.onnx.export(module, args, f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=names, output_names=["output"])
        return onnx.load_from_string(f.getvalue())


def parameter_map(model: onnx.ModelProto, module: nn.Module) -> dict[str, tuple[str, bool]]:
    """ONNX initializer name -> (torch parameter name, stored transposed?)."""
    params = {n: p.detach().numpy() for n, p in module.named_parameters()}
    out: dict[str, tuple[str, bool]] = {}
    for init in model.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        value = onnx.numpy_helper.to_array(init)
        for name, p in params.items():
            if value.shape == p.shape and np.array_equal(value, p):
                out[init.name] = (name, False)
                break
            if p.ndim == 2 and value.shape == p.T.shape and np.array_equal(value, p.T):
                out[init.name] = (name, True)
                break
    return out
