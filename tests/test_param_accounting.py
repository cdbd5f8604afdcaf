"""torch's default export trains exactly torch's parameters, or the build names the ones it cannot
(issue 36 items 1-7). Each repro is a module that the default export (dynamo, optimize=True; or
TorchScript with do_constant_folding=True) used to train wrongly without a word; each is
checked against torch itself (``param_parity.check``: the trainables are torch's
``requires_grad`` parameters, gradients and the weights after two steps of SGD with momentum
equal torch's in float64 to 1e-4 relative, or to within 4x torch float32's own error where
that is larger, and ``to_torch_state_dict()`` loads with ``strict=True``)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from param_parity import check, export, perturb  # noqa: E402

import onnx_training_ops as ot  # noqa: E402
from onnx_training_ops.builder.folded_params import Ambiguous, find_recipe, invert  # noqa: E402
from onnx_training_ops.builder.model_metadata import metadata  # noqa: E402
from onnx_training_ops.training.state.torch_names import record_torch_names  # noqa: E402
from onnx_training_ops.training.summary import summary  # noqa: E402

nn = torch.nn
TOL = 1e-4


class ConstLookup(nn.Module):
    """Position ids from a buffer: the dynamo export folds pos(pos_ids) into a constant."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(10, 8), nn.Embedding(6, 8), nn.Linear(8, 3)
        self.register_buffer("pos_ids", torch.arange(6)[None], persistent=False)

    def forward(self, ids):
        return self.fc((self.tok(ids) + self.pos(self.pos_ids[:, :ids.shape[1]])).mean(1))


class TwoNorms(nn.Module):
    """Two fresh LayerNorms of one input (GPT-NeoX's parallel residual): merged into one node."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2, self.fc1, self.fc2 = nn.LayerNorm(8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fc1(self.ln1(x)) + torch.tanh(self.ln2(x)))


class TiedMatmul(nn.Module):
    """A tied head written as a matmul: ``emb.weight.t()`` is folded into a constant."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids):
        return self.emb(ids) @ self.emb.weight.t()


class ExpScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.log_s = nn.Linear(8, 5), nn.Parameter(torch.randn(5) * 0.1)

    def forward(self, x):
        return self.lin(x) * torch.exp(self.log_s)


class SumUse(nn.Module):
    """``w`` read twice: by the matmul, and by ``w.sum(0)`` (folded into a stale constant)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return x @ self.w + self.w.sum(0) * 0.1


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Rms(nn.Module):
    """Fresh RMSNorm weights (all ones) merged into one initializer that two Muls read."""

    def __init__(self):
        super().__init__()
        self.n1, self.mid, self.n2, self.fc = RMSNorm(8), nn.Linear(8, 8), RMSNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.n2(self.mid(self.n1(x))))


class Scalar(nn.Module):
    """A rank-0 parameter (CLIP's logit_scale)."""

    def __init__(self):
        super().__init__()
        self.fc, self.logit_scale = nn.Linear(8, 3), nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.fc(x) * self.logit_scale.exp()


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class OnesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) + torch.ones(4)


def _ids():
    return (torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(3)),)


def _x(*shape):
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(3)),)


# name: (module, inputs, perturb: random-init equal tensors kept where the repro is about them)
REPROS = {
    "const_lookup": (ConstLookup, _ids, True),
    "two_norms": (TwoNorms, _x(2, 8), False),
    "tied_matmul": (TiedMatmul, _ids, True),
    "exp_scale": (ExpScale, _x(2, 8), True),
    "sum_use": (SumUse, _x(2, 8), True),
    "rms": (Rms, _x(2, 5, 8), False),
    "scalar": (Scalar, _x(2, 8), True),
    "tied_head": (TiedHead, _ids, True),
    "ones": (OnesInForward, _x(2, 8), True),
}


def _module(name):
    torch.manual_seed(0)
    cls, inputs, perturbed = REPROS[name]
    module = cls().eval()
    return (perturb(module) if perturbed else module), inputs()


def _assert_parity(result):
    assert not result.error, result.error
    assert result.trainables == result.expected, result.summary()
    assert result.within(TOL), result.summary()
    assert result.strict_load == "ok", result.strict_load
    assert set(result.grad_errors) == result.expected  # every parameter's gradient compared


@pytest.mark.parametrize("name", [n for n in REPROS if n != "const_lookup"])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_default_export_trains_torchs_parameters(name, exporter):
    """Before: two_norms' ln2 missing (ln1's gradient 0.71 off), tied_matmul's gradient 0.49 off
    (both exporters), exp_scale's log_s and scalar's logit_scale never trained, sum_use's
    gradient 0.0375 off, rms refused, tied_head lost emb.weight and ones came back as an
    unexpected key in to_torch_state_dict()."""
    module, args = _module(name)
    _assert_parity(check(module, args, exporter))


