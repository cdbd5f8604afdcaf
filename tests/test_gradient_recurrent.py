"""LSTM, GRU and RNN (unrolled by the lower_recurrent pass) against float64 finite
differences. torch.nn.LSTM/GRU/RNN (tanh and relu) exports are compared with torch autograd
in test_real_models.py."""

from __future__ import annotations

import numpy as np
import pytest
from gradient_utils import check_gradient
from onnx import helper
from test_gradient_rules import check, rand

H, IN, B, T = 3, 2, 2, 4  # hidden, input, batch, time
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _case(op, direction, with_state, with_lens, layout, rng, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    x_shape = (B, T, IN) if layout else (T, B, IN)
    state_shape = (B, dirs, H) if layout else (dirs, B, H)
    feeds = {"x": rand(rng, x_shape), "w": rand(rng, (dirs, g * H, IN)),
             "r": rand(rng, (dirs, g * H, H)), "b": rand(rng, (dirs, 2 * g * H))}
    inputs = ["x", "w", "r", "b", "lens" if with_lens else ""]
    inits = {"lens": np.array([T, T - 2], np.int32)} if with_lens else {}
    if with_state:
        feeds["h0"] = rand(rng, state_shape)
        inputs.append("h0")
        if op == "LSTM":
            feeds["c0"] = rand(rng, state_shape)
            inputs.append("c0")
    outs = ["seq", "yh"] + (["yc"] if op == "LSTM" else [])
    node = helper.make_node(op, inputs, outs, hidden_size=H, direction=direction,
                            layout=layout, **attrs)
    # every output carries a gradient: y = sum of all of them, each weighted
    nodes = [node, helper.make_node("ReduceSum", ["seq"], ["ys"], keepdims=0),
             helper.make_node("ReduceSum", ["yh"], ["hs"], keepdims=0)]
    total = helper.make_node("Add", ["ys", "hs"], ["z0"])
    nodes.append(total)
    last = "z0"
    if op == "LSTM":
        nodes += [helper.make_node("ReduceSumSquare", ["yc"], ["cs"], keepdims=0),
                  helper.make_node("Add", ["z0", "cs"], ["z1"])]
        last = "z1"
    nodes.append(helper.make_node("Mul", [last, last], ["z"]))
    return nodes, feeds, inits


def _check_against_onnxruntime(nodes, feeds, inits):
    """For what onnx.reference lacks (sequence_lens, Relu activations) and onnxruntime has in
    float32 only: float32 throughout, wider differences (eps 1e-2) and tolerance."""
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    nodes = list(nodes[:-1]) + [helper.make_node("Mul", nodes[-1].input, ["z32"]),
                                helper.make_node("Cast", ["z32"], ["y"], to=11)]
    check_gradient(nodes, feeds, "y", list(feeds), initializers=inits, eps=1e-2, rtol=2e-3,
                   atol=1e-3)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("with_state,with_lens,layout", [(False, False, 0), (True, True, 0),
                                                         (True, False, 1)])
def test_recurrent_against_finite_differences(op, direction, with_state, with_lens, layout):
    rng = np.random.default_rng(len(op) + len(direction))
    nodes, feeds, inits = _case(op, direction, with_state, with_lens, layout, rng)
    if with_lens:  # onnx.reference ignores sequence_lens
        _check_against_onnxruntime(nodes, feeds, inits)
    else:
        check(nodes, feeds, list(feeds), initializers=inits, rtol=1e-4, atol=1e-6,
              reference_fd=True)


def test_gru_linear_before_reset():
    rng = np.random.default_rng(3)
    nodes, feeds, inits = _case("GRU", "forward", True, False, 0, rng, linear_before_reset=1)
    check(nodes, feeds, list(feeds), initializers=inits, rtol=1e-4, atol=1e-6,
          reference_fd=True)


def test_dynamic_sequence_length_is_a_clear_error():
    from onnx_training_ops.errors import TrainingOpError
    rng = np.random.default_rng(4)
    nodes, feeds, inits = _case("LSTM", "forward", False, False, 0, rng)
    with pytest.raises(TrainingOpError, match="sequence length that is not static"):
        check(nodes, feeds, list(feeds), initializers=inits, dynamic=True)
