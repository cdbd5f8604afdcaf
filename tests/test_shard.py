"""ZeRO-1's model rewrite (training/state/shard.py) in one process: ranks simulated by sharded
sessions whose gradients are averaged and whose parameters are copied from their owners by
hand give the bits of unsharded sessions doing the same, for every optimizer, parameter
groups, AdamW, clipping, the fast path and the full graph; each shard holds only its own
optimizer state."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_training_ops import Adagrad, Adam, AdamW, Momentum, RMSProp, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.training.state.shard import optimizer_state, partition, shard_model

SIZES, BATCH, STEPS = (6, 12, 5, 3), 12, 6


def _model(optimizer, **kwargs):
    return build_training_model(make_mlp(SIZES, activation="Tanh", dtype=np.float64, seed=5), "cross_entropy",
                                optimizer, **kwargs)


def _batch(k):
    rng = np.random.default_rng(k)
    return rng.standard_normal((BATCH, SIZES[0])), rng.integers(0, SIZES[-1], BATCH).astype(np.int64)


def _simulate(sessions, owners, steps=STEPS, lr=None):
    """Data-parallel steps over ``sessions`` (one per rank): equal shards of each batch,
    gradients summed then scaled by 1/world, owners' parameters copied to every rank."""
    world = len(sessions)
    for k in range(steps):
        x, y = _batch(k)
        rows = BATCH // world
        for r, s in enumerate(sessions):
            s.backward({"input": x[r * rows:(r + 1) * rows], "labels": y[r * rows:(r + 1) * rows]})
        buffers = [s.gradient_buffers()[0] for s in sessions]
        total = buffers[0].copy()
        for b in buffers[1:]:
            total += b
        total *= 1.0 / world
        for b in buffers:
            b[...] = total
        for s in sessions:
            own = set(s.learning_rate_names)
            s.optimizer_step({n: v for n, v in lr.items() if n in own} if lr else None)
        for name, owner in (owners or {}).items():
            source = sessions[owner].state_views([name])[0]
            for s in sessions:
                s.state_views([name])[0][...] = source
    return sessions


CASES = {
    "adam-clip": (Adam(lr=0.05), {"clip_grad_norm": 0.5}),
    "adamw-groups": (AdamW(lr=0.05, weight_decay=0.1),
                     {"param_groups": [{"params": ["W*"], "lr": 0.02}, {"params": ["b*"], "weight_decay": 0.0}]}),
    "nesterov": (Momentum(lr=0.1, momentum=0.9, nesterov=True), {}),
    "adagrad-value-clip": (Adagrad(lr=0.1), {"clip_grad_value": 0.3}),
    "rmsprop": (RMSProp(lr=0.01, momentum=0.5, centered=True), {}),
}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "graph"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_ranks_equal_unsharded_ranks(case, fast, world):
    optimizer, kwargs = CASES[case]
    model = _model(optimizer, **kwargs)
    owners = partition(model, world)
    lr = {n: 0.03 for n in TrainingSession(model).learning_rate_names} if "groups" in case else None
    plain = _simulate([TrainingSession(model, fast=fast) for _ in range(world)], None, lr=lr)
    sharded = _simulate([TrainingSession(shard_model(model, owners, r, world), fast=fast) for r in range(world)],
                        owners, lr=lr)
    reference = plain[0].state_dict()
    per_param = optimizer_state(model)
    held = set()
    for rank, session in enumerate(sharded):
        state = session.state_dict()
        own = {s for p, o in owners.items() if o == rank for s in per_param[p]}
        assert set(state) == (set(reference) - {s for v in per_param.values() for s in v}) | own
        held |= own
        for name, value in state.items():
            assert np.array_equal(value, reference[name]), (rank, name)
    assert held == {s for v in per_param.values() for s in v}


def test_partition_balances_elements_largest_first():
    model = _model(Adam())
    sizes = {"W0": 72, "b0": 12, "W1": 60, "b1": 5, "W2": 15, "b2": 3}
    owners = partition(model, 2)
    assert set(owners) == set(sizes) and list(owners) == list(optimizer_state(model))
    loads = [sum(sizes[p] for p, r in owners.items() if r == k) for k in range(2)]
    assert loads == [84, 83]  # W0, b0 | W1, W2, b1, b2
    assert sorted(partition(model, 8).values()) == [0, 1, 2, 3, 4, 5]  # more ranks than trainables


def test_a_shard_holds_no_foreign_update_and_refuses_to_save(tmp_path):
    model = _model(Adam(lr=0.05))
    owners = partition(model, 2)
    shard = shard_model(model, owners, 1, 2)
    adam = [n for n in shard.training_info[0].algorithm.node if n.op_type == "Adam"]
    owned = sorted(p for p, r in owners.items() if r == 1)
    assert len(adam) == 1 and sorted(adam[0].input[2:2 + len(owned)]) == owned
    session = TrainingSession(shard)
    with pytest.raises(TrainingOpError, match="one rank's shard of the optimizer state"):
        session.save(tmp_path / "shard.onnx")
    assert not (tmp_path / "shard.onnx").exists()


def test_a_model_without_the_builders_metadata_is_refused():
    model = _model(Adam())
    del model.metadata_props[:]
    with pytest.raises(TrainingOpError, match="optimizer_state"):
        partition(model, 2)
