"""Issue 9, second pass: errors that still came out raw or misleading, and valid models that
must run (training_info graphs validated like the main graph, Loop bodies, other domains on
a gradient path, optimizer arguments, non-mapping feeds)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_factory import optimizer_model
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_training_ops import (
    Adam,
    InferenceSession,
    Momentum,
    TrainingOpError,
    TrainingSession,
    build_training_model,
    prepare,
)
from onnx_training_ops.demo import make_mlp

TRAINING = "ai.onnx.preview.training"


def _training_model():
    return build_training_model(make_mlp((16, 8, 4), seed=1), "cross_entropy", Adam())


def _set_attribute(node, name, value):
    for a in node.attribute:
        if a.name == name:
            a.f = value


def _adam(graph):
    return next(n for n in graph.node if n.op_type == "Adam")


ALGORITHM_DAMAGE = [
    ("dangling", lambda g: g.node.append(helper.make_node("Relu", ["nowhere"], ["r"], name="dangling")),
     r"algorithm.*Relu node 'dangling': input 'nowhere' is produced by no node"),
    # the IR concatenates main and algorithm graphs: producing a main-graph value again breaks SSA
    ("shadows_main", lambda g: g.node.append(helper.make_node("Relu", ["input"], ["logits"], name="shadow")),
     r"algorithm.*Relu node 'shadow': output 'logits' is already produced by Gemm node"),
    ("cycle", lambda g: (g.node.insert(0, helper.make_node("Relu", ["late"], ["early"], name="first")),
                         g.node.append(helper.make_node("Relu", ["early"], ["late"], name="second"))),
     r"algorithm.*Relu node 'first': input 'late' is produced only by a later node"),
    ("alpha_one", lambda g: _set_attribute(_adam(g), "alpha", 1.0),
     r"algorithm.*Adam node 'optimizer/Adam': attribute 'alpha' must be < 1"),
    ("unknown_attribute", lambda g: _adam(g).attribute.append(helper.make_attribute("surprise", 1.0)),
     r"algorithm.*Adam node 'optimizer/Adam': unknown attribute 'surprise'"),
    ("arity", lambda g: _adam(g).input.append(_adam(g).input[-1]),
     r"algorithm.*Adam node 'optimizer/Adam': expected 2 \+ 4\*N inputs"),
]


@pytest.mark.parametrize("kind,damage,match", ALGORITHM_DAMAGE, ids=[c[0] for c in ALGORITHM_DAMAGE])
def test_prepare_and_training_session_validate_the_algorithm_graph(kind, damage, match):
    """prepare() accepted these training models (the algorithm graph was never validated) and
    TrainingSession answered with onnx.checker's message or a misleading "not reachable"."""
    model = _training_model()
    damage(model.training_info[0].algorithm)
    with pytest.raises(TrainingOpError, match=r"training_info\[0\]\." + match):
        prepare(model)
    with pytest.raises(TrainingOpError, match=r"training_info\[0\]" + match.removeprefix("algorithm")):
        TrainingSession(model)


def test_prepare_validates_the_initialization_graph():
    model = _training_model()
    model.training_info[0].initialization.node.append(
        helper.make_node("Relu", ["nowhere"], ["r"], name="init_dangling"))
    with pytest.raises(TrainingOpError, match=r"training_info\[0\]\.initialization: Relu node "
                                              r"'init_dangling': input 'nowhere'"):
        prepare(model)


