"""mode="train": BatchNorm on batch statistics with torch's running-statistic updates, and
Dropout with a fresh, seeded, resumable mask each step — against torch's model.train(),
SplitMix64's published outputs and onnx's reference evaluator."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnx_training_ops as ot
from onnx_training_ops.builder.eval_mode import to_inference
from onnx_training_ops.builder.model_metadata import metadata
from onnx_training_ops.builder.train_mode import GAMMA, _Emit, dropout_keep, splitmix64, stream_key, training_forward
from onnx_training_ops.passes._graph import unique_name

torch = pytest.importorskip("torch")
nn = torch.nn
F32_TOL = dict(rtol=1e-5, atol=1e-6)


class ConvBN(nn.Module):
    """Conv + BatchNorm2d twice (equal fresh running statistics: the exporter ties them) and
    Linear + BatchNorm1d. No bias before a BatchNorm, as in ResNets: its exact gradient is 0
    and an adaptive optimizer would turn the rounding noise into steps of size lr."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(3, momentum=0.2)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 5, bias=False)
        self.bn3 = nn.BatchNorm1d(5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        return self.bn3(self.fc(h.flatten(1)))


def _export(module, x, opset=17, training=None, dynamo=False) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:  # onnxscript's optimizer folds BatchNorm into the Conv: optimize=False
            return torch.onnx.export(module, (x,), dynamo=True, optimize=False, verbose=False,
                                     input_names=["x"], output_names=["y"]).model_proto
        f = io.BytesIO()
        torch.onnx.export(module, (x,), f, dynamo=False, opset_version=opset,
                          training=training or torch.onnx.TrainingMode.EVAL,
                          do_constant_folding=False, input_names=["x"], output_names=["y"])
    return onnx.load_from_string(f.getvalue())


def _module() -> ConvBN:
    torch.manual_seed(0)
    module = ConvBN()
    with torch.no_grad():  # no two equal parameters (the exporter would tie them)
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return module


def _batches(steps=3):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((4, 2, 6, 6)).astype(np.float32),
             rng.integers(0, 5, 4).astype(np.int64)) for _ in range(steps)]


def _optimizers(name, module):
    if name == "adam":  # ONNX adds eps before the bias correction, torch after: equal at 0,
        # and a tiny eps keeps 0/0 away where a gradient is exactly zero
        return (ot.Adam(lr=0.01, eps=1e-12),
                torch.optim.Adam(module.parameters(), lr=0.01, eps=1e-12))
    return (ot.Momentum(lr=0.1, momentum=0.9),
            torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))


def _train_both(model, module, optimizer, steps=3, fast=True):
    """``steps`` steps of ours (mode="train") and of torch (model.train()); the losses."""
    ours, theirs = _optimizers(optimizer, module)
    session = ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ours,
                                                         mode="train"), fast=fast)
    module.train()
    for xb, yb in _batches(steps):
        got = session.step({"x": xb, "labels": yb})
        theirs.zero_grad()
        loss = nn.functional.cross_entropy(module(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        theirs.step()
        np.testing.assert_allclose(got["loss"], loss.item(), **F32_TOL)
    return session


def _assert_state_matches(state, module):
    for name, value in module.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(state[name], value.numpy(), **F32_TOL, err_msg=name)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "graph"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_batchnorm_train_mode_matches_torch(optimizer, fast):
    module = _module()
    model = _export(module.eval(), torch.randn(4, 2, 6, 6))
    tied = {n.output[0] for n in model.graph.node if n.op_type == "Identity"}
    assert {"bn2.running_mean", "bn2.running_var"} <= tied  # the exporter tied them to bn1's
    session = _train_both(model, module, optimizer, fast=fast)
    _assert_state_matches(session.state_dict(), module)
    assert not any(n.startswith("bn") and "running" in n and n.endswith((".V", ".H"))
                   for n in session.state_names)  # state, never an optimizer's
    # the exported inference model: the eval graph with the new running statistics
    module.eval()
    exported = session.export_inference_model()
    assert not exported.training_info
    x = _batches(4)[3][0]
    plain = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(plain.run(["y"], {"x": x})[0],
                               module(torch.from_numpy(x)).detach().numpy(), **F32_TOL)
    np.testing.assert_allclose(session.run(["y"], {"x": x})[0], plain.run(["y"], {"x": x})[0],
                               **F32_TOL)  # onnxruntime folds the BatchNorms of the export


def _bn_only_module():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3, momentum=0.3),
                           nn.ReLU(), nn.Flatten(), nn.Linear(48, 5))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape))
        module[1].running_mean.uniform_(-0.5, 0.5)
        module[1].running_var.uniform_(0.5, 1.5)
    return module


