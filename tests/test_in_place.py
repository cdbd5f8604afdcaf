"""fast=False with in-place optimizer outputs: the native kernels write the state during the
run; bit-identical to the fast path, and a non-finite loss never reaches the state."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from onnx_training_ops import Adagrad, Adam, Momentum, NonFiniteLossError, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.passes.target_native import NATIVE_DOMAIN
from onnx_training_ops.runtime.native import availability
from onnx_training_ops.training.fastpath.in_place import add_finite_guard, in_place_outputs

pytestmark = pytest.mark.skipif(not availability()[0], reason="the native kernels do not work here")


def _batch(seed: int, bad: bool = False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    if bad:
        x[0, 0] = np.nan
    return {"input": x, "labels": rng.integers(0, 3, 16).astype(np.int64)}


def _assert_same_state(a: TrainingSession, b: TrainingSession) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        assert sa[name].tobytes() == sb[name].tobytes(), name


@pytest.mark.parametrize("optimizer", [Adam(lr=1e-2), Momentum(lr=0.1, momentum=0.9), Adagrad(lr=0.1)],
                         ids=["adam", "momentum", "adagrad"])
@pytest.mark.parametrize("on_nonfinite", ["raise", "skip", "ignore"])
def test_in_place_graph_is_bit_identical_to_the_fast_path(optimizer, on_nonfinite):
    model = build_training_model(make_mlp((8, 6, 3)), "cross_entropy", optimizer)
    fast = TrainingSession(model, on_nonfinite=on_nonfinite)
    full = TrainingSession(model, fast=False, on_nonfinite=on_nonfinite)
    program = full._programs.steps[0]
    # every parameter and optimizer state is written by the kernel into the state array itself
    assert sorted(program.in_place.values()) == sorted(n for n in full.state_names if n != "optimizer.T")
    assert program.guarded == (on_nonfinite != "ignore")
    arrays = {name: full._store.arrays[name] for name in full.state_names}
    for step in range(4):
        fast.step(_batch(step))
        full.step(_batch(step))
    _assert_same_state(fast, full)
    assert all(full._store.arrays[name] is arrays[name] for name in arrays)  # no array was replaced
    assert [array is full._store.arrays["optimizer.T"] for array, _ in program.copy_plan] == [True]  # T only


def test_guard_keeps_a_nan_loss_from_the_state_and_training_goes_on():
    model = build_training_model(make_mlp((8, 6, 3)), "cross_entropy", Adam(lr=1e-2))
    fast, full = TrainingSession(model), TrainingSession(model, fast=False)
    skip = TrainingSession(model, fast=False, on_nonfinite="skip")
    for session in (fast, full, skip):
        session.step(_batch(0))
    before = full.state_dict()
    with pytest.raises(NonFiniteLossError, match="loss 'loss' is nan"):
        full.step(_batch(1, bad=True))
    with pytest.raises(NonFiniteLossError):
        fast.step(_batch(1, bad=True))
    out = skip.step(_batch(1, bad=True))
    assert np.isnan(out["loss"]) and skip.skipped_steps == 1
    for name, value in full.state_dict().items():
        assert value.tobytes() == before[name].tobytes(), name
    _assert_same_state(full, skip)
    for step in range(2, 5):  # the guarded program keeps serving the finite steps
        for session in (fast, full, skip):
            session.step(_batch(step))
    _assert_same_state(fast, full)
    _assert_same_state(fast, skip)
    assert int(full.state_dict()["optimizer.T"]) == 4


def test_ignore_trains_through_a_nan_loss():
    model = build_training_model(make_mlp((8, 6, 3)), "cross_entropy", Adam(lr=1e-2))
    session = TrainingSession(model, fast=False, on_nonfinite="ignore")
    session.step(_batch(1, bad=True))
    state = session.state_dict()
    assert np.isnan(state["W0"]).any() and int(state["optimizer.T"]) == 1


def test_accumulated_steps_apply_in_place_bit_identical():
    model = build_training_model(make_mlp((8, 6, 3)), "cross_entropy", Adam(lr=1e-2))
    fast, full = TrainingSession(model), TrainingSession(model, fast=False)
    for session in (fast, full):
        for k in range(3):
            session.backward(_batch(k), scale=1 / 3)
        session.optimizer_step()
    assert full._loop.accumulation.programs()[1].in_place
    _assert_same_state(fast, full)


def _adam_graph(extra: list[onnx.NodeProto], outputs: list[str]) -> onnx.GraphProto:
    names = ["R", "T", "X", "G", "V", "H"]
    node = h.make_node("TrainingAdam", names, ["X.new", "V.new", "H.new"], domain=NATIVE_DOMAIN)
    vi = lambda n: h.make_tensor_value_info(n, TP.INT64 if n == "T" else TP.FLOAT, [] if n in "RT" else [3])  # noqa: E731
    return h.make_graph([node, *extra], "g", [vi(n) for n in names],
                        [vi(n) for n in ["X.new", "V.new", "H.new", *outputs]])


def test_in_place_outputs_skip_a_state_read_after_the_optimizer():
    # Y reads X but does not lead to the optimizer: it may run after X was overwritten
    graph = _adam_graph([h.make_node("Neg", ["X"], ["Y"])], ["Y"])
    state = {n: np.zeros(3, np.float32) for n in ["X", "V", "H"]}
    binding = {"X": "X.new", "V": "V.new", "H": "H.new"}
    assert in_place_outputs(graph, binding, state) == {"V.new": "V", "H.new": "H"}
    # an output that updates another state than the one its node reads is not in place
    assert in_place_outputs(graph, {"X": "V.new", "V": "X.new"}, state) == {}


def test_guard_needs_the_loss_before_the_optimizers():
    graph = _adam_graph([h.make_node("ReduceSum", ["X.new"], ["loss"], keepdims=0)], ["loss"])
    model = h.make_model(graph)
    assert not add_finite_guard(model, ["loss"])  # computed from the optimizer's output
    graph = _adam_graph([], [])
    graph.node.insert(0, h.make_node("ReduceSum", ["G"], ["loss"], keepdims=0))
    model = h.make_model(graph)
    assert add_finite_guard(model, ["loss"])
    optimizer = next(n for n in model.graph.node if n.op_type == "TrainingAdam")
    assert optimizer.input[1] != "T"  # reads the guarded T
