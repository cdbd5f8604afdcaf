"""Models past protobuf's 2 GB and the memory a session holds (issue 21): one copy of each
tensor, no optimizer node in the fast path's onnxruntime graph, external data end to end.

Large models are made cheaply: the size at which tensors leave the protobuf is lowered, so a
model of a few MB takes the path a multi-GB one takes.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnx_training_ops import Adam, AdamW, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp


def _batch(rng, n=16, d=8, classes=4):
    return {"input": rng.standard_normal((n, d)).astype(np.float32),
            "labels": rng.integers(0, classes, n).astype(np.int64)}


@pytest.mark.parametrize("optimizer", [Adam(lr=1e-2), AdamW(lr=1e-2, weight_decay=0.1)],
                         ids=["adam", "adamw"])
def test_fast_path_graph_holds_no_optimizer_node(optimizer):
    """AdamW's decay Mul in front of the Adam node is folded into the in-place update; the
    node itself must leave the graph onnxruntime runs (it used to stay, computing and
    allocating X, V and H anew every step for nothing)."""
    session = TrainingSession(build_training_model(make_mlp((8, 16, 4)), "cross_entropy", optimizer))
    session.step(_batch(np.random.default_rng(0)))
    for program in session._programs:
        ran = program.session.prepared_model.graph
        assert not [n.op_type for n in ran.node if n.domain], "an optimizer node is still in the graph"
        assert not program.uses_plugin
        outputs = {o.name for o in ran.output}
        assert not [o for o in outputs if o.endswith(".new") and o != "optimizer.T.new"]
