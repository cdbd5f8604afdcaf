"""Does a torch export train exactly torch's parameters? One check for any module and exporter.

:func:`check` exports a module with torch's *default* settings (``torch.onnx.export(module, args,
f)``: dynamo with ``optimize=True``; or ``dynamo=False`` with ``do_constant_folding=True``), builds
it with the default trainables (or the ones given), and compares with torch itself:

* the trainables, under torch's names (``to_torch_state_dict``'s mapping), against
  ``named_parameters()`` that require a gradient;
* each parameter's gradient of an MSE loss against ``torch.autograd`` in float64 (torch's own
  float32 error measured beside it);
* the weights after a few steps of SGD with momentum against ``torch.optim.SGD`` (float64), and that
  ``to_torch_state_dict()`` loads with ``load_state_dict(strict=True)`` into the module.

A :class:`~onnx_training_ops.TrainingOpError` from the build is a result too (``Result.error``):
the builder refusing a parameter it cannot restore, naming it.
"""

from __future__ import annotations

import copy
import io
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

import onnx_training_ops as ot
from onnx_training_ops.builder.model_metadata import metadata
from onnx_training_ops.training.state.torch_names import record_torch_names, recorded_names, to_torch_names

LR = 0.1  # SGD with momentum: the update is linear in the gradient (Adam's g/sqrt(v) amplifies rounding noise)


@dataclass
class Result:
    error: str = ""  # the build's TrainingOpError, if any
    notes: list[str] = field(default_factory=list)  # the builder's warnings
    trainables: set[str] = field(default_factory=set)  # torch names that train
    expected: set[str] = field(default_factory=set)  # torch's requires_grad names (every alias)
    grad_errors: dict[str, float] = field(default_factory=dict)  # torch name -> max|ours - torch| / max|torch|
    step_errors: dict[str, float] = field(default_factory=dict)  # the weights after the steps: error over the update
    strict_load: str = "ok"  # load_state_dict(strict=True) of to_torch_state_dict(): "ok" or torch's error
    torch_grad_errors: dict[str, float] = field(default_factory=dict)  # torch float32's own, against float64
    torch_step_errors: dict[str, float] = field(default_factory=dict)
    fp32_step_errors: dict[str, float] = field(default_factory=dict)  # ours against torch float32's steps

    def within(self, tol: float) -> bool:
        """Every gradient and step error within ``tol``, or within 4x torch float32's own error
        for that parameter (float32 cannot hold an update much below its weight's last bits)."""
        return all(err <= max(tol, 4 * own.get(n, 0.0)) for errs, own in
                   ((self.grad_errors, self.torch_grad_errors), (self.step_errors, self.torch_step_errors))
                   for n, err in errs.items())

    @property
    def grad_error(self) -> float:
        return max(self.grad_errors.values(), default=0.0)

    @property
    def step_error(self) -> float:
        return max(self.step_errors.values(), default=0.0)

    @property
    def torch_grad_error(self) -> float:
        return max(self.torch_grad_errors.values(), default=0.0)

    @property
    def torch_step_error(self) -> float:
        return max(self.torch_step_errors.values(), default=0.0)

    def summary(self) -> str:
        if self.error:
            return f"error: {self.error}"
        extra, missing = sorted(self.trainables - self.expected), sorted(self.expected - self.trainables)
        text = (f"grad {self.grad_error:.1e} (torch fp32 {self.torch_grad_error:.1e}) "
                f"step {self.step_error:.1e} (torch fp32 {self.torch_step_error:.1e}; "
                f"ours vs torch fp32 {max(self.fp32_step_errors.values(), default=0.0):.1e})")
        if extra or missing:
            text += f"; trainables differ: missing {missing[:6]} extra {extra[:6]}"
        if self.strict_load != "ok":
            text += f"; strict load: {self.strict_load[:300]}"
        return text