def test_tied_copy_of_a_torchscript_export_without_a_record():
    """The TorchScript exporter's constant folding stores ``emb.weight.t()`` as a constant of its
    own (onnx::MatMul_...): without record_torch_names, the builder still finds it is the
    transpose of emb.weight, so the tie trains as one tensor (before: 0.49 gradient error)."""
    module, args = _module("tied_matmul")
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, dynamo=False, input_names=["x0"], output_names=["out"])
    model = onnx.load_from_string(f.getvalue())
    assert any("::" in t.name for t in model.graph.initializer)  # the folded copy
    _assert_parity(check(module, args, "torchscript", model=model))


def test_constant_index_lookup_is_named_then_restored_from_the_module():
    """pos(pos_ids) is folded into a constant holding 5 of the table's 6 rows: the model alone
    cannot give pos.weight back. The build names it and the remedies; frozen, it builds; after
    record_torch_names(model, module) it is restored (Gather with the constant ids) and trains
    as torch's."""
    module, args = _module("const_lookup")
    model = export(module, args, "dynamo", ["x0"])
    with pytest.raises(ot.TrainingOpError, match=r"pos\.weight.*embedding_1.*optimize=False.*record_torch_names"):
        ot.build_training_model(model, "mse", ot.Adam())
    with pytest.warns(UserWarning, match=r"1 frozen torch parameter\(s\) stay as the exporter folded"):
        frozen = ot.build_training_model(model, "mse", ot.Adam(), trainable=["tok.weight", "fc.weight", "fc.bias"])
    assert metadata(frozen)["trainable"] == "tok.weight,fc.weight,fc.bias"
    with pytest.raises(ot.TrainingOpError, match=r"pos\.weight"):
        ot.build_training_model(model, "mse", ot.Adam(), trainable=["pos.weight"])
    _assert_parity(check(module, args, "dynamo", record=True))
    _assert_parity(check(module, args, "torchscript"))


def test_frozen_merged_rmsnorm_weights_do_not_block_the_build():
    """Item 5: a merged parameter read by a Mul (RMSNorm, NoNorm) left frozen builds (LoRA on the
    default export of Llama): it trains the named trainables only, as torch with the others frozen."""
    module, args = _module("rms")
    for p in (*module.n1.parameters(), *module.n2.parameters(), *module.mid.parameters()):
        p.requires_grad_(False)
    _assert_parity(check(module, args, "dynamo", trainable=["fc.weight", "fc.bias"]))


def test_summary_counts_torchs_parameters():
    """Before: summary() of exp_scale's default export counted 45 trainable elements, torch 50
    (log_s folded into the constant exp)."""
    module, args = _module("exp_scale")
    model = export(module, args, "dynamo", ["x0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = ot.build_training_model(model, "mse", ot.Adam())
    assert summary(training).trainable_count == sum(p.numel() for p in module.parameters()) == 50


def test_lost_parameter_that_would_train_is_refused_with_its_remedies():
    """A parameter folded with another one into a constant cannot be computed again: named,
    with the options that keep it; frozen (by trainable or a frozen group), the build goes on."""

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.fc = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8)), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(x * (self.a * self.b))

    torch.manual_seed(0)
    module = Both().eval()
    model = export(module, (torch.randn(2, 8),), "dynamo", ["x0"])
    with pytest.raises(ot.TrainingOpError, match=r"torch parameter\(s\) a, b .*folded with b into the constant"):
        ot.build_training_model(model, "mse", ot.Adam())
    with pytest.warns(UserWarning, match="2 frozen torch parameter"):
        built = ot.build_training_model(model, "mse", ot.Adam(), param_groups=[{"params": ["a", "b", "fc.bias"],
                                                                                "frozen": True}])
    assert metadata(built)["trainable"] == "fc.weight"


# ---- how a folded constant is computed from its parameter again (builder/folded_params.py) ----

P = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)


@pytest.mark.parametrize("constant, ops", [
    (P.T.copy(), ["Transpose"]),  # a tied head's emb.weight.t()
    (P[None, :5].copy(), ["Gather", "Reshape"]),  # position ids 0..4
    (np.broadcast_to(P[0], (1, 5, 8)).copy(), ["Gather", "Reshape"]),  # token type ids all 0
    (np.transpose(P[np.array([[0, 1], [2, 3]])], (2, 0, 1)).copy(), ["Gather", "Reshape", "Transpose"]),  # Swin
    (np.exp(P), ["Exp"]),
    ((P.sum(0) * np.float32(0.1)).astype(np.float32), ["ReduceSum", "Mul"]),
    ((1 + P).astype(np.float32), ["Add"]),  # Gemma's 1 + weight
    (P.mean(1, keepdims=True), ["ReduceMean"]),
])
def test_recipe_computes_the_constant_from_the_parameter(constant, ops):
    recipe = find_recipe(constant, P)
    assert [s.op for s in recipe.steps] == ops
    np.testing.assert_allclose(recipe.apply(P), constant, rtol=1e-6)


