"""Rough edges a new user hits (issue 20, items 9-16): messages, CLI, warnings."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.training.shard import partition, shard_model

BATCH = {"input": np.zeros((2, 8), np.float32), "labels": np.zeros(2, np.int64)}


def test_sessions_with_the_users_options_leave_no_initializer_for_onnxruntime_to_remove(capfd):
    """examples/bench_ddp.py printed 16 "Removing initializer" warnings: the fast path cut the
    optimizer nodes and left their constants and learning rate in the graph."""
    model = ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.AdamW())
    for source in (model, shard_model(model, partition(model, 2), 1, 2)):
        for fast in (True, False):
            session = ot.TrainingSession(source, sess_options=ort.SessionOptions(), fast=fast)
            session.backward(BATCH)
            session.optimizer_step()
            session.step(BATCH)
    assert "Removing initializer" not in capfd.readouterr().err
