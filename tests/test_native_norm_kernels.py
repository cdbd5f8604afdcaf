"""The native train-mode BatchNorm backward and batch statistics (``ai.onnx.contrib::
TrainingBatchNormGrad``, ``TrainingBatchStats``): against the standard-op forms (float32, and
float64 checked by finite differences), on ranks 2-5, a constant channel, N=1; torch parity
of a few steps; the ResNet-style step."""

from __future__ import annotations

import numpy as np
import pytest
from gradient_utils import finite_difference, forward_fn, gradient_model
from onnx import helper

import onnx_training_ops as ot
from onnx_training_ops.autodiff.rules_norm import BATCH_STATISTICS_DOC
from onnx_training_ops.runtime import native

pytestmark = pytest.mark.skipif(not native.availability()[0], reason="native kernels unavailable here")

OP, STATS = "TrainingBatchNormGrad", "TrainingBatchStats"
EPS = 1e-3


def _bn_nodes(rank: int):
    """The builder's form (``builder/train_mode.py``): batch mean and biased variance, then
    the marked BatchNormalization; ``loss = sum(y * r)`` (r: a fixed random weight)."""
    axes = helper.make_tensor("axes", 7, [rank - 1], [0] + list(range(2, rank)))
    flat = helper.make_tensor("flat", 7, [1], [-1])
    return [
        helper.make_node("Constant", [], ["axes"], value=axes),
        helper.make_node("Constant", [], ["flat"], value=flat),
        helper.make_node("ReduceMean", ["x", "axes"], ["m4"], keepdims=1),
        helper.make_node("Sub", ["x", "m4"], ["xc"]),
        helper.make_node("Mul", ["xc", "xc"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["v4"], keepdims=1),
        helper.make_node("Reshape", ["m4", "flat"], ["mean"]),
        helper.make_node("Reshape", ["v4", "flat"], ["var"]),
        helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], epsilon=EPS,
                         doc_string=BATCH_STATISTICS_DOC),
        helper.make_node("Mul", ["y", "r"], ["yr"]),
        helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0),
    ]


def _feeds(shape, seed=0, constant_channel=False):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape) * 2 + 0.5
    if constant_channel:
        x[:, 0] = 3.0  # variance 0: inv = 1/sqrt(eps)
    return {"x": x, "scale": rng.standard_normal(c) + 1.0, "bias": rng.standard_normal(c),
            "r": rng.standard_normal(shape)}


XS = ["x", "scale", "bias"]
CASES = [((4, 3, 7), False), ((2, 5, 6, 5), False), ((2, 3, 3, 4, 5), False), ((1, 4, 5, 6), False),
         ((3, 4, 5, 5), True), ((6, 3), False)]