def test_a_gradient_through_another_domains_op_names_the_missing_rule():
    """A float op of another domain on the path used to make y "not reachable" (and, beside
    a differentiable path, silently dropped its share of the gradient)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    nodes = [helper.make_node("Inverse", ["x"], ["g"], domain="com.microsoft", name="ms_inverse"),
             helper.make_node("Add", ["g", "x"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="y", name="grad")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(TrainingOpError, match=r"'grad': 1 node\(s\) on the path from xs to y have no derivative rule: "
                                              r"com.microsoft::Inverse x1 \(first: 'ms_inverse'\)"):
        prepare(model)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dampening="0.1"), "dampening must be a real number"),
    (dict(dampening=None), "dampening must be a real number"),
    (dict(dampening=float("nan")), "dampening must be finite"),
    (dict(nesterov="yes"), "nesterov must be True or False"),
])
def test_momentum_arguments(kwargs, match):
    with pytest.raises(TrainingOpError, match=match):
        Momentum(lr=0.1, **kwargs)


def test_inference_session_run_with_a_list_says_what_it_takes():
    session = InferenceSession(optimizer_model("Adam"))
    with pytest.raises(TrainingOpError, match="input_feed must be a dict of input name to array, found list"):
        session.run(None, [np.ones(3, np.float32)])


def _shape(name):
    return [3] if name[1] == "0" else [2]


def test_multi_tensor_optimizer_inside_a_loop_body_matches_the_reference():
    """Two tensors' Momentum in a Loop body, three iterations, against onnx.reference."""
    inner = optimizer_model("Momentum", n=2, shapes=[[3], [2]]).graph  # R T X0 X1 G0 G1 V0 V1
    carried = {"X0": "X0_in", "X1": "X1_in", "V0": "V0_in", "V1": "V1_in"}
    node = onnx.NodeProto()
    node.CopyFrom(inner.node[0])
    for i, name in enumerate(node.input):
        node.input[i] = carried.get(name, name)
    body = helper.make_graph(
        [node, helper.make_node("Identity", ["cond"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])]
        + [helper.make_tensor_value_info(v, TensorProto.FLOAT, _shape(v)) for v in carried.values()],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])]
        + [helper.make_tensor_value_info(o.name, TensorProto.FLOAT, _shape(o.name)) for o in inner.output])
    outputs = ["X0_out", "X1_out", "V0_out", "V1_out"]
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "X0", "X1", "V0", "V1"], outputs, body=body, name="loop")],
        "g", list(inner.input), [helper.make_tensor_value_info(o, TensorProto.FLOAT, _shape(o)) for o in outputs],
        [helper.make_tensor("trips", TensorProto.INT64, [], [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    feed = {"R": np.array(0.1, np.float32), "T": np.array(0, np.int64)}
    for vi in list(inner.input)[2:]:
        feed[vi.name] = rng.standard_normal(3 if vi.name.endswith("0") else 2).astype(np.float32)
    got = InferenceSession(model).run(None, feed)
    # onnx.reference's Loop returns the carried values unchanged here (it does not run the
    # domain's ops in a body), so the reference is its flat node applied three times
    reference, state = ReferenceEvaluator(optimizer_model("Momentum", n=2, shapes=[[3], [2]])), dict(feed)
    for _ in range(3):
        state.update(zip(["X0", "X1", "V0", "V1"], reference.run(None, state)))
    want = [state[k] for k in ("X0", "X1", "V0", "V1")]
    assert not np.array_equal(got[0], feed["X0"])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_empty_batch_is_named_not_an_onnxruntime_reshape_error():
    session = TrainingSession(_training_model())
    before = session.state_dict()
    with pytest.raises(TrainingOpError, match="feed 'labels' is empty: a batch needs at least one example"):
        session.step({"input": np.zeros((0, 16), np.float32), "labels": np.zeros(0, np.int64)})
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def test_the_cli_tells_an_internal_error_from_a_reported_failure(monkeypatch, capsys, tmp_path):
    """A bug used to exit 1 with a bare traceback, like a failed conformance case."""
    from onnx_training_ops import cli

    def broken(model):
        raise KeyError("a bug")

    monkeypatch.setattr("onnx_training_ops.runtime.pipeline.prepare", broken)
    source = tmp_path / "m.onnx"
    onnx.save(optimizer_model("Adam"), source)
    assert cli.main(["prepare", str(source), str(tmp_path / "out.onnx")]) == 3
    err = capsys.readouterr().err
    assert "KeyError: 'a bug'" in err and "internal error of onnx-training-ops" in err


@pytest.mark.parametrize("lr", [np.nan, -1.0, np.inf, "0.01"])
def test_a_fed_learning_rate_is_checked_like_step_lr(lr):
    """Feeding 'learning_rate' bypassed step(lr=...)'s check: NaN went into every parameter."""
    session = TrainingSession(_training_model())
    before = session.state_dict()
    rng = np.random.default_rng(0)
    batch = {"input": rng.standard_normal((6, 16)).astype(np.float32),
             "labels": rng.integers(0, 4, 6).astype(np.int64),
             "learning_rate": np.array(lr) if isinstance(lr, str) else np.array(lr, np.float32)}
    with pytest.raises(TrainingOpError, match="learning rate feed 'learning_rate' must be"):
        session.step(batch)
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def test_a_models_default_learning_rate_is_checked_at_load():
    model = _training_model()
    rate = next(t for t in model.training_info[0].algorithm.initializer if t.name == "learning_rate")
    rate.CopyFrom(onnx.numpy_helper.from_array(np.array(np.nan, np.float32), "learning_rate"))
    with pytest.raises(TrainingOpError, match="the default of learning rate 'learning_rate' must be finite"):
        TrainingSession(model)


def test_algorithm_outputs_declared_without_a_type_are_accepted():
    """onnx.checker accepts them in a training model; the session used to refuse ('Field
    'type' of 'value_info' is required but missing') — like outputs without a shape."""
    model = _training_model()
    for out in model.training_info[0].algorithm.output:
        out.ClearField("type")
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    batch = {"input": rng.standard_normal((6, 16)).astype(np.float32),
             "labels": rng.integers(0, 4, 6).astype(np.int64)}
    for fast in (True, False):
        untyped, typed = TrainingSession(model, fast=fast), TrainingSession(_training_model(), fast=fast)
        assert untyped.step(batch)["loss"] == typed.step(batch)["loss"]
        for name, value in untyped.state_dict().items():
            np.testing.assert_array_equal(value, typed.state_dict()[name])


def test_models_with_external_data_load_from_their_path(tmp_path):
    """onnxruntime loads a path's external data; prepare/InferenceSession/TrainingSession read
    the bytes and lost the directory ('External data path ... escapes working directory')."""
    path = tmp_path / "model.onnx"
    onnx.save(_training_model(), path, save_as_external_data=True, location="model.data",
              size_threshold=0)
    rng = np.random.default_rng(0)
    batch = {"input": rng.standard_normal((6, 16)).astype(np.float32),
             "labels": rng.integers(0, 4, 6).astype(np.int64)}
    assert TrainingSession(str(path)).step(batch)["loss"] == TrainingSession(_training_model()).step(batch)["loss"]
    assert InferenceSession(str(path)).run(None, {"input": batch["input"]})[0].shape == (6, 4)
    (tmp_path / "model.data").rename(tmp_path / "elsewhere.data")
    with pytest.raises(TrainingOpError, match="tensor 'W0': cannot read its external data"):
        prepare(str(path))


def test_an_algorithm_graph_may_declare_main_graph_values_as_its_inputs():
    """Declaring 'logits' as an algorithm input (so the algorithm graph is valid on its own;
    onnx.checker accepts the model) names the main graph's value under the IR's concatenation;
    it used to break SSA ('logits' a graph input and a node output)."""
    model = _training_model()
    model.training_info[0].algorithm.input.append(
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4]))
    onnx.checker.check_model(model)
    prepare(model)
    rng = np.random.default_rng(0)
    batch = {"input": rng.standard_normal((6, 16)).astype(np.float32),
             "labels": rng.integers(0, 4, 6).astype(np.int64)}
    assert TrainingSession(model).step(batch)["loss"] == TrainingSession(_training_model()).step(batch)["loss"]