@pytest.mark.parametrize("form", ["torchscript-opset11-training", "torchscript-opset20-training",
                                  "dynamo-train"])
def test_batchnorm_export_forms(form):
    """BatchNormalization as the exporters write it in training mode: opset 9-13's five
    outputs, opset 14+'s training_mode=1, the dynamo exporter's form."""
    module = _bn_only_module()
    x = torch.randn(4, 2, 6, 6)
    if form.startswith("dynamo"):
        model = _export(module.train(), x, dynamo=True)
    else:
        model = _export(module.train(), x, opset=int(form.split("opset")[1][:2]),
                        training=torch.onnx.TrainingMode.TRAINING)
    rename = {v: k for k, v in _parameter_names(model, module).items()}
    session = _train_both(model, module, "momentum", steps=2)
    state = session.state_dict()
    for name, value in module.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(state[rename.get(name, name)], value.numpy(), **F32_TOL,
                                       err_msg=name)
    main = session.export_inference_model().graph
    assert all(len(n.output) == 1 for n in main.node if n.op_type == "BatchNormalization")


def _parameter_names(model, module) -> dict[str, str]:
    """onnx initializer -> torch state_dict name, by value (the dynamo exporter renames)."""
    out = {}
    for t in model.graph.initializer:
        array = numpy_helper.to_array(t)
        for name, value in module.state_dict().items():
            if value.shape == array.shape and np.array_equal(value.numpy(), array):
                out[t.name] = name
    return out


def test_eval_mode_is_unchanged_and_running_statistics_never_train():
    module = _bn_only_module()
    x = torch.randn(4, 2, 6, 6)
    model = _export(module.eval(), x)
    training = ot.build_training_model(model, "cross_entropy", ot.Adam())
    assert metadata(training)["mode"] == "eval"
    assert not any(n.name.startswith("train/") for n in training.training_info[0].algorithm.node)
    bound = {b.key for b in training.training_info[0].update_binding}
    trainable = set(metadata(training)["trainable"].split(","))
    assert not any("running" in name for name in bound | trainable)
    # the step normalizes with the running statistics, as torch's model.eval()
    labels = np.zeros(4, np.int64)
    torch_loss = nn.functional.cross_entropy(module(x), torch.from_numpy(labels))
    session = ot.TrainingSession(training)
    np.testing.assert_allclose(session.step({"x": x.numpy(), "labels": labels})["loss"],
                               torch_loss.item(), **F32_TOL)
    after = {t.name: numpy_helper.to_array(t)
             for t in session.export_inference_model().graph.initializer}
    for name in ("1.running_mean", "1.running_var"):
        np.testing.assert_array_equal(after[name], module.state_dict()[name].numpy())


def test_the_step_does_not_run_the_eval_forward_pass():
    """onnxruntime runs every node of a graph, read or not: the program keeps only the
    nodes its outputs need, so the main graph's eval-mode pass is gone from the step."""
    module = _module()
    model = _export(module.eval(), torch.randn(4, 2, 6, 6))
    session = ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.Adam(),
                                                         mode="train"))
    ran = session._programs.steps[0].session.prepared_model.graph.node
    written = {o for n in ran for o in n.output}
    assert not written & {o for n in model.graph.node for o in n.output}
    assert {"train/y", "train//conv1/Conv_output_0"} <= written  # the training-mode copy runs