def perturb(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Random-init models hold equal tensors (LayerNorm weights of 1, zero biases) that the
    exporters merge: make every parameter distinct (in place), as a trained model's are."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g)).add_(0.02 * torch.randn(p.shape, generator=g))
    return module


def export(module: torch.nn.Module, args: tuple, exporter: str, names: list[str], record: bool = False
           ) -> onnx.ModelProto:
    """torch's default export: ``"dynamo"`` is ``torch.onnx.export(m, args, f)``, ``"torchscript"``
    adds ``dynamo=False``. ``record``: then ``record_torch_names(model, module)``, as the docs say
    (always for TorchScript, whose constant folding renames weights)."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, args, f, input_names=names, output_names=["out"], verbose=False)
        else:
            torch.onnx.export(module, args, f, dynamo=False, input_names=names, output_names=["out"])
    model = onnx.load_from_string(f.getvalue())
    if record or exporter == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record_torch_names(model, module)
    return model


def _relative(ours: np.ndarray, theirs: np.ndarray, floor: float) -> float:
    """max |ours - theirs| over max |theirs|, the scale floored (a gradient that is zero in exact math,
    attention's key bias, is rounding noise in both)."""
    return float(np.abs(ours - theirs).max()) / max(float(np.abs(theirs).max()), floor) if theirs.size else 0.0


def check(module: torch.nn.Module, args: tuple, exporter: str = "dynamo", *, names: list[str] | None = None,
          trainable: list[str] | None = None, steps: int = 2, model: onnx.ModelProto | None = None,
          record: bool = False) -> Result:
    """Export ``module`` (eval mode) with ``exporter``'s defaults and compare training it with torch.

    ``trainable``: torch names to train (the others frozen on both sides); default the module's
    ``requires_grad`` parameters, and the builder's default trainables."""
    module = module.eval()
    names = names or [f"x{i}" for i in range(len(args))]
    model = model if model is not None else export(module, args, exporter, names, record)
    reference = copy.deepcopy(module).double()  # the reference: torch in float64 (float32's own error is told apart)
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    result = Result()
    result.expected = {n for n, p in module.named_parameters(remove_duplicate=False)
                       if p.requires_grad and (trainable is None or n in trainable)}
    with torch.no_grad():
        out = module(*args)
    g = np.random.default_rng(0)
    targets = [g.standard_normal(out.shape).astype(np.float32) for _ in range(steps + 1)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            training = ot.build_training_model(model, "mse", ot.Momentum(lr=LR, momentum=0.9), trainable=trainable)
        result.notes = [str(w.message) for w in caught]
    except ot.TrainingOpError as error:
        result.error = str(error)
        return result
    mapping = recorded_names(training)

    def torch_named(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # some initializers' values
        return to_torch_names(values, None if mapping is None else {
            k: e for k, e in mapping.items() if k in values or e.get("alias_of") in values})

    ours_trainable = metadata(training)["trainable"].split(",")
    result.trainables = set(torch_named({n: np.zeros(1) for n in ours_trainable}))
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    probe = ot.TrainingSession(training)
    probe.backward({**feeds, "target": targets[0]})
    ours = torch_named(probe.gradients())
    reference.zero_grad()
    torch.nn.functional.mse_loss(reference(*args64), torch.from_numpy(targets[0]).double()).backward()
    params = dict(reference.named_parameters(remove_duplicate=False))
    grads = {n: p.grad.numpy().copy() for n, p in params.items() if p.grad is not None}
    floor = 1e-4 * max((float(np.abs(g).max()) for g in grads.values() if g.size), default=1.0)
    for n in sorted(result.expected & set(ours) & set(grads)):
        result.grad_errors[n] = _relative(ours[n], grads[n], floor)
    float32 = copy.deepcopy(module)  # torch's own float32 error, for scale
    float32.zero_grad()
    torch.nn.functional.mse_loss(float32(*args), torch.from_numpy(targets[0])).backward()
    result.torch_grad_errors = {n: _relative(p.grad.numpy(), grads[n], floor) for n, p in
                                float32.named_parameters(remove_duplicate=False) if n in result.grad_errors}
    initial = {n: p.detach().numpy().copy() for n, p in params.items()}
    session = ot.TrainingSession(training)
    tracked = [p for n, p in reference.named_parameters() if p.requires_grad and (trainable is None or n in trainable)]
    opt = torch.optim.SGD(tracked, lr=LR, momentum=0.9)
    tracked32 = [p for n, p in float32.named_parameters() if p.requires_grad and (trainable is None or n in trainable)]
    opt32 = torch.optim.SGD(tracked32, lr=LR, momentum=0.9)
    for t in targets[1:]:
        session.step({**feeds, "target": t})
        for net, o, x, y in ((reference, opt, args64, torch.from_numpy(t).double()),
                             (float32, opt32, args, torch.from_numpy(t))):
            o.zero_grad()
            torch.nn.functional.mse_loss(net(*x), y).backward()
            o.step()
    state = session.to_torch_state_dict()
    moved = {n: p.detach().numpy() - initial[n] for n, p in reference.named_parameters(remove_duplicate=False)
             if n in state and n in grads}
    floor = 1e-4 * max((float(np.abs(m).max()) for m in moved.values() if m.size), default=1.0)
    theirs = dict(float32.named_parameters(remove_duplicate=False))
    for n, m in moved.items():  # relative to the update's size (floored as the gradients' are)
        result.step_errors[n] = _relative(state[n].numpy().astype(np.float64) - initial[n], m, floor)
        result.torch_step_errors[n] = _relative(theirs[n].detach().double().numpy() - initial[n], m, floor)
        result.fp32_step_errors[n] = _relative(state[n].numpy().astype(np.float64) - initial[n],
                                               theirs[n].detach().double().numpy() - initial[n], floor)
    try:
        copy.deepcopy(module).load_state_dict(state, strict=True)
    except RuntimeError as error:
        result.strict_load = " ".join(str(error).split())
    return result


# --- the architectures: tiny random configs from transformers, plain torch.nn -----------------------------

class Output(torch.nn.Module):
    """Positional inputs in as keywords, one tensor out (``.logits``, or ``attr`` of the output)."""

    def __init__(self, model: torch.nn.Module, names: list[str], attr: str = "logits"):
        super().__init__()
        self.model, self.names, self.attr = model, names, attr

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)))
        return getattr(out, self.attr) if not isinstance(out, torch.Tensor) else out


def _ids(shape=(2, 8), vocab=64, seed=0) -> torch.Tensor:
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _pixels(size=32, seed=0) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))


