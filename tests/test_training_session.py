"""TrainingSession: hand-written and built training models, fast path vs full graph, from_graph,
learning-rate schedules, bad input, the NaN policy, memory over 1000 steps."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from onnx_training_ops import (
    Adagrad,
    Adam,
    Momentum,
    NonFiniteLossError,
    TrainingOpError,
    TrainingSession,
    build_training_model,
)
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.optim.momentum import momentum as reference_momentum

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from build_models import linear_regression_adam  # noqa: E402


def _regression_data(seed=1, n=32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    return x, (x @ w + 0.5).astype(np.float32)


def _digits_like(seed=0, n=64, d=64, k=10):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, k, n).astype(np.int64)


# ------------------------------------------------------------------ a hand-written training model


def test_hand_written_training_model_trains():
    model = linear_regression_adam()
    session = TrainingSession(model)
    assert session.fast_path_nodes == ["Adam node 'adam'"]
    assert session.feed_names == ["x", "target"]
    assert session.learning_rate_names == ["learning_rate"]
    x, y = _regression_data()
    first = float(session.step({"x": x, "target": y})["loss"])
    for _ in range(300):
        out = session.step({"x": x, "target": y})
    assert float(out["loss"]) < 1e-4 * first
    assert int(session.state_dict()["T"]) == 301
    pred = session.run(["y"], {"x": x})[0]
    np.testing.assert_allclose(pred, y, atol=1e-2)


def test_initialize_resets_state():
    session = TrainingSession(linear_regression_adam())
    before = session.state_dict()
    x, y = _regression_data()
    for _ in range(3):
        session.step({"x": x, "target": y})
    assert int(session.state_dict()["T"]) == 3
    session.initialize()
    after = session.state_dict()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


# ------------------------------------------------------------------ fast path == full graph


@pytest.mark.parametrize(
    "optimizer",
    [Adam(lr=1e-2, weight_decay=1e-3, post_weight_decay=1e-4), Momentum(lr=0.05, nesterov=True),
     Momentum(lr=0.05, dampening=0.2, weight_decay=1e-2), Adagrad(lr=0.05, lr_decay=0.01)],
    ids=["adam", "nesterov", "momentum", "adagrad"],
)
def test_fast_path_is_bit_exact_with_full_graph(optimizer):
    model = build_training_model(make_mlp((64, 32, 10), seed=4), "cross_entropy", optimizer)
    fast = TrainingSession(model, fast=True)
    full = TrainingSession(model, fast=False)
    assert fast.fast_path_nodes and not full.fast_path_nodes
    rng = np.random.default_rng(5)
    for step in range(15):
        x, y = _digits_like(step)
        lr = 0.01 * (0.9 ** step)
        a = fast.step({"input": x, "labels": y}, lr=lr)
        b = full.step({"input": x, "labels": y}, lr=lr)
        assert a["loss"].tobytes() == b["loss"].tobytes()
        sa, sb = fast.state_dict(), full.state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:
            assert sa[name].tobytes() == sb[name].tobytes(), f"step {step}: {name} differs"
    del rng


def test_fast_path_is_bit_exact_on_hand_written_model():
    fast = TrainingSession(linear_regression_adam(), fast=True)
    full = TrainingSession(linear_regression_adam(), fast=False)
    x, y = _regression_data()
    for _ in range(20):
        fast.step({"x": x, "target": y})
        full.step({"x": x, "target": y})
    for name, value in fast.state_dict().items():
        assert value.tobytes() == full.state_dict()[name].tobytes()


def test_state_is_shared_with_onnxruntime_not_copied():
    session = TrainingSession(build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Adam()))
    arrays = {name: session._store.arrays[name] for name in session.state_names}
    x, y = _digits_like(0, 5, 8, 3)
    for _ in range(3):
        session.step({"input": x, "labels": y})
    for name, array in arrays.items():
        assert session._store.arrays[name] is array  # updated in place, never replaced


# ------------------------------------------------------------------ learning rate


def test_learning_rate_schedule_and_default():
    model = build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Adam(lr=0.1))
    session = TrainingSession(model)
    x, y = _digits_like(0, 5, 8, 3)
    before = session.state_dict()
    session.step({"input": x, "labels": y}, lr=0.0)  # lr 0: parameters do not move, T and V/H do
    after = session.state_dict()
    for p in ("W0", "b0", "W1", "b1"):
        np.testing.assert_array_equal(after[p], before[p])
    assert int(after["optimizer.T"]) == 1
    assert np.any(after["W0.V"] != 0)
    session.step({"input": x, "labels": y, "learning_rate": np.float32(0.0)})  # as a feed
    np.testing.assert_array_equal(session.state_dict()["W0"], before["W0"])
    session.step({"input": x, "labels": y})  # default: the model's lr
    assert np.any(session.state_dict()["W0"] != before["W0"])


# ------------------------------------------------------------------ from_graph


def _momentum_graph(with_gradient_input=True):
    """X_new, V_new = Momentum(R, T, X, G, V); T_new = T + 1; loss = sum(X^2)/2, G = X."""
    nodes = [
        h.make_node("Mul", ["X", "X"], ["X2"]),
        h.make_node("ReduceSum", ["X2"], ["sum"], keepdims=0),
        h.make_node("Mul", ["sum", "half"], ["loss"]),
        h.make_node("Add", ["T", "one"], ["T_new"]),
        h.make_node("Momentum", ["R", "T", "X", "G" if with_gradient_input else "X", "V"], ["X_new", "V_new"],
                    domain="ai.onnx.preview.training", alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0),
    ]
    inputs = [h.make_tensor_value_info(n, TP.FLOAT, [4]) for n in ("X", "V")]
    inputs += [h.make_tensor_value_info("T", TP.INT64, []), h.make_tensor_value_info("R", TP.FLOAT, [])]
    if with_gradient_input:
        inputs.append(h.make_tensor_value_info("G", TP.FLOAT, [4]))
    outputs = [h.make_tensor_value_info("loss", TP.FLOAT, []), h.make_tensor_value_info("X_new", TP.FLOAT, [4]),
               h.make_tensor_value_info("V_new", TP.FLOAT, [4]), h.make_tensor_value_info("T_new", TP.INT64, [])]
    graph = h.make_graph(nodes, "momentum_step", inputs, outputs,
                         [nh.from_array(np.array(0.5, np.float32), "half"), nh.from_array(np.array(1, np.int64), "one"),
                          nh.from_array(np.zeros(4, np.float32), "V")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("ai.onnx.preview.training", 1)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("fast", [True, False, "device"])
def test_from_graph_matches_reference_kernel(fast, tmp_path):
    x0 = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    session = TrainingSession.from_graph(
        _momentum_graph(), {"X_new": "X", "V_new": "V", "T_new": "T"},
        initial_state={"X": x0, "T": np.array(0, np.int64)}, fast=fast is True,
        device="cpu" if fast == "device" else None,
    )
    assert bool(session.fast_path_nodes) == (fast is True)
    x, v = x0.copy(), np.zeros(4, np.float32)
    rng = np.random.default_rng(0)
    for t in range(5):
        g = rng.standard_normal(4).astype(np.float32)
        out = session.step({"G": g, "R": np.array(0.1, np.float32)})
        assert set(out) == {"loss"}
        x, v = reference_momentum(np.float32(0.1), np.int64(t), x, g, v, alpha=0.9, beta=1.0, mode="standard",
                                  norm_coefficient=0.0)
        np.testing.assert_array_equal(session.state_dict()["X"], x)
        np.testing.assert_array_equal(session.state_dict()["V"], v)
    path = session.save(tmp_path / "from_graph.onnx")
    resumed = TrainingSession(path)
    np.testing.assert_array_equal(resumed.state_dict()["X"], x)


def test_from_graph_errors():
    with pytest.raises(TrainingOpError, match="'nope' is not an output"):
        TrainingSession.from_graph(_momentum_graph(), {"nope": "X"})
    with pytest.raises(TrainingOpError, match="'Y' is not an input"):
        TrainingSession.from_graph(_momentum_graph(), {"X_new": "Y"})
    with pytest.raises(TrainingOpError, match="state input 'X' has no initial value"):
        TrainingSession.from_graph(_momentum_graph(), {"X_new": "X"})


# ------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def mlp_session():
    return TrainingSession(build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Adam()))


def test_missing_and_extra_feeds(mlp_session):
    x, y = _digits_like(0, 5, 8, 3)
    with pytest.raises(TrainingOpError, match=r"missing feed\(s\) \['labels'\]"):
        mlp_session.step({"input": x})
    with pytest.raises(TrainingOpError, match=r"unknown feed\(s\) \['extra'\]"):
        mlp_session.step({"input": x, "labels": y, "extra": y})


def test_misshaped_and_mistyped_feeds(mlp_session):
    x, y = _digits_like(0, 5, 8, 3)
    with pytest.raises(TrainingOpError, match=r"feed 'input' must have shape \['\?', 8\], found \[5, 7\]"):
        mlp_session.step({"input": x[:, :7], "labels": y})
    with pytest.raises(TrainingOpError, match="feed 'input' must be float32, found float64"):
        mlp_session.step({"input": x.astype(np.float64), "labels": y})
    with pytest.raises(TrainingOpError, match="feed 'labels' must be int64, found int32"):
        mlp_session.step({"input": x, "labels": y.astype(np.int32)})
    with pytest.raises(TrainingOpError, match="'labels' has 3 rows, input 'input' has"):  # batch sizes disagree
        mlp_session.step({"input": x, "labels": y[:3]})


def test_bad_bindings_fail_at_load():
    model = linear_regression_adam()
    model.training_info[0].update_binding[0].key = "no_such_initializer"
    with pytest.raises(TrainingOpError, match="key 'no_such_initializer' is not an initializer"):
        TrainingSession(model)
    model = linear_regression_adam()
    model.training_info[0].update_binding[0].value = "no_such_output"
    with pytest.raises(TrainingOpError, match="'no_such_output' is not an output of the algorithm graph"):
        TrainingSession(model)
    model = linear_regression_adam()
    model.training_info[0].initialization_binding[0].value = "nothing"
    with pytest.raises(TrainingOpError, match="initialization_binding.*'nothing' is not an output"):
        TrainingSession(model)
    model = linear_regression_adam()
    info = model.training_info[0]
    info.update_binding.add(key="W", value="W.new")
    with pytest.raises(TrainingOpError, match="'W' is bound twice"):
        TrainingSession(model)
    with pytest.raises(TrainingOpError, match="no training_info"):
        TrainingSession(make_mlp((4, 3)))


def test_state_variable_of_wrong_dtype_fails_at_load():
    model = linear_regression_adam()
    algo = model.training_info[0].algorithm
    for t in algo.initializer:
        if t.name == "W.V":
            t.CopyFrom(nh.from_array(np.zeros((3, 2), np.float64), "W.V"))
    with pytest.raises(TrainingOpError, match="W.V"):
        TrainingSession(model)
    model = linear_regression_adam()
    for t in model.training_info[0].algorithm.initializer:
        if t.name == "T":
            t.CopyFrom(nh.from_array(np.array(0.0, np.float32), "T"))
    with pytest.raises(TrainingOpError):
        TrainingSession(model)


def test_load_state_dict_checks(mlp_session):
    state = mlp_session.state_dict()
    with pytest.raises(TrainingOpError, match="'W0' is float32, found float64"):
        mlp_session.load_state_dict({**state, "W0": state["W0"].astype(np.float64)})
    with pytest.raises(TrainingOpError, match="'W0' has shape"):
        mlp_session.load_state_dict({**state, "W0": state["W0"][:1]})
    with pytest.raises(TrainingOpError, match="missing state variable"):
        mlp_session.load_state_dict({"W0": state["W0"]})
    with pytest.raises(TrainingOpError, match="unknown state variable"):
        mlp_session.load_state_dict({**state, "zzz": state["W0"]})
    mlp_session.load_state_dict(state)


# ------------------------------------------------------------------ non-finite loss


@pytest.mark.parametrize("fast", [True, False])
def test_nan_loss_raises_and_leaves_state_unchanged(fast):
    session = TrainingSession(build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Adam()), fast=fast)
    x, y = _digits_like(0, 5, 8, 3)
    session.step({"input": x, "labels": y})
    before = session.state_dict()
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(NonFiniteLossError, match="loss 'loss' is nan"):
        session.step({"input": bad, "labels": y})
    for name, value in session.state_dict().items():
        assert value.tobytes() == before[name].tobytes(), name
    session.step({"input": x, "labels": y})  # and training goes on
    assert int(session.state_dict()["optimizer.T"]) == 2


def test_nan_policy_skip_and_ignore():
    model = build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Adam())
    x, y = _digits_like(0, 5, 8, 3)
    bad = x.copy()
    bad[0, 0] = np.inf
    skip = TrainingSession(model, on_nonfinite="skip")
    before = skip.state_dict()
    out = skip.step({"input": bad, "labels": y})
    assert not np.isfinite(out["loss"]) and skip.skipped_steps == 1
    assert int(skip.state_dict()["optimizer.T"]) == 0
    np.testing.assert_array_equal(skip.state_dict()["W0"], before["W0"])
    ignore = TrainingSession(model, on_nonfinite="ignore")
    ignore.step({"input": bad, "labels": y})
    assert int(ignore.state_dict()["optimizer.T"]) == 1
    with pytest.raises(TrainingOpError, match="on_nonfinite"):
        TrainingSession(model, on_nonfinite="maybe")


# ------------------------------------------------------------------ inference and export


def test_run_and_export_inference_model(tmp_path):
    model = build_training_model(make_mlp((8, 4, 3)), "cross_entropy", Momentum(lr=0.1))
    session = TrainingSession(model)
    x, y = _digits_like(0, 5, 8, 3)
    for _ in range(5):
        session.step({"input": x, "labels": y})
    logits = session.run(["logits"], {"input": x})[0]
    exported = session.export_inference_model(tmp_path / "inference.onnx")
    assert not exported.training_info
    onnx.checker.check_model(onnx.load(tmp_path / "inference.onnx"), full_check=True)
    plain = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(plain.run(["logits"], {"input": x})[0], logits)
    with pytest.raises(TrainingOpError, match="state variable"):
        session.run(None, {"input": x, "W0": np.zeros((8, 4), np.float32)})


# ------------------------------------------------------------------ memory



def _rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_no_allocation_growth_over_1000_steps():
    session = TrainingSession(build_training_model(make_mlp((64, 128, 10)), "cross_entropy", Adam()))
    x, y = _digits_like(0)
    feeds = {"input": x, "labels": y}
    for _ in range(100):
        session.step(feeds)
    gc.collect()
    rss_before = _rss_kb()
    tracemalloc.start()
    snapshot_before = tracemalloc.take_snapshot()
    for _ in range(1000):
        session.step(feeds)
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_after = _rss_kb()
    del snapshot_before
    # Python-side: nothing accumulates (a step's transient objects are a few kB)
    assert current < 64 * 1024, current
    assert peak < 512 * 1024, peak
    # process-wide (onnxruntime's arena included): no growth beyond noise
    assert rss_after - rss_before < 8 * 1024, (rss_before, rss_after)


# ------------------------------------------------------------------ partial fast path, several TrainingInfoProtos


def test_optimizer_whose_output_is_also_read_stays_in_onnxruntime():
    model = linear_regression_adam()
    algo = model.training_info[0].algorithm
    algo.node.append(h.make_node("ReduceSum", ["W.new"], ["W.new.sum"], keepdims=0))
    algo.output.append(h.make_tensor_value_info("W.new.sum", TP.FLOAT, []))
    fast, full = TrainingSession(model, fast=True), TrainingSession(model, fast=False)
    assert fast.fast_path_nodes == []  # W.new has another consumer: the node runs through the plugin
    x, y = _regression_data()
    for _ in range(5):
        a = fast.step({"x": x, "target": y})
        b = full.step({"x": x, "target": y})
        assert set(a) == {"loss", "W.new.sum"}
        np.testing.assert_array_equal(a["W.new.sum"], b["W.new.sum"])
    np.testing.assert_array_equal(a["W.new.sum"], fast.state_dict()["W"].sum(dtype=np.float32))
    for name, value in fast.state_dict().items():
        assert value.tobytes() == full.state_dict()[name].tobytes()


def _block_coordinate_model():
    """Two TrainingInfoProtos: the first updates W (Momentum), the second b (Adagrad), in that order.

    y = x W + b; loss = sum((y - t)^2) / 2; dW = x^T (y - t); db = sum(y - t, axis 0).
    """
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    b = np.zeros(2, np.float32)
    main = h.make_graph(
        [h.make_node("MatMul", ["x", "W"], ["xW"]), h.make_node("Add", ["xW", "b"], ["y"])], "lin",
        [h.make_tensor_value_info("x", TP.FLOAT, ["N", 3])], [h.make_tensor_value_info("y", TP.FLOAT, ["N", 2])],
        [nh.from_array(w, "W"), nh.from_array(b, "b")],
    )
    model = h.make_model(main, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("ai.onnx.preview.training", 1)])
    model.ir_version = 10
    common = [h.make_node("Sub", ["y", "t"], ["r"]), h.make_node("Add", ["T", "one"], ["T.new"])]
    f = TP.FLOAT
    first = h.make_graph(
        common + [
            h.make_node("Transpose", ["x"], ["xT"]), h.make_node("MatMul", ["xT", "r"], ["gW"]),
            h.make_node("Momentum", ["lr", "T", "W", "gW", "W.V"], ["W.new", "W.V.new"],
                        domain="ai.onnx.preview.training", alpha=0.5, beta=1.0, mode="standard", norm_coefficient=0.0),
        ],
        "first", [h.make_tensor_value_info("t", f, ["N", 2])],
        [h.make_tensor_value_info("W.new", f, [3, 2]), h.make_tensor_value_info("W.V.new", f, [3, 2]),
         h.make_tensor_value_info("T.new", TP.INT64, [])],
        [nh.from_array(np.array(0.01, np.float32), "lr"), nh.from_array(np.array(1, np.int64), "one"),
         nh.from_array(np.array(0, np.int64), "T"), nh.from_array(np.zeros((3, 2), np.float32), "W.V")],
    )
    second = h.make_graph(
        common + [
            h.make_node("ReduceSum", ["r", "axis0"], ["gb"], keepdims=0),
            h.make_node("Adagrad", ["lr", "T", "b", "gb", "b.H"], ["b.new", "b.H.new"],
                        domain="ai.onnx.preview.training", epsilon=1e-6),
        ],
        "second", [h.make_tensor_value_info("t", f, ["N", 2])],
        [h.make_tensor_value_info("b.new", f, [2]), h.make_tensor_value_info("b.H.new", f, [2]),
         h.make_tensor_value_info("T.new", TP.INT64, [])],
        [nh.from_array(np.array(0.1, np.float32), "lr"), nh.from_array(np.array(1, np.int64), "one"),
         nh.from_array(np.array(0, np.int64), "T2"), nh.from_array(np.array([0], np.int64), "axis0"),
         nh.from_array(np.zeros(2, np.float32), "b.H")],
    )
    for node in second.node:  # the second block has its own counter
        node.input[:] = ["T2" if i == "T" else i for i in node.input]
    info = model.training_info.add()
    info.algorithm.CopyFrom(first)
    for k, v in (("W", "W.new"), ("W.V", "W.V.new"), ("T", "T.new")):
        info.update_binding.add(key=k, value=v)
    info = model.training_info.add()
    info.algorithm.CopyFrom(second)
    for k, v in (("b", "b.new"), ("b.H", "b.H.new"), ("T2", "T.new")):
        info.update_binding.add(key=k, value=v)
    return model, w, b


@pytest.mark.parametrize("fast", [True, False])
def test_training_infos_run_in_order(fast):
    from onnx_training_ops.optim.adagrad import adagrad as reference_adagrad

    model, w, b = _block_coordinate_model()
    session = TrainingSession(model, fast=fast)
    assert len(session.fast_path_nodes) == (2 if fast else 0)
    x, t = _regression_data()
    v, hb = np.zeros_like(w), np.zeros_like(b)
    for step in range(4):
        session.step({"x": x, "t": t}, lr=None)
        r = x @ w + b - t
        w, v = reference_momentum(np.float32(0.01), np.int64(step), w, (x.T @ r).astype(np.float32), v,
                                  alpha=0.5, beta=1.0, mode="standard", norm_coefficient=0.0)
        r = x @ w + b - t  # the second block sees the W the first one wrote
        b, hb = reference_adagrad(np.float32(0.1), np.int64(step), b, r.sum(axis=0).astype(np.float32), hb,
                                  epsilon=np.float32(1e-6).item())
        state = session.state_dict()
        np.testing.assert_allclose(state["W"], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["b"], b, rtol=1e-5, atol=1e-6)
    assert int(state["T"]) == 4 and int(state["T2"]) == 4


def test_lr_without_a_learning_rate_input_is_an_error():
    model = linear_regression_adam()
    algo = model.training_info[0].algorithm
    kept = [vi for vi in algo.input if vi.name != "learning_rate"]
    del algo.input[:]
    algo.input.extend(kept)  # R is now a constant initializer
    session = TrainingSession(model)
    assert session.learning_rate_names == []
    x, y = _regression_data()
    session.step({"x": x, "target": y})
    with pytest.raises(TrainingOpError, match="lr was given but"):
        session.step({"x": x, "target": y}, lr=0.1)


def test_input_with_default_is_optional_and_never_stale():
    """An algorithm input with an initializer (a default) may be fed or left out, step by step."""
    model = linear_regression_adam()
    algo = model.training_info[0].algorithm
    # loss scale: an input with default 1.0 multiplying the gradient
    algo.input.append(h.make_tensor_value_info("grad_scale", TP.FLOAT, []))
    algo.initializer.append(nh.from_array(np.array(1.0, np.float32), "grad_scale"))
    for node in algo.node:
        if node.op_type == "Adam":
            node.input[4] = "W.grad.scaled"
    algo.node.insert(len(algo.node) - 1, h.make_node("Mul", ["W.grad", "grad_scale"], ["W.grad.scaled"]))
    session = TrainingSession(model)
    assert session.optional_feed_names == ["grad_scale", "learning_rate"]
    x, y = _regression_data()
    session.step({"x": x, "target": y, "grad_scale": np.float32(0.0)})  # W does not move (Adam: V = H = 0)
    w0 = session.state_dict()["W"]
    np.testing.assert_array_equal(w0, nh.to_array(linear_regression_adam().graph.initializer[0]))
    session.step({"x": x, "target": y})  # default again, not the 0.0 fed before
    assert np.any(session.state_dict()["W"] != w0)
    with pytest.raises(TrainingOpError, match="feed 'grad_scale' must be float32"):
        session.step({"x": x, "target": y, "grad_scale": np.float64(1.0)})


def test_flat_parallel_kernel_is_bit_exact_with_per_tensor_serial():
    """64-240-10: the flat state (18010 floats) takes the parallel fused kernel, the full graph's
    per-tensor nodes the serial one (each tensor < 16384 floats): still bit-exact."""
    from onnx_training_ops.kernels import fused

    model = build_training_model(make_mlp((64, 240, 10), seed=9), "cross_entropy", Adam(lr=1e-2))
    fast, full = TrainingSession(model, fast=True), TrainingSession(model, fast=False)
    x, y = _digits_like(3)
    for _ in range(5):
        fast.step({"input": x, "labels": y})
        full.step({"input": x, "labels": y})
    flat = fast._programs.steps[0].analysis.cut.plan[0].tensors[0]
    threshold = getattr(fused, "PARALLEL_THRESHOLDS", {}).get("adam", fused.PARALLEL_THRESHOLD)
    assert flat.size >= threshold > max(v.size for v in full.state_dict().values())
    for name, value in fast.state_dict().items():
        assert value.tobytes() == full.state_dict()[name].tobytes(), name


def test_from_graph_whose_only_node_is_the_optimizer():
    """The fast path cuts the only node; onnxruntime must still get a graph it accepts."""
    from onnx import TensorProto, helper, numpy_helper

    from onnx_training_ops.optim.adam import adam as reference_adam

    rng = np.random.default_rng(0)
    state = {k: rng.random(5).astype(np.float32) for k in ("X", "V", "H")}
    consts = {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64)}
    node = helper.make_node("Adam", ["R", "T", "X", "G", "V", "H"], ["X_new", "V_new", "H_new"],
                            domain="ai.onnx.preview.training")
    graph = helper.make_graph(
        [node], "only_adam", [helper.make_tensor_value_info("G", TensorProto.FLOAT, [5])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [5]) for o in node.output],
        [numpy_helper.from_array(v, k) for k, v in {**state, **consts}.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.preview.training", 1)])
    session = TrainingSession.from_graph(model, feedback={"X_new": "X", "V_new": "V", "H_new": "H"})
    assert session.fast_path_nodes
    x, v, h = state["X"], state["V"], state["H"]
    for _ in range(3):
        g = rng.random(5).astype(np.float32)
        session.step({"G": g})
        x, v, h = reference_adam(consts["R"], consts["T"], x, g, v, h)
    np.testing.assert_array_equal(session.state_dict()["X"], x)
    np.testing.assert_array_equal(session.state_dict()["H"], h)


def test_session_options_reach_every_onnxruntime_session_and_profiling_works(tmp_path):
    import json

    import onnxruntime as ort

    from onnx_training_ops import Adam, build_training_model
    from onnx_training_ops.demo import make_mlp

    so = ort.SessionOptions()
    so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / "trace")
    so.intra_op_num_threads, so.use_deterministic_compute = 1, True
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = TrainingSession(build_training_model(make_mlp((8, 16, 4)), "cross_entropy", Adam()),
                              sess_options=so, session_config={"session.set_denormal_as_zero": "1"})
    made = session._programs.options()
    assert made is not so and made.intra_op_num_threads == 1 and made.use_deterministic_compute
    assert made.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert made.get_session_config_entry("session.set_denormal_as_zero") == "1"
    feeds = {"input": np.ones((4, 8), np.float32), "labels": np.zeros(4, np.int64)}
    session.step(feeds)
    session.evaluate(feeds)
    files = session.end_profiling()
    assert len(files) == 2  # the step program and the evaluation program
    events = json.loads(open(files[0]).read())
    assert any(e.get("cat") == "Node" for e in events)


def test_a_feed_array_reused_across_steps_is_read_with_its_new_contents():
    """The session skips rebinding a feed that is the very array bound last step; onnxruntime
    reads it in place, so changing it in place between steps must train on the new values."""
    from onnx_training_ops import Adam, build_training_model
    from onnx_training_ops.demo import make_mlp

    model = build_training_model(make_mlp((8, 16, 4)), "cross_entropy", Adam())
    reused, fresh = TrainingSession(model), TrainingSession(model)
    rng = np.random.default_rng(0)
    x, y = np.empty((16, 8), np.float32), np.empty(16, np.int64)
    for _ in range(4):
        x[...] = rng.standard_normal((16, 8))
        y[...] = rng.integers(0, 4, 16)
        a = reused.step({"input": x, "labels": y})
        b = fresh.step({"input": x.copy(), "labels": y.copy()})
        assert a["loss"] == b["loss"]
    for name, value in fresh.state_dict().items():
        np.testing.assert_array_equal(reused.state_dict()[name], value)
    with pytest.raises(TrainingOpError, match="must have shape"):  # still checked when it changes
        reused.step({"input": x[:, :4].copy(), "labels": y})


@pytest.mark.parametrize("sizes,threads", [((8, 16, 4), 1), ((512, 256, 4), 0)])
def test_a_small_model_gets_one_intra_op_thread_unless_options_are_given(sizes, threads):
    """Defaults by measurement (benchmarks/bench_threads.py): up to SMALL_GRAPH_PARAMETERS
    trainable values one thread, else onnxruntime's default; the caller's options win."""
    from onnx_training_ops import Adam, build_training_model

    model = build_training_model(make_mlp(sizes), "cross_entropy", Adam())
    session = TrainingSession(model)
    assert {p.session.get_session_options().intra_op_num_threads for p in session._programs.steps} == {threads}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    given = TrainingSession(model, sess_options=so)
    assert {p.session.get_session_options().intra_op_num_threads for p in given._programs.steps} == {2}
