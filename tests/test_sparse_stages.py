"""backward / optimizer_step on sparse tables (``sparse_updates``): one backward + optimizer_step
is a step bit for bit; k micro-batches are lazy updates of the union of their rows with the
mean gradient (torch ``SparseAdam`` with accumulation) against float64 references; the table's
dense accumulator and touched counter in ``gradient_buffers()`` average across processes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper
from test_sparse_updates import (
    B1,
    B2,
    EPS,
    N,
    batches,
    emb_model,
    lazy_adam,
    lazy_rmsprop,
    sparse_adagrad,
    sparse_momentum,
    table_grad,
    tf_sparse_adam,
    two_lookup_model,
)

from onnx_training_ops import Adagrad, Adam, AdamW, Momentum, RMSProp, TrainingSession, build_training_model
from onnx_training_ops.errors import TrainingOpError

# mode, optimizer, float64 reference of one update (test_sparse_updates), its state names
CASES = [
    ("lazy", Adam(lr=0.05, betas=(B1, B2), eps=EPS), lazy_adam(0.05, B1, B2, EPS), ("V", "H")),
    ("sparse", Adam(lr=0.05, betas=(B1, B2), eps=EPS, weight_decay=0.125),
     tf_sparse_adam(0.05, B1, B2, EPS, 0.125), ("V", "H")),
    ("lazy", AdamW(lr=0.05, betas=(B1, B2), eps=EPS, weight_decay=0.0), lazy_adam(0.05, B1, B2, EPS), ("V", "H")),
    ("sparse", AdamW(lr=0.05, betas=(B1, B2), eps=EPS, weight_decay=0.0),
     tf_sparse_adam(0.05, B1, B2, EPS), ("V", "H")),
    ("lazy", Adagrad(lr=0.1, eps=EPS), sparse_adagrad(0.1, EPS), ("H",)),
    ("sparse", Adagrad(lr=0.1, eps=EPS), sparse_adagrad(0.1, EPS), ("H",)),
    ("lazy", Momentum(lr=0.05, momentum=0.75), sparse_momentum(0.05, 0.75), ("V",)),
    ("sparse", Momentum(lr=0.05, momentum=0.75), sparse_momentum(0.05, 0.75), ("V",)),
    ("lazy", RMSProp(lr=0.01, alpha=0.9, eps=1e-6, momentum=0.5), lazy_rmsprop(0.01, 0.9, 1e-6, 0.5),
     ("square_avg", "momentum_buffer")),
    ("sparse", RMSProp(lr=0.01, alpha=0.9, eps=1e-6, momentum=0.5), lazy_rmsprop(0.01, 0.9, 1e-6, 0.5),
     ("square_avg", "momentum_buffer")),
]
IDS = [f"{type(c[1]).__name__}-{c[0]}" for c in CASES]


def session(optimizer, mode, fast, trainable=("E",), dtype=np.float64) -> TrainingSession:
    model = build_training_model(emb_model(dtype), "mse", optimizer, trainable=list(trainable),
                                 sparse_updates={"E": mode})
    return TrainingSession(model, fast=fast)


def assert_rows_in_place(s: TrainingSession, mode: str, optimizer, fast: bool) -> None:
    """The apply stage's table update runs in the fast path's row kernels (in place), not in
    onnxruntime: rows from the touched counter, so nothing left to deduplicate."""
    _, apply, _, _ = s._loop.accumulation.programs()
    _, rows, rms = apply.analysis.updates  # cut nodes, row updates, RMSProp
    groups = rows.groups + [g for g in rms.groups if g.rows]
    if mode == "lazy" or not isinstance(optimizer, Adam):  # TF's sparse Adam is dense work
        assert len(groups) == int(fast) and not any(g.dedup for g in groups)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "graph"])
@pytest.mark.parametrize("mode,optimizer,reference,states", CASES, ids=IDS)
def test_backward_then_optimizer_step_is_a_step_bit_for_bit(mode, optimizer, reference, states, fast, dtype):
    data = [(ids, t.astype(dtype)) for ids, t in batches(negative=True)[:3]]  # duplicates, negative ids
    stepped, staged = (session(optimizer, mode, fast, trainable=("E", "W"), dtype=dtype) for _ in range(2))
    for ids, target in data:
        loss = stepped.step({"ids": ids, "target": target})["loss"]
        assert staged.backward({"ids": ids, "target": target})["loss"] == loss
        staged.optimizer_step()
    assert_rows_in_place(staged, mode, optimizer, fast)
    for name, value in stepped.state_dict().items():
        np.testing.assert_array_equal(staged.state_dict()[name], value, err_msg=name)


def micro_batches(k: int = 3, steps: int = 3):
    """``steps`` optimizer steps of ``k`` micro-batches each; step 2's first micro-batch comes
    with scale 0, so its rows are touched with a zero gradient (when no other batch has them)."""
    data = batches(seed=5, high=N - 10, negative=True)
    plan = []
    for t in range(steps):
        plan.append([(ids, target, 0.0 if (t, j) == (1, 0) else 1 / k)
                     for j, (ids, target) in enumerate(data[t * k:(t + 1) * k])])
    return plan


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "graph"])
@pytest.mark.parametrize("mode,optimizer,reference,states", CASES, ids=IDS)
def test_micro_batches_are_lazy_updates_of_the_touched_rows_with_the_mean_gradient(
        mode, optimizer, reference, states, fast):
    plan = micro_batches()
    s = session(optimizer, mode, fast)
    init = {t.name: numpy_helper.to_array(t) for t in emb_model().graph.initializer}
    E, W = init["E"].copy(), init["W"]
    ref_states = [np.zeros_like(E) for _ in states]
    for t, step in enumerate(plan, 1):
        dense, touched = np.zeros_like(E), np.zeros(N, bool)
        for ids, target, scale in step:
            s.backward({"ids": ids, "target": target}, scale=scale)
            rows, g = table_grad(E, W, ids, target)
            dense[rows] += scale * g
            touched[rows] = True
        np.testing.assert_allclose(s.gradients()["E"], dense, rtol=1e-12, atol=1e-15)
        s.optimizer_step()
        rows = np.flatnonzero(touched)
        reference(E, ref_states, rows, dense[rows], t)
    assert_rows_in_place(s, mode, optimizer, fast)
    got = s.state_dict()
    np.testing.assert_allclose(got["E"], E, rtol=1e-10, atol=1e-12)
    for name, value in zip(states, ref_states):
        np.testing.assert_allclose(got[f"E.{name}"], value, rtol=1e-10, atol=1e-12, err_msg=name)
    if mode == "lazy" or not isinstance(optimizer, Adam):  # never-touched rows keep X and moments
        np.testing.assert_array_equal(got["E"][N - 10:], init["E"][N - 10:])
        assert not any(got[f"E.{name}"][N - 10:].any() for name in states)


def test_a_row_touched_with_a_zero_gradient_is_updated():
    """Lazy Adam decays the moments of a looked-up row even when its gradient is 0 (as a step)."""
    s = session(Adam(lr=0.05), "lazy", True)
    ids, target = batches()[0]
    s.step({"ids": ids, "target": target})
    before = s.state_dict()
    s.backward({"ids": ids[:1], "target": target[:1]}, scale=0.0)
    s.optimizer_step()
    after = s.state_dict()
    rows = np.unique(ids[0])
    assert (after["E.V"][rows] != before["E.V"][rows]).all()
    np.testing.assert_array_equal(after["E.V"][rows], before["E.V"][rows] * np.float32(0.9))
    others = np.setdiff1d(np.arange(N), rows)
    np.testing.assert_array_equal(after["E.V"][others], before["E.V"][others])


def test_gradient_buffers_average_across_processes():
    """What an all-reduce does (sum over ranks, then × 1/world) to each rank's buffers gives the
    update of the mean gradient over the union of every rank's rows; zero_grad zeroes all."""
    data = batches(negative=True)
    ranks = [session(Adam(lr=0.05), "lazy", True, trainable=("E", "W")) for _ in range(2)]
    single = session(Adam(lr=0.05), "lazy", True, trainable=("E", "W"))
    for r, s in enumerate(ranks):
        s.backward({"ids": data[r][0], "target": data[r][1]})
        single.backward({"ids": data[r][0], "target": data[r][1]}, scale=0.5)
    (buffer,) = ranks[0].gradient_buffers()  # one dtype: W's gradient, E's, E's counter
    assert buffer.size == 4 + N * 4 + N
    assert np.shares_memory(buffer, ranks[0]._loop.accumulation.accumulators["E.grad.accumulated"])
    mean = (ranks[0].gradient_buffers()[0] + ranks[1].gradient_buffers()[0]) * 0.5
    for s in ranks:
        s.gradient_buffers()[0][...] = mean
    for s in (*ranks, single):
        s.optimizer_step()
        assert not any(b.any() for b in s.gradient_buffers())
    for name, value in single.state_dict().items():
        for s in ranks:
            np.testing.assert_allclose(s.state_dict()[name], value, rtol=1e-12, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("optimizer", [Adam(lr=0.05), RMSProp(lr=0.01, momentum=0.5)], ids=["Adam", "RMSProp"])
def test_gradient_views_reduce_to_the_owner_of_a_sharded_table(optimizer):
    """ZeRO-1 shards (training/state/shard.py) simulated in one process: each rank accumulates every
    table's gradient and counter (``gradient_views``: E twice); averaged, the owner's update
    equals one session's on both micro-batches, and the other rank leaves the table alone."""
    from onnx_training_ops.training.state.shard import partition, shard_model

    model = build_training_model(emb_model(), "mse", optimizer, sparse_updates={"E": "lazy"})
    owners = partition(model, 2)
    ranks = [TrainingSession(shard_model(model, owners, r, 2)) for r in range(2)]
    single = TrainingSession(model)
    data = batches(negative=True)
    for step in range(2):
        for r, s in enumerate(ranks):
            ids, target = data[2 * step + r]
            s.backward({"ids": ids, "target": target})
            single.backward({"ids": ids, "target": target}, scale=0.5)
        views = [s.gradient_views() for s in ranks]
        assert [p for p, _ in views[0]] == ["W", "E", "E"]
        for (_, a), (_, b) in zip(*views):
            a[...] = b[...] = (a + b) * 0.5
        for s in (*ranks, single):
            s.optimizer_step()
        for param, owner in owners.items():  # the owner's parameters to every rank
            for s in ranks:
                s.state_views([param])[0][...] = ranks[owner].state_views([param])[0]
    for s in ranks:
        for name, value in s.state_dict().items():
            np.testing.assert_allclose(value, single.state_dict()[name], rtol=1e-12, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_two_lookups_of_one_table(mode):
    """Two Gathers (int64 and negative int32 ids) of one float32 table, fast path and graph."""
    model = build_training_model(two_lookup_model(), "mse", Adam(lr=0.05), sparse_updates={"E": "lazy"},
                                 mode=mode)
    rng = np.random.default_rng(0)
    feeds = [{"a": rng.integers(0, 10, (6, 2)), "b": rng.integers(-N, -N + 10, (6, 3)).astype(np.int32),
              "target": rng.standard_normal((6, 4)).astype(np.float32)} for _ in range(3)]
    for fast in (True, False):
        stepped, staged = TrainingSession(model, fast=fast), TrainingSession(model, fast=fast)
        for f in feeds:
            stepped.step(f)
            staged.backward(f)
            staged.optimizer_step()
        for name, value in stepped.state_dict().items():
            np.testing.assert_array_equal(staged.state_dict()[name], value, err_msg=name)


def test_a_gradient_x_that_is_no_lookup_is_named():
    model = build_training_model(emb_model(), "mse", Adam(), sparse_updates={"E": "lazy"})
    gradient = next(n for n in model.training_info[0].algorithm.node if n.op_type == "Gradient")
    xs = next(a for a in gradient.attribute if a.name == "xs")
    xs.strings[list(xs.strings).index(b"e")] = b"s"  # the ReduceSum after the lookup
    gradient.input[list(gradient.input).index("e")] = "s"
    with pytest.raises(TrainingOpError, match="x 's' is neither an initializer nor an axis-0 Gather.*ReduceSum"):
        TrainingSession(model).backward({"ids": batches()[0][0], "target": batches()[0][1]})
