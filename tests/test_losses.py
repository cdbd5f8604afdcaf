"""Every builder loss against its torch.nn counterpart: the loss TrainingSession reports and
the one-step update (plain SGD, so the update is -lr * gradient) on a tiny linear model."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_training_ops as ot

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _linear_model(shape_in, classes, dtype, class_axis_last=False):
    """logits = x @ W + b, with x [..., D]; classes on the last axis, or moved to axis 1."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((shape_in[-1], classes)).astype(dtype)
    b = rng.standard_normal(classes).astype(dtype)
    tp = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]), helper.make_node("Add", ["mm", "B"], ["z"])]
    out_shape = list(shape_in[:-1]) + [classes]
    if not class_axis_last and len(shape_in) > 2:
        perm = [0, len(shape_in) - 1] + list(range(1, len(shape_in) - 1))
        nodes.append(helper.make_node("Transpose", ["z"], ["logits"], perm=perm))
        out_shape = [out_shape[p] for p in perm]
    else:
        nodes.append(helper.make_node("Identity", ["z"], ["logits"]))
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", tp, list(shape_in))],
                              [helper.make_tensor_value_info("logits", tp, out_shape)],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w, b


def _torch_step(w, b, x, fn, lr):
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    out = torch.tensor(x) @ tw + tb
    loss = fn(out)
    loss.backward()
    return float(loss.detach()), w - lr * tw.grad.numpy(), b - lr * tb.grad.numpy()


def _ours(model, loss, feeds, lr):
    ts = ot.TrainingSession(ot.build_training_model(model, loss, ot.Momentum(lr=lr, momentum=0.0)))
    got = ts.step(feeds)
    state = ts.state_dict()
    return float(got["loss"]), state["W"], state["B"]


def _compare(ours, theirs, dtype):
    rtol = 2e-5 if dtype == np.float32 else 1e-10
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * 1e-1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [
    {},
    {"reduction": "sum"},
    {"label_smoothing": 0.1},
    {"weight": (0.5, 2.0, 1.0, 1.5)},
    {"weight": (0.5, 2.0, 1.0, 1.5), "label_smoothing": 0.2, "ignore_index": 3},
    {"ignore_index": 2, "reduction": "sum", "label_smoothing": 0.3},
])
def test_cross_entropy_matches_torch(dtype, options):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3)).astype(dtype)
    labels = np.array([0, 1, 2, 3, 2], np.int64)
    model, w, b = _linear_model(x.shape, 4, dtype)
    torch_opts = {k: (torch.tensor(v, dtype=torch.float64 if dtype == np.float64 else torch.float32)
                      if k == "weight" else v) for k, v in options.items()}
    theirs = _torch_step(w, b, x, lambda out: F.cross_entropy(out, torch.tensor(labels), **torch_opts), 0.5)
    ours = _ours(model, ot.CrossEntropyLoss(**options), {"x": x, "labels": labels}, 0.5)
    _compare(ours, theirs, dtype)


@pytest.mark.parametrize("options", [{}, {"reduction": "sum"}, {"ignore_index": None},
                                     {"ignore_index": 7, "reduction": "sum"}, {"label_smoothing": 0.1}])
def test_cross_entropy_over_many_classes_matches_torch(options):
    """Past GATHER_FORM_CLASSES classes the loss and its gradient pick the label columns
    (GatherElements / ScatterElements) instead of a one-hot."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 3)).astype(np.float32)
    labels = np.array([0, 7, 99, 7, -100, 42], np.int64)
    if options.get("ignore_index", -100) != -100:
        labels[4] = 3
    model, w, b = _linear_model(x.shape, 100, np.float32)
    theirs = _torch_step(w, b, x, lambda out: F.cross_entropy(
        out, torch.tensor(labels), **{k: -200 if v is None else v for k, v in options.items()}), 0.5)
    _compare(_ours(model, ot.CrossEntropyLoss(**options), {"x": x, "labels": labels}, 0.5), theirs, np.float32)


@pytest.mark.parametrize("class_axis_last", [False, True])
def test_cross_entropy_over_sequences_reads_the_stated_class_axis(class_axis_last):
    """[N, T, C] (LM head, class_axis=-1) and [N, C, T] (torch layout, class_axis=1), with
    T == C: the case a guessed axis would get silently wrong."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    labels = rng.integers(0, 4, (2, 4)).astype(np.int64)
    model, w, b = _linear_model(x.shape, 4, np.float32, class_axis_last=class_axis_last)
    theirs = _torch_step(w, b, x, lambda out: F.cross_entropy(out.reshape(-1, 4),
                                                              torch.tensor(labels).reshape(-1)), 0.5)
    spec = ot.CrossEntropyLoss(class_axis=-1 if class_axis_last else 1)
    _compare(_ours(model, spec, {"x": x, "labels": labels}, 0.5), theirs, np.float32)