TEXT = dict(vocab_size=64, max_position_embeddings=32)
BERTLIKE = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, **TEXT)
DECODER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, use_cache=False,
               **TEXT)


# the TorchScript exporter needs the mask to export transformers' decoders (aten::diff otherwise)
_CAUSAL = {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.int64)}


def _hf(model: str, config: str, inputs: dict, attr: str = "logits", **kwargs):
    def build():
        import transformers
        module = getattr(transformers, model)(getattr(transformers, config)(**kwargs))
        return Output(module, list(inputs), attr), tuple(inputs.values())
    return build


def _clip():
    import transformers
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        projection_dim=8)
    inputs = {"input_ids": _ids((2, 8)), "pixel_values": _pixels(16)}
    return Output(transformers.CLIPModel(config), list(inputs), "logits_per_image"), tuple(inputs.values())


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 3)), (torch.randn(2, 8, generator=torch.Generator().manual_seed(0)),)


def _cnn():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.ReLU(),
                              torch.nn.Conv2d(4, 4, 3, groups=2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(4, 3))
    return net, (_pixels(8),)


ARCHS = {
    "gpt2": _hf("GPT2LMHeadModel", "GPT2Config", _CAUSAL, n_embd=16, n_layer=1, n_head=2, vocab_size=64,
                n_positions=32, use_cache=False),
    "albert": _hf("AlbertForSequenceClassification", "AlbertConfig", {"input_ids": _ids()}, embedding_size=8,
                  num_labels=3, **BERTLIKE),
    "electra": _hf("ElectraForSequenceClassification", "ElectraConfig", {"input_ids": _ids()}, embedding_size=8,
                   num_labels=3, **BERTLIKE),
    "roberta": _hf("RobertaForSequenceClassification", "RobertaConfig", {"input_ids": _ids()}, num_labels=3,
                   pad_token_id=1, **{**BERTLIKE, "max_position_embeddings": 34}),
    "deberta_v2": _hf("DebertaV2ForSequenceClassification", "DebertaV2Config", {"input_ids": _ids()}, num_labels=3,
                      relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"], **BERTLIKE),
    "mobilebert": _hf("MobileBertForSequenceClassification", "MobileBertConfig", {"input_ids": _ids()},
                      num_labels=3, embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8,
                      num_feedforward_networks=1, normalization_type="no_norm", **BERTLIKE),
    "gpt_neox": _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", _CAUSAL, use_parallel_residual=True,
                    rotary_pct=0.5, **DECODER),
    "llama": _hf("LlamaForCausalLM", "LlamaConfig", _CAUSAL, num_key_value_heads=1, **DECODER),
    "mistral": _hf("MistralForCausalLM", "MistralConfig", _CAUSAL, num_key_value_heads=1,
                   sliding_window=4, **DECODER),
    "opt": _hf("OPTForCausalLM", "OPTConfig", _CAUSAL, hidden_size=16, num_hidden_layers=1,
               num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16, vocab_size=64, max_position_embeddings=32),
    "phi": _hf("PhiForCausalLM", "PhiConfig", _CAUSAL, partial_rotary_factor=0.5, **DECODER),
    "clip": _clip,
    # two heads fail in torch's dynamo exporter ("Cannot view a tensor with shape [8, 4, 2, 8]")
    "swin": _hf("SwinForImageClassification", "SwinConfig", {"pixel_values": _pixels(16)}, image_size=16,
                patch_size=2, embed_dim=8, depths=[2, 1], num_heads=[1, 1], window_size=4, num_labels=3),
    "convnext": _hf("ConvNextForImageClassification", "ConvNextConfig", {"pixel_values": _pixels()},
                    hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3),
    "segformer": _hf("SegformerForSemanticSegmentation", "SegformerConfig", {"pixel_values": _pixels()},
                     num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                     num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3,
                     strides=[4, 2], patch_sizes=[7, 3]),
    "mlp": _mlp,
    "cnn": _cnn,
}


def architecture(name: str, perturbed: bool = True) -> tuple[torch.nn.Module, tuple]:
    """The eval-mode module (fixed seed; weights perturbed unless told) and its example inputs."""
    torch.manual_seed(0)
    module, args = ARCHS[name]()
    module = module.eval()
    return (perturb(module) if perturbed else module), args
