"""mode="train": BatchNorm on batch statistics with torch's running-statistic updates, and
Dropout with a fresh, seeded, resumable mask each step — against torch's model.train()."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

import onnx_training_ops as ot
from onnx_training_ops.builder import metadata

torch = pytest.importorskip("torch")
nn = torch.nn


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before a BatchNorm (as ResNets): its exact gradient would be 0, and an
        # adaptive optimizer would turn the rounding noise into steps of size lr
        self.conv = nn.Conv2d(2, 3, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(3, momentum=0.2)
        self.fc = nn.Linear(3 * 4 * 4, 5, bias=False)
        self.bn1 = nn.BatchNorm1d(5)

    def forward(self, x):
        h = torch.relu(self.bn2(self.conv(x)))
        return self.bn1(self.fc(h.flatten(1)))


def _export(module, x, training=torch.onnx.TrainingMode.EVAL) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), f, dynamo=False, opset_version=17, training=training,
                          do_constant_folding=False, input_names=["x"], output_names=["y"])
    return onnx.load_from_string(f.getvalue())


def _model():
    torch.manual_seed(0)
    module = ConvBN()
    with torch.no_grad():  # no two equal tensors (the exporter would merge them)
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape))
        module.bn2.running_mean.uniform_(-0.5, 0.5)
        module.bn2.running_var.uniform_(0.5, 1.5)
    x = torch.randn(4, 2, 6, 6)
    return module, _export(module.eval(), x), x


@pytest.mark.parametrize("optimizer", ["momentum", "adagrad"])
def test_batchnorm_train_mode_matches_torch(optimizer):
    module, model, x = _model()
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((4, 2, 6, 6)).astype(np.float32),
                rng.integers(0, 5, 4).astype(np.int64)) for _ in range(3)]
    if optimizer == "adagrad":
        ours = ot.Adagrad(lr=0.05)
        theirs = torch.optim.Adagrad(module.parameters(), lr=0.05)
    else:
        ours = ot.Momentum(lr=0.1, momentum=0.9)
        theirs = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    training = ot.build_training_model(model, "cross_entropy", ours, mode="train")
    assert metadata(training)["mode"] == "train"
    session = ot.TrainingSession(training)
    module.train()
    for xb, yb in batches:
        got = session.step({"x": xb, "labels": yb})
        theirs.zero_grad()
        loss = nn.functional.cross_entropy(module(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        theirs.step()
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    state = session.state_dict()
    for name, value in module.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue
        np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    # the main graph stays the eval-mode graph: it reads the updated running statistics
    module.eval()
    np.testing.assert_allclose(session.run(["y"], {"x": batches[0][0]})[0],
                               module(torch.from_numpy(batches[0][0])).detach().numpy(),
                               rtol=1e-4, atol=1e-5)


def test_eval_mode_is_unchanged_and_running_statistics_never_train():
    module, model, x = _model()
    training = ot.build_training_model(model, "cross_entropy", ot.Adam())
    assert metadata(training)["mode"] == "eval"
    bound = {b.key for b in training.training_info[0].update_binding}
    for stat in ("bn2.running_mean", "bn2.running_var", "bn1.running_var"):
        assert stat not in metadata(training)["trainable"].split(",") and stat not in bound
    session = ot.TrainingSession(training)
    before = session.export_inference_model()
    session.step({"x": x.numpy(), "labels": np.zeros(4, np.int64)})
    after = session.export_inference_model()
    values = lambda m: {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}  # noqa: E731
    np.testing.assert_array_equal(values(after)["bn2.running_var"], values(before)["bn2.running_var"])


def _dropout_model(p=0.4):
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(50, 200), nn.Dropout(p), nn.Linear(200, 3))
    return module, _export(module.train(), torch.randn(8, 50), torch.onnx.TrainingMode.TRAINING)


def _dropout_outputs(p: float, steps: list[int], seed: int = 7, shape=(200, 500)):
    """Run the training-mode copy of a lone Dropout node at the given step counts."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from onnx_training_ops.passes._graph import unique_name
    from onnx_training_ops.train_mode import training_forward
    graph = helper.make_graph(
        [helper.make_node("Dropout", ["x", "ratio"], ["y"], name="drop")], "d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(np.array(p, np.float32), "ratio")])
    taken: set = set()
    nodes, renamed, _ = training_forward(graph, {}, 17, "T", seed,
                                         lambda base: unique_name(taken, base))
    model = helper.make_model(helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
                     helper.make_tensor_value_info("T", TensorProto.INT64, [])],
        [helper.make_tensor_value_info(renamed["y"], TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(np.array(p, np.float32), "ratio")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.ones(shape, np.float32)
    return [sess.run(None, {"x": x, "T": np.array(t, np.int64)})[0] for t in steps]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_mask_rate_scale_and_fresh_masks(p):
    y0, y1, y0_again = _dropout_outputs(p, [0, 1, 0])
    kept0, kept1 = y0 != 0, y1 != 0
    n = y0.size
    assert abs((1 - kept0.mean()) - p) < 4 * np.sqrt(p * (1 - p) / n)  # binomial, 4 sigma
    np.testing.assert_allclose(y0[kept0], 1 / (1 - p), rtol=1e-6)  # torch's scaling
    np.testing.assert_array_equal(y0, y0_again)  # a function of (seed, node, step)
    # consecutive steps are independent: both kept with probability (1 - p)^2
    both = (kept0 & kept1).mean()
    assert abs(both - (1 - p) ** 2) < 4 * np.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / n)
    # rows and columns carry no pattern
    assert np.abs(kept0.mean(axis=0) - (1 - p)).max() < 6 * np.sqrt(p * (1 - p) / 200)
    assert not np.array_equal(_dropout_outputs(p, [0], seed=8)[0], y0)


def test_dropout_training_is_seeded_and_resumes_bit_exact(tmp_path):
    module, model = _dropout_model(0.4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 50)).astype(np.float32)
    target = rng.standard_normal((8, 3)).astype(np.float32)
    out = model.graph.output[0].name
    module.eval()  # the main graph is the eval-mode graph: no dropout at inference
    fresh = ot.TrainingSession(ot.build_training_model(model, "mse", ot.Adam(), mode="train"))
    np.testing.assert_allclose(fresh.run([out], {"x": x})[0],
                               module(torch.from_numpy(x)).detach().numpy(), rtol=1e-5,
                               atol=1e-6)

    def run(seed, steps, session=None):
        session = session or ot.TrainingSession(ot.build_training_model(
            model, "mse", ot.Momentum(lr=0.05, momentum=0.9), mode="train", seed=seed))
        losses = [float(session.step({"x": x, "target": target})["loss"]) for _ in range(steps)]
        return session, losses
    (a, la), (_, lb), (_, lc) = run(7, 4), run(7, 4), run(8, 4)
    assert la == lb and la != lc
    assert len(set(la)) == 4  # a fresh mask each step
    half, _ = run(7, 2)
    half.save(tmp_path / "half.onnx")
    resumed, lr_ = run(7, 2, ot.TrainingSession(str(tmp_path / "half.onnx")))
    assert lr_ == la[2:]
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value)