def test_tied_statistics_get_their_own_initializers():
    """Two BatchNorms reading one initializer directly, and one through an Identity."""
    shape = [2, 3, 4]
    stats = [numpy_helper.from_array(np.full(3, v, np.float32), n)
             for n, v in (("zeros", 0.0), ("ones", 1.0), ("w", 1.5), ("b", 0.5))]
    graph = helper.make_graph([
        helper.make_node("Identity", ["ones"], ["bn_c.running_var"]),
        helper.make_node("BatchNormalization", ["x", "w", "b", "zeros", "ones"], ["h1"], name="a"),
        helper.make_node("BatchNormalization", ["h1", "w", "b", "zeros", "ones"], ["h2"], name="b"),
        helper.make_node("BatchNormalization", ["h2", "w", "b", "zeros", "bn_c.running_var"],
                         ["y"], name="c"),
    ], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], stats)
    to_inference(graph)
    bns = [n for n in graph.node if n.op_type == "BatchNormalization"]
    stat_inputs = [i for n in bns for i in n.input[3:]]
    assert len(set(stat_inputs)) == 6 and "bn_c.running_var" in stat_inputs
    assert not any(n.op_type == "Identity" for n in graph.node)
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in bns:
        np.testing.assert_array_equal(inits[n.input[3]], 0.0)
        np.testing.assert_array_equal(inits[n.input[4]], 1.0)
    taken: set = set()
    _, _, updates = training_forward(graph, {"x": 3, "h1": 3, "h2": 3}, 17, "T", 0,
                                     lambda b: unique_name(taken, b))
    assert sorted(s for s, _ in updates) == sorted(stat_inputs)


# ---------------------------------------------------------------- Dropout


def _run(nodes, inputs, outputs, evaluator="ort"):
    model = helper.make_model(helper.make_graph(nodes, "g", [i for i, _ in inputs], outputs),
                              opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    feeds = {vi.name: value for vi, value in inputs}
    if evaluator == "reference":
        return ReferenceEvaluator(model).run(None, feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("evaluator", ["ort", "reference"])
def test_splitmix64_matches_the_published_outputs(evaluator):
    """SplitMix64 seeded with 1234567 (splitmix64.c; Rosetta Code's test vector): output n
    is mix(seed + (n + 1) * GAMMA), i.e. our stream key seed + GAMMA at counter n."""
    taken: set = set()
    em = _Emit(lambda b: unique_name(taken, b), 18, "h")
    key = em.const(np.uint64((1234567 + GAMMA) % 2 ** 64))
    out = splitmix64(em, "n", key)
    got = _run(em.nodes, [(helper.make_tensor_value_info("n", TensorProto.UINT64, [5]),
                           np.arange(5, dtype=np.uint64))],
               [helper.make_tensor_value_info(out, TensorProto.UINT64, [5])], evaluator)[0]
    assert got.tolist() == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                            4593380528125082431, 16408922859458223821]


def _masks(p: float, steps: list[int], seed: int = 7, ordinal: int = 0, shape=(200, 500),
           evaluator="ort"):
    taken: set = set()
    em = _Emit(lambda b: unique_name(taken, b), 18, "d")
    keep = dropout_keep(em, "x", "T", stream_key(seed, ordinal), p)
    x_vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    t_vi = helper.make_tensor_value_info("T", TensorProto.INT64, [])
    out = [helper.make_tensor_value_info(keep, TensorProto.BOOL, list(shape))]
    x = np.ones(shape, np.float32)
    return [_run(em.nodes, [(x_vi, x), (t_vi, np.array(t, np.int64))], out, evaluator)[0]
            for t in steps]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_masks_rate_freshness_and_independence(p):
    kept0, kept1, kept0_again = _masks(p, [0, 1, 0])
    n = kept0.size
    sigma = lambda q: 4 * np.sqrt(q * (1 - q) / n)  # noqa: E731  binomial, 4 sigma
    assert abs(kept0.mean() - (1 - p)) < sigma(1 - p)
    np.testing.assert_array_equal(kept0, kept0_again)  # a function of (seed, node, step)
    # consecutive steps, other nodes, other seeds and neighbouring elements are independent:
    # two masks agree on "kept" with probability (1 - p)^2
    others = [kept1, _masks(p, [0], ordinal=1)[0], _masks(p, [0], seed=8)[0]]
    for other in others + [np.roll(kept0, 1), np.roll(kept0, 1, axis=0)]:
        assert abs((kept0 & other).mean() - (1 - p) ** 2) < sigma((1 - p) ** 2)
    assert np.abs(kept0.mean(axis=0) - (1 - p)).max() < 6 * np.sqrt(p * (1 - p) / 200)


def test_dropout_masks_are_portable():
    """onnx's reference evaluator draws the very same masks as onnxruntime."""
    np.testing.assert_array_equal(_masks(0.3, [5], shape=(16, 33))[0],
                                  _masks(0.3, [5], shape=(16, 33), evaluator="reference")[0])


def _dropout_model(p=0.4, opset=17):
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(50, 200), nn.Dropout(p), nn.Linear(200, 3))
    return module, _export(module.train(), torch.randn(8, 50), opset,
                           torch.onnx.TrainingMode.TRAINING)


