"""torch.onnx.export's default (dynamo=True, optimize=True) merges equal initializers, folds
Linear weights into transposed constants and removes zero biases (issue 29, core A). The
builder gives every torch parameter its own initializer back, or names the one it cannot.
Checked against torch itself: the trainables are torch's ``named_parameters`` and a few
AdamW steps give torch's losses, on unperturbed random-init transformers models (equal
LayerNorm weights, zero biases) and a "pretrained body + fresh zero-bias head"."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import onnx_training_ops as ot  # noqa: E402
from onnx_training_ops.builder.dynamo_params import restore_parameters  # noqa: E402
from onnx_training_ops.builder.model_metadata import metadata  # noqa: E402

VOCAB = 40


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def _bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                     use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _pretrained_body():
    """A trained-looking body (no equal tensors) and a fresh classification head with a zero bias."""
    model = _bert()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        model.classifier.bias.zero_()
    return model


MODELS = {"bert": _bert, "gpt2": _gpt2, "pretrained_body": _pretrained_body}


def _export(name: str):
    torch.manual_seed(0)
    module = Logits(MODELS[name]()).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=16)
        torch.onnx.export(module, (ids,), f, input_names=["input_ids"], output_names=["logits"],
                          dynamic_shapes={"input_ids": {0: batch, 1: seq}}, verbose=False)  # the default: dynamo
    return module, onnx.load_from_string(f.getvalue())


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request):
    return (request.param, *_export(request.param))


def _loss(name):
    return ot.CrossEntropyLoss(class_axis=-1) if name == "gpt2" else "cross_entropy"


def _torch_loss(name, logits, labels):
    if name == "gpt2":
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    return torch.nn.functional.cross_entropy(logits, labels)


def _our_names(module, trainables) -> dict[str, str]:
    """torch's parameter name -> the one trainable that is it (a tied parameter, GPT-2's
    wte/lm_head, is one torch parameter under two names: exactly one of them trains)."""
    aliases: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    out = {}
    for n, p in module.named_parameters():
        found = [a for a in aliases[id(p)] if a in trainables]
        assert len(found) == 1, (n, found)
        out[n] = found[0]
    return out


def test_the_default_export_did_lose_parameters(exported):
    """The premise: the default export holds fewer parameter initializers than torch has."""
    name, module, model = exported
    inits = {t.name for t in model.graph.initializer}
    lost = {n for n, _ in module.named_parameters()} - {n.removeprefix("model.") for n in inits} - \
        {n for n in inits}
    assert lost, name


def test_every_torch_parameter_trains_and_matches_torch(exported):
    name, module, model = exported
    with pytest.warns(UserWarning, match="had merged, folded or removed torch parameters"):
        training = ot.build_training_model(model, _loss(name), ot.AdamW(lr=1e-2, eps=1e-12))
    trainables = metadata(training)["trainable"].split(",")
    names = _our_names(module, trainables)
    assert sorted(names.values()) == sorted(trainables)
    session = ot.TrainingSession(training)
    initial = {n: v.copy() for n, v in session.state_dict().items()}
    rng = np.random.default_rng(0)

    def batch(size):  # BERT's padding_idx 0 (pad_token_id) included: the builder keeps torch's zero gradient
        ids = rng.integers(0, VOCAB, (size, 8))
        ids[:, -2:] = 0
        return ids, rng.integers(0, VOCAB if name == "gpt2" else 3, (size, 8) if name == "gpt2" else (size,))

    ids, labels = batch(2)  # gradients first: each torch parameter's own
    probe = ot.TrainingSession(training)  # backward accumulates for optimizer_step: a session of its own
    probe.backward({"input_ids": ids, "labels": labels})
    ours = probe.gradients()
    module.zero_grad()
    _torch_loss(name, module(torch.from_numpy(ids)), torch.from_numpy(labels)).backward()
    for n, p in module.named_parameters():
        np.testing.assert_allclose(ours[names[n]], p.grad.numpy(), rtol=1e-3,
                                   atol=1e-6 + 1e-3 * float(p.grad.abs().max()), err_msg=n)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-12)
    for step in range(3):
        ids, labels = batch(2 + step)
        ours = session.step({"input_ids": ids, "labels": labels})["loss"]
        opt.zero_grad()
        loss = _torch_loss(name, module(torch.from_numpy(ids)), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-4, atol=1e-5, err_msg=f"{name} step {step}")
    state = session.state_dict()
    for n, p in module.named_parameters():  # each trained (as torch's did): no parameter left behind
        assert not np.array_equal(state[names[n]], initial[names[n]]), n
        assert not np.array_equal(p.detach().numpy(), initial[names[n]]), n
    module.load_state_dict(session.to_torch_state_dict(), strict=True)  # GPT-2: wte and lm_head both back


def test_a_parameter_that_cannot_be_restored_is_named(exported):
    """A torch op whose slot for a parameter reads a computed value (not an initializer): the
    build refuses to train it, naming it and the export option that keeps it; frozen, it builds
    (the export computes it right)."""
    name, module, model = exported
    model = onnx.ModelProto.FromString(model.SerializeToString())
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm" and len(n.input) >= 2
                and n.input[1] not in {"m"})
    weight = gemm.input[1]
    # the weight comes from a node now: nothing to restore from
    model.graph.node.insert(0, onnx.helper.make_node("Identity", [weight], ["computed_weight"]))
    gemm.input[1] = "computed_weight"
    for t in list(model.graph.initializer):
        if t.name == weight:
            t.name = "renamed_constant"
            model.graph.node[0].input[0] = "renamed_constant"
    restored = restore_parameters(onnx.ModelProto.FromString(model.SerializeToString()))
    lost = [p for p in restored.lost if p not in {t.name for t in model.graph.initializer}]
    assert lost, restored.lost
    with pytest.raises(ot.TrainingOpError, match=r"optimize=False.*do_constant_folding=False") as info:
        ot.build_training_model(model, _loss(name), ot.Adam())
    assert lost[0] in str(info.value)
    frozen_lost = [n for n, _ in module.named_parameters() if n not in lost and n in restored_inits(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = ot.build_training_model(model, _loss(name), ot.Adam(), trainable=frozen_lost)
    assert sorted(metadata(training)["trainable"].split(",")) == sorted(frozen_lost)


def restored_inits(model) -> set[str]:
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restore_parameters(copy)
    return {t.name for t in copy.graph.initializer}


def test_an_export_with_optimize_false_is_left_alone():
    torch.manual_seed(0)
    module = Logits(_bert()).eval()
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(2, 8, dtype=torch.int64),), f, input_names=["input_ids"],
                          optimize=False, verbose=False)
    model = onnx.load_from_string(f.getvalue())
    before = model.graph.SerializeToString()
    assert not restore_parameters(model)
    assert model.graph.SerializeToString() == before  # only torch's names recorded, for to_torch_state_dict
    assert set(json.loads(next(p.value for p in model.metadata_props if p.key == "torch.state_dict_names"))) == \
        {n for n, _ in module.state_dict().items() if n in {t.name for t in model.graph.initializer}}


def test_without_fx_metadata_missing_parameters_are_named(exported):
    """An export whose nodes carry no fx_node metadata (another torch version): nothing can be
    restored, but the parameters the ONNX model lacks are named, never passed over silently."""
    name, module, model = exported
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.fx_node"]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    with pytest.warns(UserWarning, match=r"are not initializers of the model.*optimize=False"):
        assert not restore_parameters(model)


def test_batchnorm_folded_into_conv_is_refused():
    """optimize=True folds an eval-mode BatchNorm into the Conv before it: the Conv weight keeps
    torch's name but holds weight * gamma / sigma. Nothing to restore: a named error."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.LazyLinear(2))
    x = torch.randn(2, 3, 6, 6)
    module(x)
    module.eval()
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), f, input_names=["x"], dynamic_shapes=({0: torch.export.Dim("b")},),
                          verbose=False)
    model = onnx.load_from_string(f.getvalue())
    with pytest.raises(ot.TrainingOpError, match=r"1.weight, 1.bias, 0.weight: optimize=True folded this BatchNorm "
                                                 r"into the convolution before it.*optimize=False"):
        ot.build_training_model(model, "cross_entropy", ot.Adam(), mode="train")
    with pytest.warns(UserWarning, match=r"3 frozen torch parameter\(s\) stay as the exporter folded"):
        head = ot.build_training_model(model, "cross_entropy", ot.Adam(), trainable=["4.weight", "4.bias"])
    assert metadata(head)["trainable"] == "4.weight,4.bias"  # the folded Conv is right while frozen