def test_recipe_broadcast_and_unrelated():
    row = P[0].copy()
    assert [s.op for s in find_recipe(np.broadcast_to(row, (3, 1, 8)).copy(), row).steps] == ["Reshape", "Expand"]
    assert find_recipe(np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32), P) is None


def test_recipe_refuses_what_it_cannot_tell_apart():
    """Repeated rows or one repeated value: which element's gradient is which cannot be told."""
    with pytest.raises(Ambiguous, match="all its values are equal"):
        find_recipe(np.ones(8, np.float32), np.ones(8, np.float32))
    repeated = np.concatenate([P[:2], P[:1]])
    with pytest.raises(Ambiguous, match="repeats"):
        find_recipe(repeated[[2, 1]].copy(), repeated)


def test_invert_a_constant_named_by_its_torch_op():
    value, recipe = invert(np.exp(np.array(2.6592, np.float32)), "exp")
    assert value.shape == () and abs(float(value) - 2.6592) < 1e-6 and recipe.steps[0].op == "Exp"
    assert invert(P, "embedding_1") is None


def test_record_from_a_state_dict_has_no_parameter_list():
    """record_torch_names still takes a bare state_dict (no requires_grad: default trainables by
    the model's own rule)."""
    module, args = _module("tied_head")
    model = export(module, args, "dynamo", ["x0"])
    record_torch_names(model, module.state_dict())
    assert not any(p.key == "torch.parameters" for p in model.metadata_props)


# ---- real architectures: tiny random transformers models, torch's default export ----

@pytest.mark.parametrize("name, perturbed, record", [
    ("gpt2", True, True),  # the tie: one of wte, lm_head is read, both come back; wpe rows folded
    ("gpt_neox", False, False),  # fresh: the parallel residual's two LayerNorms merged into one node
    ("mobilebert", False, True),  # fresh NoNorm weights merged behind Muls; position rows folded
    ("clip", True, True),  # logit_scale (rank 0, exp folded), class_embedding broadcast, position rows
])
def test_architecture_trains_as_torch(name, perturbed, record):
    pytest.importorskip("transformers")
    from param_parity import architecture

    module, args = architecture(name, perturbed=perturbed)
    _assert_parity(check(module, args, "dynamo", record=record))


def test_lora_on_the_default_export_of_llama_builds_with_the_adapters_trainable():
    """Item 5: fresh RMSNorm weights are merged and read by Muls; with the adapters trainable
    (torch's requires_grad ones, given explicitly or recorded from the module) it builds and
    trains as peft does."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from param_parity import ARCHS

    torch.manual_seed(0)
    module, args = ARCHS["llama"]()
    module.model = peft.get_peft_model(module.model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                     lora_dropout=0.0))
    module.eval()
    with torch.no_grad():  # a trained adapter: lora_B away from zero, so the gradients reach lora_A
        for n, p in module.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    adapters = [n for n, p in module.named_parameters() if p.requires_grad]
    assert len(adapters) == 4
    _assert_parity(check(module, args, "dynamo", trainable=adapters))
    _assert_parity(check(module, args, "dynamo", record=True))  # default trainables: torch's requires_grad
    # TorchScript's constant folding renames lora_A/lora_B (onnx::MatMul_...): torch's names still work
    _assert_parity(check(module, args, "torchscript", trainable=adapters))


def test_batchnorm_folded_by_torchscript_constant_folding_is_refused():
    """do_constant_folding=True (TorchScript's default) folds an eval-mode BatchNorm into the Conv
    before it, under exporter names: the fused weight is no torch parameter. Refused, without a
    record (the fused tensor would train) and with one (the Conv's and BatchNorm's parameters,
    found by value); frozen, it builds."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
    with torch.no_grad():
        module[1].running_mean.normal_()
        module[1].running_var.uniform_(0.5, 2)
    module = perturb(module.eval())
    x = torch.randn(2, 3, 4, 4)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), f, dynamo=False, input_names=["x"], output_names=["out"])
    model = onnx.load_from_string(f.getvalue())
    with pytest.raises(ot.TrainingOpError, match=r"onnx::Conv_\d+.*folded into the convolution"):
        ot.build_training_model(model, "mse", ot.Adam())
    record_torch_names(model, module)
    with pytest.raises(ot.TrainingOpError, match=r"0\.weight, 0\.bias, 1\.weight, 1\.bias: do_constant_folding=True "
                                                 r"folded BatchNorm '1' into Conv '0'"):
        ot.build_training_model(model, "mse", ot.Adam())
    with pytest.warns(UserWarning, match="frozen torch parameter"):
        head = ot.build_training_model(model, "mse", ot.Adam(), trainable=["4.weight", "4.bias"])
    assert metadata(head)["trainable"] == "4.weight,4.bias"