def test_dropout_gradient_flows_through_the_mask():
    """One step equals torch autograd + SGD on x -> Linear -> x * mask / (1 - p) -> Linear
    with the mask our step drew (step T = 0, first Dropout of seed 3)."""
    p = 0.4
    module, model = _dropout_model(p)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 50)).astype(np.float32)
    target = rng.standard_normal((8, 3)).astype(np.float32)
    training = ot.build_training_model(model, "mse", ot.Momentum(lr=0.1, momentum=0.0),
                                       mode="train", seed=3)
    assert metadata(training)["seed"] == "3"
    assert next(o.version for o in training.opset_import if o.domain == "") >= 18
    session = ot.TrainingSession(training)
    got = session.step({"x": x, "target": target})
    mask = torch.from_numpy(_masks(p, [0], seed=3, shape=(8, 200))[0])
    assert 0.5 < mask.float().mean() < 0.7
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    hidden = module[0](torch.from_numpy(x)) * mask / (1 - p)
    loss = nn.functional.mse_loss(module[2](hidden), torch.from_numpy(target))
    loss.backward()
    opt.step()
    np.testing.assert_allclose(got["loss"], loss.item(), **F32_TOL)
    state = session.state_dict()
    for name, value in module.state_dict().items():
        np.testing.assert_allclose(state[name], value.numpy(), **F32_TOL, err_msg=name)


def test_dropout_training_is_seeded_and_resumes_bit_exact(tmp_path):
    module, model = _dropout_model(0.4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 50)).astype(np.float32)
    target = rng.standard_normal((8, 3)).astype(np.float32)
    module.eval()  # the main graph is the eval-mode graph: no dropout at inference
    fresh = ot.TrainingSession(ot.build_training_model(model, "mse", ot.Adam(), mode="train"))
    np.testing.assert_allclose(fresh.run([model.graph.output[0].name], {"x": x})[0],
                               module(torch.from_numpy(x)).detach().numpy(), **F32_TOL)

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


def test_dropout_ratio_must_be_a_constant():
    graph = helper.make_graph(
        [helper.make_node("Dropout", ["x", "r"], ["y"], name="drop")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    taken: set = set()
    with pytest.raises(ot.TrainingOpError, match="Dropout node 'drop'.*ratio 'r'"):
        training_forward(graph, {}, 18, "T", 0, lambda b: unique_name(taken, b))
