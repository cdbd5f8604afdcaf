"""build_training_model: structure of the training model, spec validity, errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from onnx_training_ops import Adagrad, Adam, Momentum, TrainingOpError, TrainingSession, build_training_model
from onnx_training_ops.builder.model_metadata import metadata
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.passes.fit_runtime import runtime_limits

DOMAIN = "ai.onnx.preview.training"
OPTIMIZERS = [Adam(lr=3e-3, weight_decay=0.01), Momentum(lr=0.1, nesterov=True),
              Adagrad(lr=0.1, initial_accumulator_value=0.5)]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_structure(loss, optimizer):
    inference = make_mlp((6, 5, 3))
    model = build_training_model(inference, loss, optimizer)
    onnx.checker.check_model(model, full_check=True)
    # the main graph is the inference graph, unchanged
    assert model.graph.SerializeToString() == inference.graph.SerializeToString()
    assert model.ir_version <= runtime_limits()[0]
    assert {o.domain: o.version for o in model.opset_import} == {"": 17, DOMAIN: 1}
    assert len(model.training_info) == 1
    info = model.training_info[0]
    algo = info.algorithm
    ops = [n.op_type for n in algo.node if n.domain == DOMAIN]
    assert ops == ["Gradient", optimizer.op_type]  # one Gradient node, ONE multi-tensor optimizer node
    params = ["W0", "b0", "W1", "b1"]
    grad = next(n for n in algo.node if n.op_type == "Gradient")
    assert list(grad.input) == params
    opt = next(n for n in algo.node if n.op_type == optimizer.op_type)
    n_states = len(optimizer.states)
    assert len(opt.input) == 2 + (2 + n_states) * len(params)
    assert list(opt.input[2:6]) == params
    assert opt.input[0] == "learning_rate"
    attrs = {a.name: h.get_attribute_value(a) for a in opt.attribute}
    for k, v in optimizer.attributes().items():
        assert attrs[k] == (v.encode() if isinstance(v, str) else pytest.approx(v, rel=1e-7))
    # update_binding: every parameter, V/H and T
    states = [f"{p}.{s}" for s in optimizer.states for p in params]
    bound = {e.key for e in info.update_binding}
    assert bound == set(params) | set(states) | {"optimizer.T"}
    assert {e.key for e in info.initialization_binding} == set(states) | {"optimizer.T"}
    assert [i.name for i in algo.input] == [("labels" if loss == "cross_entropy" else "target"), "learning_rate"]
    meta = metadata(model)
    assert meta["loss"] == "loss" and meta["learning_rate"] == "learning_rate"
    # loads as an ordinary inference model in stock onnxruntime
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    # the initialization graph gives what the initializers hold
    session = TrainingSession(model)
    start = session.state_dict()
    session.initialize()
    for k, v in session.state_dict().items():
        np.testing.assert_array_equal(v, start[k])
    if isinstance(optimizer, Adagrad):
        assert np.all(start["W0.H"] == 0.5)


def test_trains_regression_with_mse():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    target = np.tanh(x[:, :3] - x[:, 3:]).astype(np.float32)
    session = TrainingSession(build_training_model(make_mlp((6, 16, 3), activation="Tanh"), "mse", Adam(lr=1e-2)))
    first = float(session.step({"input": x, "target": target})["loss"])
    for _ in range(200):
        last = float(session.step({"input": x, "target": target})["loss"])
    assert last < 0.1 * first


def test_trainable_subset_and_custom_loss_output():
    base = make_mlp((4, 3, 2))
    # add a scalar loss output to the model itself
    g = base.graph
    g.node.extend([h.make_node("Mul", ["logits", "logits"], ["l2"]),
                   h.make_node("ReduceSum", ["l2"], ["sq"], keepdims=0)])
    g.output.append(h.make_tensor_value_info("sq", TP.FLOAT, []))
    model = build_training_model(base, "sq", Momentum(lr=0.01), trainable=["W1", "b1"])
    info = model.training_info[0]
    assert {e.key for e in info.update_binding} == {"W1", "b1", "W1.V", "b1.V", "optimizer.T"}
    assert [i.name for i in info.algorithm.input] == ["learning_rate"]
    session = TrainingSession(model)
    x = np.ones((2, 4), np.float32)
    before = session.state_dict()
    out = session.step({"input": x})
    after = session.state_dict()
    assert "sq" in out
    assert "W0" not in after  # not trainable: a constant, not a state variable
    assert np.any(after["W1"] != before["W1"])


def test_float64_model_gets_double_learning_rate():
    model = build_training_model(make_mlp((4, 3), dtype=np.float64), "mse", Adam())
    vi = model.training_info[0].algorithm.input[1]
    assert vi.name == "learning_rate" and vi.type.tensor_type.elem_type == TP.DOUBLE


def test_old_opset_is_converted():
    model = build_training_model(make_mlp((4, 3), opset=11), "cross_entropy", Adam())
    assert {o.domain: o.version for o in model.opset_import}[""] == 13
    TrainingSession(model).step({"input": np.ones((2, 4), np.float32), "labels": np.zeros(2, np.int64)})


def test_errors():
    model = make_mlp((4, 3))
    with pytest.raises(TrainingOpError, match="neither one of .*'mse'.* nor an output"):
        build_training_model(model, "hinge", Adam())
    with pytest.raises(TrainingOpError, match="trainable 'W9' is not an initializer"):
        build_training_model(model, "mse", Adam(), trainable=["W9"])
    with pytest.raises(TrainingOpError, match="optimizer must be"):
        build_training_model(model, "mse", "adam")
    with pytest.raises(TrainingOpError, match="output 'nope' is not an output"):
        build_training_model(model, "mse", Adam(), output="nope")
    with pytest.raises(TrainingOpError, match="already has training_info"):
        build_training_model(build_training_model(model, "mse", Adam()), "mse", Adam())
    with pytest.raises(TrainingOpError, match="must be a float scalar"):
        build_training_model(model, "logits", Adam())
    ints = make_mlp((4, 3))
    ints.graph.initializer.append(nh.from_array(np.array([1], np.int64), "shape_const"))
    with pytest.raises(TrainingOpError, match="only float and double train"):
        build_training_model(ints, "mse", Adam(), trainable=["shape_const"])
    bindings = build_training_model(ints, "mse", Adam()).training_info[0].update_binding
    assert "shape_const" not in {e.key for e in bindings}
    with pytest.raises(TrainingOpError, match="already used"):
        build_training_model(model, "mse", Adam(), labels="input")


def test_optimizer_validation_and_mapping():
    assert Momentum(momentum=0.8, dampening=0.25, nesterov=False, weight_decay=0.1).attributes() == {
        "alpha": 0.8, "beta": 0.75, "mode": "standard", "norm_coefficient": 0.1}
    assert Adam(betas=(0.5, 0.6), eps=0.0, weight_decay=0.2, post_weight_decay=0.3).attributes() == {
        "alpha": 0.5, "beta": 0.6, "epsilon": 0.0, "norm_coefficient": 0.2, "norm_coefficient_post": 0.3}
    assert Adagrad(lr_decay=0.1, eps=1e-5, weight_decay=0.2).attributes() == {
        "decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 0.2}
    with pytest.raises(TrainingOpError, match="betas"):
        Adam(betas=(1.0, 0.9))
    with pytest.raises(TrainingOpError, match="nesterov"):
        Momentum(momentum=0.0, nesterov=True)
    with pytest.raises(TrainingOpError, match="lr must be finite and >= 0"):
        Adagrad(lr=-1)
    # what a user types by mistake gets our message, not a raw TypeError
    for bad, match in [(dict(betas=0.9), "betas must be two numbers"),
                       (dict(lr=None), "lr must be a real number"),
                       (dict(lr="0.01"), "lr must be a real number"),
                       (dict(eps=float("nan")), "eps must be finite")]:
        with pytest.raises(TrainingOpError, match=match):
            Adam(**bad)


def test_newest_opset_is_fitted_to_onnxruntime():
    newest = onnx.defs.onnx_opset_version()
    model = build_training_model(make_mlp((4, 3), opset=newest), "cross_entropy", Adam())
    opset = {o.domain: o.version for o in model.opset_import}[""]
    assert opset <= runtime_limits()[1]
    onnx.checker.check_model(model, full_check=True)
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    TrainingSession(model).step({"input": np.ones((2, 4), np.float32), "labels": np.zeros(2, np.int64)})


# ------------------------------------------------------------------ issue 8: builder defects
def _conv_bn_model():
    """Conv -> BatchNormalization (inference) -> ReduceMean, exported-style initializers:
    BN running statistics and a scalar constant among them."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = {"W": f32(2, 1, 3, 3), "gamma": f32(2), "beta": f32(2),
             "running_mean": f32(2), "running_var": np.abs(f32(2)) + 0.5,
             "two": np.float32(2.0)}
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"]),
             helper.make_node("BatchNormalization",
                              ["c", "gamma", "beta", "running_mean", "running_var"], ["bn"]),
             helper.make_node("Mul", ["bn", "two"], ["scaled"]),
             helper.make_node("ReduceMean", ["scaled", "axes"], ["y"], keepdims=0)]
    inits["axes"] = np.array([2, 3], np.int64)
    graph = helper.make_graph(
        nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [nh.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_default_trainables_are_what_torch_calls_parameters():
    """Not BN running statistics (one Adam step used to move running_var), not scalar
    constants, not integers."""
    training = build_training_model(_conv_bn_model(), "mse", Adam())
    assert metadata(training)["trainable"].split(",") == ["W", "gamma", "beta"]


def test_build_lists_every_op_without_a_rule_at_once():
    model = _conv_bn_model()
    extra = [helper.make_node("Det", ["y2"], ["d"], name="det0"),
             helper.make_node("Hardmax", ["y"], ["hm"], name="hardmax0"),
             helper.make_node("Hardmax", ["hm"], ["hm2"], name="hardmax1")]
    nodes = list(model.graph.node)
    nodes[-1].output[0] = "y0"
    nodes += [helper.make_node("Reshape", ["y0", "sq"], ["y2"]),
              extra[0], helper.make_node("Add", ["y0", "d"], ["y"])] + extra[1:]
    model.graph.initializer.append(nh.from_array(np.array([2, 2], np.int64), "sq"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.output[0].name = "hm2"
    with pytest.raises(TrainingOpError) as info:
        build_training_model(model, "mse", Adam())
    msg = str(info.value)
    assert "Hardmax x2 (first: 'hardmax0')" in msg and "Det x1 (first: 'det0')" in msg, msg


def test_training_mode_ops_are_refused_at_build_time_with_a_hint():
    """torch's training-mode BatchNormalization and Dropout have no rule: the builder says so
    (with the way out) instead of TrainingSession failing later."""
    model = _conv_bn_model()
    bn = model.graph.node[1]
    bn.attribute.append(helper.make_attribute("training_mode", 1))
    bn.output.extend(["bn_mean", "bn_var"])
    bn.name = "bn0"
    model.graph.node[2].input[0] = "dropped"
    model.graph.node.insert(2, helper.make_node("Dropout", ["bn", "", "train"], ["dropped"],
                                                name="drop0"))
    model.graph.initializer.append(nh.from_array(np.array(True), "train"))
    with pytest.raises(TrainingOpError) as info:
        build_training_model(model, "mse", Adam())
    msg = str(info.value)
    assert "BatchNormalization x1 (first: 'bn0')" in msg and "Dropout x1 (first: 'drop0')" in msg
    assert msg.count("model.eval()") == 2 and "mode='train'" in msg, msg


class _Tiny:
    """A torch module with every kind of initializer an export can hold: parameters,
    BatchNorm running statistics, a registered float buffer, a folded scalar constant."""

    @staticmethod
    def make():
        import math
        torch = pytest.importorskip("torch")

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(1, 2, 3)
                self.bn = torch.nn.BatchNorm2d(2)
                self.fc = torch.nn.Linear(8, 3)
                self.norm = torch.nn.LayerNorm(3)
                self.register_buffer("offset", torch.tensor([0.1, 0.2, 0.3]))

            def forward(self, x):
                h = torch.relu(self.bn(self.conv(x))).flatten(1)
                return self.norm(self.fc(h)) / math.sqrt(3.0) + self.offset

        torch.manual_seed(0)
        module = Tiny().eval()
        with torch.no_grad():  # statistics unlike any parameter: the TorchScript exporter
            module.bn.running_mean.uniform_(-1.0, 1.0)  # merges equal initializers
            module.bn.running_var.uniform_(0.5, 2.0)
        return torch, module


@pytest.mark.parametrize("dynamo", [False, True])
def test_default_trainables_of_torch_exports(dynamo, tmp_path):
    """Both exporters, BatchNorm kept (no folding): the default trainables are torch's
    named_parameters(); one Adam step leaves the running statistics as they were. The
    TorchScript exporter does not record which initializers are buffers, so a float buffer
    on the loss path (``offset``) is trained there unless ``trainable=`` says otherwise."""
    import warnings
    torch, module = _Tiny.make()
    x = torch.randn(2, 1, 4, 4)
    path = tmp_path / "tiny.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=False,
                              input_names=["x"], output_names=["y"])
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17,
                              do_constant_folding=False, input_names=["x"], output_names=["y"])
    exported = onnx.load(str(path))
    names = {t.name for t in exported.graph.initializer}
    assert {"bn.running_mean", "bn.running_var", "offset"} <= names
    training = build_training_model(exported, "mse", Adam(lr=0.1))
    chosen = set(metadata(training)["trainable"].split(","))
    expected = {n for n, _ in module.named_parameters()} | ({"offset"} if not dynamo else set())
    assert chosen == expected
    session = TrainingSession(training)
    before = session.state_dict()
    y = module(x).detach().numpy()
    session.step({"x": x.numpy(), "target": y + 1.0})
    after = session.state_dict()
    assert "bn.running_var" not in after  # a constant of the model, not state
    assert not np.array_equal(before["conv.weight"], after["conv.weight"])
