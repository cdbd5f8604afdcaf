"""Gradients of torch-exported models (MLP, small CNN, embedding model) equal torch.autograd.

Each model computes its loss inside the exported graph; a Gradient node with ``xs`` = every
parameter (initializer) and ``y`` = the loss is appended, expanded and run in onnxruntime.
Exported with ``torch.onnx.export(..., dynamo=False, do_constant_folding=False)`` at opsets 17
and 18, batch dim dynamic.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from gradient_utils import DOMAIN, runnable, session
from onnx import helper

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


class MLP(nn.Module):
    """Linear/ReLU/LeakyReLU/Tanh/Sigmoid/Dropout, CrossEntropyLoss (SoftmaxCrossEntropyLoss)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(6, 16), nn.Linear(16, 16),
                                              nn.Linear(16, 8), nn.Linear(8, 4))
        self.drop = nn.Dropout(0.3)
        self.loss = nn.CrossEntropyLoss()
        self.register_buffer("decay", torch.tensor(1e-3))  # an initializer that is not in xs

    def forward(self, x, t):
        h = F.relu(self.l1(x))
        h = self.drop(F.leaky_relu(self.l2(h), 0.1))
        h = torch.tanh(self.l3(h)) * torch.sigmoid(self.l3(h))
        return self.loss(self.l4(h), t) + self.decay * (self.l1.weight ** 2).sum()


class CNN(nn.Module):
    """Conv2d (padding, stride, groups), BatchNorm2d (eval), MaxPool2d, AvgPool2d, Flatten,
    Linear, LogSoftmax."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():  # non-trivial running statistics
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2)
        self.c3 = nn.Conv2d(4, 6, 2)
        self.fc = nn.Linear(6 * 1 * 1, 3)

    def forward(self, x, t):
        h = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        h = F.avg_pool2d(torch.sigmoid(self.c2(h)), 2, stride=1)
        h = torch.flatten(self.c3(h), 1)
        logp = torch.log_softmax(self.fc(h), dim=1)
        return -(logp * F.one_hot(t, 3).to(logp.dtype)).sum(1).mean()


class Embedding(nn.Module):
    """nn.Embedding, mean over the sequence, Linear, Softmax + Log + NLLLoss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids, t):
        p = torch.softmax(self.fc(self.emb(ids).mean(dim=1)), dim=1)
        return F.nll_loss(torch.log(p), t)


def _inputs(kind: str, dtype):
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return torch.randn(5, 6, generator=g, dtype=dtype), torch.tensor([0, 1, 2, 3, 0])
    if kind == "cnn":
        return torch.randn(3, 2, 12, 12, generator=g, dtype=dtype), torch.tensor([0, 1, 2])
    ids = torch.randint(0, 20, (4, 6), generator=g)
    ids[0, :3] = 7  # repeated rows must accumulate
    return ids, torch.tensor([0, 1, 2, 0])


MODELS = {"mlp": MLP, "cnn": CNN, "embedding": Embedding}


def _export(module, args, opset: int) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # no constant folding: it would fold eval-mode BatchNorm into the Conv weights
        torch.onnx.export(module, args, f, dynamo=False, opset_version=opset,
                          do_constant_folding=False,
                          input_names=["x", "t"], output_names=["loss"],
                          dynamic_axes={"x": {0: "batch"}, "t": {0: "batch"}})
    return onnx.load_from_string(f.getvalue())


def _with_gradient(model: onnx.ModelProto, params: list[str]) -> onnx.ModelProto:
    outs = [f"grad/{p}" for p in params]
    model.graph.node.append(helper.make_node("Gradient", params, outs, name="loss_grad",
                                             domain=DOMAIN, xs=params, y="loss"))
    model.graph.output.extend(onnx.ValueInfoProto(name=o) for o in outs)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def _compare(kind: str, opset: int, dtype, check):
    torch.manual_seed(0)
    module = MODELS[kind]().to(dtype).eval()
    args = _inputs(kind, dtype)
    model = _export(module, args, opset)
    names = {n for n, _ in module.named_parameters()}
    params = [i.name for i in model.graph.initializer if i.name in names]
    assert sorted(params) == sorted(names), "every parameter should be an initializer"
    expanded = runnable(_with_gradient(model, params))
    onnx.checker.check_model(expanded, full_check=True)  # gradient outputs get typed too
    feeds = {"x": args[0].numpy(), "t": args[1].numpy()}
    got = dict(zip(["loss"] + params,
                   session(expanded).run(["loss"] + [f"grad/{p}" for p in params], feeds)))
    module.zero_grad()
    loss = module(*args)
    loss.backward()
    check(got["loss"], loss.detach().numpy())
    for name, p in module.named_parameters():
        check(got[name], p.grad.numpy(), name)


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_float32_gradients_match_autograd(kind, opset):
    """float32 both sides: max |onnx - torch| within 1e-5 of max |torch| per tensor."""
    def check(a, b, name="loss"):
        assert a.shape == b.shape, name
        scale = max(float(np.abs(b).max()), 1e-12)
        assert float(np.abs(a - b).max()) <= 1e-5 * scale, name

    _compare(kind, opset, torch.float32, check)


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_float64_gradients_match_autograd(kind, opset):
    """float64 (onnxruntime has no float64 Conv, hence no CNN here).

    The exporter casts SoftmaxCrossEntropyLoss's output to float32 (``Cast(to=FLOAT)``) even
    for a float64 model, so the loss and the gradients flowing through it carry float32
    rounding: 1e-6 of max |torch| per tensor (the Cast-back gradient path is exercised)."""
    def check(a, b, name="loss"):
        assert a.shape == b.shape, name
        scale = max(float(np.abs(b).max()), 1e-12)
        assert float(np.abs(a - b).max()) <= 1e-6 * scale, name

    _compare(kind, opset, torch.float64, check)
