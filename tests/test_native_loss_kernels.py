"""Native ReLU-gradient and cross-entropy kernels (``ai.onnx.contrib::Training*``): each against
its standard-op form (the same model prepared native and portable: equal outputs and
gradients), the standard rule against float64 finite differences, a bad label as an error
naming the node, the MLP step graph and a few AdamW steps against torch."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gradient_utils import check_gradient, gradient_model
from onnx import helper

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.runtime import custom_op, native, native_grads

pytestmark = pytest.mark.skipif(not native.availability()[0], reason="native kernels unavailable here")

CONTRIB = "ai.onnx.contrib"
RTOL = 1e-6


def _native_and_portable(model, feeds, outs, threads=1):
    """(native model, native outputs, portable outputs)."""
    prepared = ot.prepare(model, kernels="native")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    got = ot.InferenceSession(prepared, so).run(outs, feeds)
    want = ot.InferenceSession(ot.prepare(model, portable=True)).run(outs, feeds)
    return prepared, got, want


def _contrib_ops(model):
    return {n.op_type for n in model.graph.node if n.domain == CONTRIB}


# ------------------------------------------------------------------ ReLU gradient
def _relu(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 2.0, shape) * rng.choice([-1.0, 1.0], shape)  # away from the kink
    w = rng.standard_normal(shape[-1:])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Mul", ["r", "w"], ["y"])]
    return nodes, {"x": x, "w": w}


@pytest.mark.parametrize("shape,threads", [((5, 7), 1), ((3, 4, 6), 1),
                                           ((3, native_grads.RELU_PARALLEL_MIN // 3 + 5), 2)], ids=str)
def test_relu_grad_equals_the_standard_rule(shape, threads):
    """The last shape passes the parallel threshold: chunks on the pool, a short last one."""
    nodes, feeds = _relu(shape, sum(shape))
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    model = gradient_model(nodes, f32, "y", ["x", "w"], opset=17)
    prepared, got, want = _native_and_portable(model, f32, ["y", "d_x", "d_w"], threads)
    ops = [n.op_type for n in prepared.graph.node]
    assert "TrainingReluGrad" in ops and not {"Greater", "Cast", "Where"} & set(ops)
    assert not _contrib_ops(ot.prepare(model, kernels="pyop"))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=0)
    np.testing.assert_array_equal(got[1], want[1])  # one product per element, as the Mul


def test_relu_standard_rule_matches_finite_differences():
    nodes, feeds = _relu((4, 5), 1)
    check_gradient(nodes, feeds, "y", ["x", "w"], opset=17)


def test_relu_grad_keeps_nan_and_inf_as_the_mul_does():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "w"], ["y"])]
    x = np.array([[-1.0, 0.0, 2.0, np.nan]], np.float32)
    w = np.array([np.inf, np.inf, np.inf, 1.0], np.float32)
    model = gradient_model(nodes, {"x": x, "w": w}, "y", ["x"], opset=17)
    _, got, want = _native_and_portable(model, {"x": x, "w": w}, ["d_x"])
    np.testing.assert_array_equal(got[0], want[0])  # inf * 0 = NaN where x <= 0


# ------------------------------------------------------------------ cross entropy
def _cross_entropy(reduction, ignore, rows=6, classes=4, seed=3):
    rng = np.random.default_rng(seed)
    scores = rng.uniform(-2, 2, (rows, classes))
    labels = rng.integers(0, classes, rows).astype(np.int64)
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], name="sce", **attrs),
             helper.make_node("Mul", ["loss", "k"], ["y"])]
    return nodes, scores, labels


def _ce_model(nodes, scores, labels):
    feeds = {"scores": scores.astype(np.float32), "labels": labels}
    return gradient_model(nodes, feeds, "y", ["scores"], opset=18, initializers={"k": np.float32(1.5)}), feeds


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [None, -100, 1, -1])
def test_cross_entropy_equals_the_standard_form_and_finite_differences(reduction, ignore):
    nodes, scores, labels = _cross_entropy(reduction, ignore)
    if ignore is not None:
        labels[[0, 4]] = ignore
    model, feeds = _ce_model(nodes, scores, labels)
    prepared, got, want = _native_and_portable(model, feeds, ["y", "d_scores"])
    ops = [n.op_type for n in prepared.graph.node]
    assert {"TrainingCrossEntropyLoss", "TrainingCrossEntropyGrad"} <= set(ops)
    assert not {"OneHot", "SoftmaxCrossEntropyLoss"} & set(ops) and ops.count("LogSoftmax") <= 2
    assert not _contrib_ops(ot.prepare(model, portable=True))
    for a, b in zip(got, want):  # g = 1.5: d / (count / g) against d * (g / count), an ulp apart
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7 * np.abs(b).max())
    # the loss itself (its gradient seeded with a constant 1, as in training): the gradient
    # bit-identical, the loss (summed in float64) within float32 round-off
    alone = gradient_model(nodes[:1], feeds, "loss", ["scores"], opset=18)
    _, seeded, standard = _native_and_portable(alone, feeds, ["loss", "d_scores"])
    np.testing.assert_allclose(seeded[0], standard[0], rtol=RTOL)
    np.testing.assert_array_equal(seeded[1], standard[1])
    # the standard rule in float64 against central differences; the native float32 gradient
    # against that float64 one
    exact = check_gradient(nodes, {"scores": scores, "labels": labels}, "y", ["scores"], opset=18,
                           initializers={"k": np.asarray(1.5)})
    np.testing.assert_allclose(got[1], exact["d_scores"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_labels_ignored_give_what_the_standard_form_gives(reduction):
    """mean: 0/0, a NaN loss and NaN gradient everywhere; sum: 0 and zeros."""
    nodes, scores, labels = _cross_entropy(reduction, -100)
    labels[:] = -100
    model, feeds = _ce_model(nodes, scores, labels)
    _, got, want = _native_and_portable(model, feeds, ["y", "d_scores"])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert np.isnan(got[0]) == np.isnan(got[1]).all() == (reduction == "mean")


def test_a_larger_batch_and_the_gather_form_left_alone():
    """64 x 10 (the MLP's head) natively; past GATHER_FORM_CLASSES the gathered standard form."""
    nodes, scores, labels = _cross_entropy("mean", -100, rows=64, classes=10, seed=5)
    model, feeds = _ce_model(nodes, scores, labels)
    _, got, want = _native_and_portable(model, feeds, ["y", "d_scores"])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7 * np.abs(b).max())
    nodes, scores, labels = _cross_entropy("mean", -100, rows=8, classes=80)
    model, _ = _ce_model(nodes, scores, labels)
    assert not _contrib_ops(ot.prepare(model, kernels="native"))