@pytest.mark.parametrize("shape,constant", CASES, ids=str)
def test_native_equals_the_standard_rule_and_finite_differences(shape, constant):
    nodes = _bn_nodes(len(shape))
    feeds = _feeds(shape, seed=len(shape), constant_channel=constant)
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    outs = ["loss"] + [f"d_{x}" for x in XS]
    model = gradient_model(nodes, f32, "loss", XS, opset=18)
    prepared = ot.prepare(model, kernels="native")
    ran = [n.op_type for n in prepared.graph.node]
    assert ran.count(OP) == ran.count(STATS) == 1 and "ReduceMean" not in ran  # the statistics too
    for other in (ot.prepare(model, kernels="pyop"), ot.prepare(model, portable=True)):
        assert not {OP, STATS} & {n.op_type for n in other.graph.node}
    got = ot.InferenceSession(prepared).run(outs, f32)
    want = ot.InferenceSession(ot.prepare(model, portable=True)).run(outs, f32)
    model64 = gradient_model(nodes, feeds, "loss", XS, opset=18)
    exact = ot.InferenceSession(ot.prepare(model64, portable=True)).run(outs, feeds)
    for name, a, b, e in zip(outs, got, want, exact):
        scale = np.abs(e).max()
        assert np.abs(a - e).max() <= 1e-6 * scale, name  # native float32 vs float64
        assert np.abs(a - b).max() <= 1e-5 * scale, name  # vs the standard rule's float32
    f = forward_fn(nodes, feeds, "loss", 18)
    for name, g in zip(XS, exact[1:]):
        idx, fd = finite_difference(f, feeds, name, 1e-6, max_elements=20)
        np.testing.assert_allclose(g.reshape(-1)[idx], fd, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_wrong_input_is_an_error_naming_the_node():
    names = ["dy", "x", "scale", "mean", "var", "eps"]
    node = helper.make_node(OP, names, ["dx", "ds", "db"], domain="ai.onnx.contrib", name="bn_grad_1")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, 1, None) for n in names],
                              [helper.make_tensor_value_info(n, 1, None) for n in ("dx", "ds", "db")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.contrib", 1)])
    model.ir_version = 8
    session = ot.InferenceSession(model)
    x = np.ones((2, 3, 4), np.float32)
    c = np.ones(3, np.float32)
    feeds = dict(dy=x, x=x, scale=c, mean=c, var=c, eps=np.array(1e-5, np.float32))
    assert session.run(None, feeds)[0].shape == x.shape
    with pytest.raises(Exception, match="bn_grad_1"):
        session.run(None, {**feeds, "var": np.ones(4, np.float32)})
    with pytest.raises(Exception, match="bn_grad_1"):
        session.run(None, {**feeds, "dy": np.ones((2, 3, 5), np.float32)})


def _conv_bn_relu(torch):
    """Conv-BN-ReLU twice and a residual (ResNet's basic block, small), parameters perturbed
    (the exporter would merge equal ones)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
            self.conv2, self.bn2 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            h = torch.relu(self.bn1(self.conv1(x)))
            h = torch.relu(h + self.bn2(self.conv2(h)))
            return self.fc(h.mean((2, 3)))

    torch.manual_seed(0)
    module = Block()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return module


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_train_mode_steps_match_torch_and_the_step_runs_the_native_op(optimizer):
    import io
    import warnings

    import onnx

    torch = pytest.importorskip("torch")
    module = _conv_bn_relu(torch)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.randn(4, 3, 8, 8),), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["x"], output_names=["y"])
    if optimizer == "adamw":  # a tiny eps: ONNX adds it before the bias correction, torch after
        ours, theirs = ot.AdamW(lr=0.01, eps=1e-12, weight_decay=0.1), torch.optim.AdamW(
            module.parameters(), lr=0.01, eps=1e-12, weight_decay=0.1)
    else:
        ours, theirs = ot.Momentum(lr=0.1, momentum=0.9), torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    training = ot.build_training_model(onnx.load_from_string(f.getvalue()), "cross_entropy", ours, mode="train")
    session = ot.TrainingSession(training)
    ran = [n.op_type for n in session._programs.steps[0].session.prepared_model.graph.node]
    assert ran.count(OP) == 2
    for kwargs, count in ((dict(kernels="native"), 2), (dict(kernels="pyop"), 0), (dict(portable=True), 0)):
        step = [n.op_type for n in ot.prepare(training, **kwargs).training_info[0].algorithm.node]
        assert step.count(OP) == step.count(STATS) == count, kwargs
    module.train()
    rng = np.random.default_rng(1)
    for _ in range(3):
        x, y = rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 4).astype(np.int64)
        got = session.step({"x": x, "labels": y})
        theirs.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        theirs.step()
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5, atol=1e-6)
    state = session.state_dict()
    for name, value in module.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def test_shapes_read_through_the_older_api_too(monkeypatch):
    """Below API 24 the kernels read shapes with GetTensorTypeAndShape (forced here): the
    same bits as through the shape reference."""
    from onnx_training_ops.runtime import custom_op

    shape = (2, 5, 6, 5)
    f32 = {k: v.astype(np.float32) for k, v in _feeds(shape).items()}
    outs = ["loss"] + [f"d_{x}" for x in XS]
    model = gradient_model(_bn_nodes(len(shape)), f32, "loss", XS, opset=18)
    referenced = ot.InferenceSession(ot.prepare(model, kernels="native")).run(outs, f32)
    monkeypatch.setattr(custom_op, "USE_SHAPE_REFERENCE", False)
    older = ot.InferenceSession(ot.prepare(model, kernels="native")).run(outs, f32)
    for a, b in zip(older, referenced):
        np.testing.assert_array_equal(a, b)