def test_cross_entropy_on_rank_3_logits_needs_the_class_axis():
    model, _, _ = _linear_model((2, 4, 3), 4, np.float32, class_axis_last=True)
    with pytest.raises(ot.TrainingOpError, match="state the class axis"):
        ot.build_training_model(model, "cross_entropy", ot.Adam())


def test_shifted_next_token_loss_matches_transformers_recipe():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    labels = rng.integers(0, 4, (2, 5)).astype(np.int64)
    labels[0, 3] = -100
    model, w, b = _linear_model(x.shape, 4, np.float32, class_axis_last=True)

    def causal(out):  # what transformers' causal-LM heads compute
        return F.cross_entropy(out[:, :-1].reshape(-1, 4), torch.tensor(labels[:, 1:]).reshape(-1))
    theirs = _torch_step(w, b, x, causal, 0.5)
    ours = _ours(model, ot.CrossEntropyLoss(shift_labels=True), {"x": x, "labels": labels}, 0.5)
    _compare(ours, theirs, np.float32)


@pytest.mark.parametrize("ignore_index,smoothing", [(None, 0.0), (None, 0.2), (-100, 0.2)])
def test_shifted_loss_without_ignore_index_and_with_smoothing_matches_torch(ignore_index, smoothing):
    """The shift ignores the last position even when ``ignore_index=None`` (an index no class
    equals), label smoothing included."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    labels = rng.integers(0, 4, (2, 5)).astype(np.int64)
    model, w, b = _linear_model(x.shape, 4, np.float32, class_axis_last=True)

    def causal(out):
        return F.cross_entropy(out[:, :-1].reshape(-1, 4), torch.tensor(labels[:, 1:]).reshape(-1),
                               label_smoothing=smoothing)
    theirs = _torch_step(w, b, x, causal, 0.5)
    loss = ot.CrossEntropyLoss(shift_labels=True, ignore_index=ignore_index, label_smoothing=smoothing)
    _compare(_ours(model, loss, {"x": x, "labels": labels}, 0.5), theirs, np.float32)


def test_causal_lm_loss_builds_no_tensor_the_size_of_the_logits_but_its_gradient():
    """The label shift moves the labels, not the logits: no slice, transpose or index map of
    [N, T, C] in the step graph (forward or backward)."""
    model, _, _ = _linear_model((2, 5, 3), 4, np.float32, class_axis_last=True)
    training = ot.build_training_model(model, ot.CrossEntropyLoss(shift_labels=True),
                                         ot.Momentum(lr=0.1, momentum=0.0))
    graph = ot.prepare(training).training_info[0].algorithm
    ops = [n.op_type for n in graph.node]
    assert not {"Range", "ScatterND", "ScatterElements", "Transpose"} & set(ops), ops
    moved = [n.input[0] for n in graph.node if n.op_type in ("Slice", "Gather", "Pad", "Concat")]
    assert moved == ["labels"], "only the labels move"


REGRESSION = {
    "mse": (ot.MSELoss, F.mse_loss, {}),
    "l1": (ot.L1Loss, F.l1_loss, {}),
    "huber": (ot.HuberLoss, F.huber_loss, {"delta": 0.7}),
    "smooth_l1": (ot.SmoothL1Loss, F.smooth_l1_loss, {"beta": 0.6}),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(REGRESSION))
def test_regression_losses_match_torch(name, reduction, dtype):
    ours_cls, torch_fn, opts = REGRESSION[name]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 3)).astype(dtype)
    target = rng.standard_normal((6, 2)).astype(dtype)
    model, w, b = _linear_model(x.shape, 2, dtype)
    theirs = _torch_step(w, b, x, lambda out: torch_fn(out, torch.tensor(target), reduction=reduction,
                                                       **opts), 0.1)
    ours = _ours(model, ours_cls(reduction=reduction, **opts), {"x": x, "target": target}, 0.1)
    _compare(ours, theirs, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [{}, {"pos_weight": (2.0, 0.5)}, {"weight": (1.5, 0.3)},
                                     {"reduction": "sum"}])
def test_bce_with_logits_matches_torch(options, dtype):
    rng = np.random.default_rng(5)
    x = (3 * rng.standard_normal((6, 3))).astype(dtype)
    target = rng.integers(0, 2, (6, 2)).astype(dtype)
    model, w, b = _linear_model(x.shape, 2, dtype)
    tt = torch.float64 if dtype == np.float64 else torch.float32
    torch_opts = {k: (torch.tensor(v, dtype=tt) if isinstance(v, tuple) else v) for k, v in options.items()}
    theirs = _torch_step(w, b, x, lambda out: F.binary_cross_entropy_with_logits(
        out, torch.tensor(target), **torch_opts), 0.1)
    ours = _ours(model, ot.BCEWithLogitsLoss(**options), {"x": x, "target": target}, 0.1)
    _compare(ours, theirs, dtype)


def test_loss_arguments_are_checked():
    with pytest.raises(ot.TrainingOpError, match="reduction"):
        ot.MSELoss(reduction="none")
    with pytest.raises(ot.TrainingOpError, match="label_smoothing"):
        ot.CrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(ot.TrainingOpError, match="loss must be"):
        ot.build_training_model(_linear_model((2, 3), 2, np.float32)[0], 3.0, ot.Adam())


def test_cross_entropy_without_ignore_index_equals_torch_on_valid_labels():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    labels = np.array([0, 1, 2, 3, 2], np.int64)
    model, w, b = _linear_model(x.shape, 4, np.float32)
    theirs = _torch_step(w, b, x, lambda out: F.cross_entropy(out, torch.tensor(labels),
                                                              label_smoothing=0.1), 0.5)
    ours = _ours(model, ot.CrossEntropyLoss(ignore_index=None, label_smoothing=0.1),
                 {"x": x, "labels": labels}, 0.5)
    _compare(ours, theirs, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["N,C,d1,d2", "N,T,C"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_over_extra_axes_with_every_option(layout, reduction, dtype):
    """[N, C, d1, d2] (class_axis=1) and [N, T, C] with T == C (class_axis=-1), with an
    ignored label present, label smoothing and class weights, against torch."""
    rng = np.random.default_rng(7)
    classes = 3
    shape_in = (2, 3, 2, 4) if layout == "N,C,d1,d2" else (2, 3, 4)
    x = rng.standard_normal(shape_in).astype(dtype)
    model, w, b = _linear_model(x.shape, classes, dtype, class_axis_last=layout == "N,T,C")
    labels = rng.integers(0, classes, shape_in[:-1]).astype(np.int64)
    labels.reshape(-1)[[1, 4]] = -100
    weight = (0.5, 2.0, 1.25)
    tt = torch.float64 if dtype == np.float64 else torch.float32
    opts = dict(label_smoothing=0.15, reduction=reduction)

    def theirs_fn(out):
        if layout == "N,C,d1,d2":  # torch's own layout: out is [N, d1, d2, C] here
            out = out.permute(0, 3, 1, 2)
        else:
            out = out.permute(0, 2, 1)  # [N, C, T]
        return F.cross_entropy(out, torch.tensor(labels), weight=torch.tensor(weight, dtype=tt),
                               **opts)
    theirs = _torch_step(w, b, x, theirs_fn, 0.3)
    spec = ot.CrossEntropyLoss(class_axis=1 if layout == "N,C,d1,d2" else -1, weight=weight,
                               **opts)
    _compare(_ours(model, spec, {"x": x, "labels": labels}, 0.3), theirs, dtype)


def test_bce_with_logits_pos_weight_and_weight_together():
    rng = np.random.default_rng(8)
    x = (2 * rng.standard_normal((5, 3))).astype(np.float64)
    target = rng.uniform(0, 1, (5, 2))  # soft targets, as torch allows
    model, w, b = _linear_model(x.shape, 2, np.float64)
    pw, wt = (1.5, 0.25), (0.7, 1.3)
    theirs = _torch_step(w, b, x, lambda out: F.binary_cross_entropy_with_logits(
        out, torch.tensor(target), pos_weight=torch.tensor(pw, dtype=torch.float64),
        weight=torch.tensor(wt, dtype=torch.float64), reduction="sum"), 0.1)
    ours = _ours(model, ot.BCEWithLogitsLoss(pos_weight=pw, weight=wt, reduction="sum"),
                 {"x": x, "target": target}, 0.1)
    _compare(ours, theirs, np.float64)