@pytest.mark.parametrize("bad", [4, -1, -100, 1 << 40])
def test_a_bad_label_is_an_error_naming_the_node(bad):
    """Neither in [0, C) nor the ignore_index (1 here): onnxruntime's error names the loss node;
    the session still runs after it."""
    nodes, scores, labels = _cross_entropy("mean", 1)
    model, feeds = _ce_model(nodes, scores, labels)
    session = ot.InferenceSession(ot.prepare(model, kernels="native"))
    good = session.run(["y", "d_scores"], feeds)
    with pytest.raises(Exception, match=r"TrainingCrossEntropy(Loss|Grad) node '[^']*sce[^']*': .*labels"):
        session.run(["y", "d_scores"], feeds | {"labels": np.where(np.arange(6) == 2, bad, labels)})
    for a, b in zip(session.run(["y", "d_scores"], feeds), good):
        np.testing.assert_array_equal(a, b)


def test_the_gradient_kernel_checks_labels_too():
    node = helper.make_node("TrainingCrossEntropyGrad", ["g", "prob", "labels", "config"], ["d"], domain=CONTRIB,
                            name="ce_grad_1")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("g", 1, None),
                                            helper.make_tensor_value_info("prob", 1, None),
                                            helper.make_tensor_value_info("labels", 7, None),
                                            helper.make_tensor_value_info("config", 7, None)],
                              [helper.make_tensor_value_info("d", 1, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    model.ir_version = 8
    session = ot.InferenceSession(model)
    feeds = {"g": np.array(1, np.float32), "prob": np.full((2, 3), 1 / 3, np.float32),
             "config": np.array([0, 0, 0], np.int64)}
    d = session.run(None, feeds | {"labels": np.array([0, 2], np.int64)})[0]
    np.testing.assert_allclose(d, (np.full((2, 3), 1 / 3) - np.eye(3)[[0, 2]]) / 2, rtol=1e-6)
    for labels, config in [([0, 3], [0, 0, 0]), ([0, -1], [1, 0, 0]), ([0, 1], [2, 0, 0]), ([0, 1, 1], [0, 0, 0])]:
        with pytest.raises(Exception, match="ce_grad_1"):
            session.run(None, feeds | {"labels": np.array(labels, np.int64), "config": np.array(config, np.int64)})


# ------------------------------------------------------------------ the MLP step
def test_the_mlp_step_graph_runs_the_native_kernels(tmp_path):
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    model = ot.build_training_model(make_mlp((16, 32, 10)), "cross_entropy", ot.AdamW(lr=1e-3))
    ot.TrainingSession(model, sess_options=so)
    ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert {"TrainingReluGrad", "TrainingCrossEntropyLoss", "TrainingCrossEntropyGrad"} <= set(ops)
    assert not {"OneHot", "Greater", "Cast", "Neg", "Div"} & set(ops), ops
    assert ops.count("LogSoftmax") == ops.count("Exp") == 1 and len(ops) <= 15, ops  # 25 with the standard ops


def test_a_few_adamw_steps_follow_torch():
    torch = pytest.importorskip("torch")
    sizes, batch = (12, 24, 5), 16
    model = make_mlp(sizes, seed=4)
    session = ot.TrainingSession(ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=1e-2,
                                                                                          weight_decay=0.1)))
    init = session.state_dict()
    net = torch.nn.Sequential(torch.nn.Linear(*sizes[:2]), torch.nn.ReLU(), torch.nn.Linear(*sizes[1:])).double()
    with torch.no_grad():
        for i, layer in enumerate((net[0], net[2])):
            layer.weight.copy_(torch.from_numpy(init[f"W{i}"].T.copy()))
            layer.bias.copy_(torch.from_numpy(init[f"b{i}"].copy()))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(0)
    for step in range(4):
        x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
        y = rng.integers(0, sizes[-1], batch).astype(np.int64)
        y[step] = -100  # torch's default ignore_index, as the builder's
        loss = session.step({"input": x, "labels": y})
        opt.zero_grad()
        want = torch.nn.functional.cross_entropy(net(torch.from_numpy(x).double()), torch.from_numpy(y))
        want.backward()
        opt.step()
        np.testing.assert_allclose(float(loss["loss"]), want.item(), rtol=1e-5)
    # Adam's first steps move a weight with a near-zero gradient by up to lr on float32 noise:
    # 1.5e-4 here, the same on the standard-op path; allowed 0.02 lr
    state = session.state_dict()
    for i, layer in enumerate((net[0], net[2])):
        np.testing.assert_allclose(state[f"W{i}"], layer.weight.detach().numpy().T, rtol=0, atol=2e-4)
        np.testing.assert_allclose(state[f"b{i}"], layer.bias.detach().numpy(), rtol=0, atol=2e-4)


def test_shapes_read_through_the_older_api_too(monkeypatch):
    """Below API 24 the kernels read shapes with GetTensorTypeAndShape (forced here)."""
    monkeypatch.setattr(custom_op, "USE_SHAPE_REFERENCE", False)
    nodes, feeds = _relu((3, native_grads.RELU_PARALLEL_MIN // 3 + 5), 2)
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    _, got, want = _native_and_portable(gradient_model(nodes, f32, "y", ["x"], opset=17), f32, ["d_x"], 2)
    np.testing.assert_array_equal(got[0], want[0])
    nodes, scores, labels = _cross_entropy("sum", 1)
    model, feeds = _ce_model(nodes, scores, labels)
    _, got, want = _native_and_portable(model, feeds, ["y", "d_scores"])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7 * np.abs(b).max())
