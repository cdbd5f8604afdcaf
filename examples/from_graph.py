"""Drive a plain graph that already holds the optimizer: ``TrainingSession.from_graph``.

The graph below is one training step of logistic regression written by hand with
``onnx.helper`` — forward pass, loss, the gradient spelled out, a ``Momentum`` node of
``ai.onnx.preview.training`` and T + 1 — with its state as explicit inputs (``w``, ``b``,
``w.v``, ``b.v``, ``T``) and the new state as outputs. ``from_graph`` is told which output
feeds which input after each step; the session keeps the state, applies the momentum update
in place (fast path) and saves a regular ONNX training model.

Run: ``python examples/from_graph.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from onnx_training_ops import TrainingSession

D = 2


def logistic_regression_step() -> onnx.ModelProto:
    f = TP.FLOAT
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["xw"]),
        h.make_node("Add", ["xw", "b"], ["z"]),                       # z = x w + b, [N]
        h.make_node("Sigmoid", ["z"], ["p"]),
        # loss = mean(softplus(z) - y z)   (binary cross-entropy on logits)
        h.make_node("Softplus", ["z"], ["sp"]),
        h.make_node("Mul", ["y", "z"], ["yz"]),
        h.make_node("Sub", ["sp", "yz"], ["nll"]),
        h.make_node("ReduceMean", ["nll"], ["loss"], keepdims=0),
        # gradient: dz = (p - y) / N ; dw = x^T dz ; db = sum(dz)
        h.make_node("Sub", ["p", "y"], ["err"]),
        h.make_node("Shape", ["y"], ["n_shape"]),
        h.make_node("Cast", ["n_shape"], ["n_f"], to=f),
        h.make_node("Div", ["err", "n_f"], ["dz"]),
        h.make_node("MatMul", ["dz", "x"], ["w.grad"]),
        h.make_node("ReduceSum", ["dz"], ["b.grad"], keepdims=0),
        h.make_node("Add", ["T", "one"], ["T.new"]),
        h.make_node("Momentum", ["lr", "T", "w", "b", "w.grad", "b.grad", "w.v", "b.v"],
                    ["w.new", "b.new", "w.v.new", "b.v.new"], domain="ai.onnx.preview.training",
                    name="momentum", alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=1e-4),
    ]
    inputs = [
        h.make_tensor_value_info("x", f, ["N", D]), h.make_tensor_value_info("y", f, ["N"]),
        h.make_tensor_value_info("lr", f, []),
        h.make_tensor_value_info("w", f, [D]), h.make_tensor_value_info("b", f, []),
        h.make_tensor_value_info("w.v", f, [D]), h.make_tensor_value_info("b.v", f, []),
        h.make_tensor_value_info("T", TP.INT64, []),
    ]
    outputs = [h.make_tensor_value_info("loss", f, [])] + [
        h.make_tensor_value_info(n, f, s) for n, s in
        (("w.new", [D]), ("b.new", []), ("w.v.new", [D]), ("b.v.new", []))
    ] + [h.make_tensor_value_info("T.new", TP.INT64, [])]
    initializers = [  # the initializers of state inputs are their initial values
        nh.from_array(np.array(1, np.int64), "one"), nh.from_array(np.array(0.5, np.float32), "lr"),
        nh.from_array(np.zeros(D, np.float32), "w"), nh.from_array(np.array(0.0, np.float32), "b"),
        nh.from_array(np.zeros(D, np.float32), "w.v"), nh.from_array(np.array(0.0, np.float32), "b.v"),
        nh.from_array(np.array(0, np.int64), "T"),
    ]
    graph = h.make_graph(nodes, "logistic_regression_step", inputs, outputs, initializers)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("ai.onnx.preview.training", 1)])
    model.ir_version = 10
    return model


def main(steps: int = 200, out_dir: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, D)).astype(np.float32)
    y = (x @ np.array([2.0, -3.0]) + 0.5 > 0).astype(np.float32)
    session = TrainingSession.from_graph(
        logistic_regression_step(),
        feedback={"w.new": "w", "b.new": "b", "w.v.new": "w.v", "b.v.new": "b.v", "T.new": "T"},
    )
    print(f"state: {session.state_names}; feeds: {session.feed_names}; in place: {session.fast_path_nodes}")
    for step in range(steps):
        loss = float(session.step({"x": x, "y": y}, lr=0.5 if step < steps // 2 else 0.1)["loss"])
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")
    state = session.state_dict()
    accuracy = float(np.mean(((x @ state["w"] + state["b"]) > 0) == (y > 0.5)))
    path = session.save(os.path.join(out_dir or tempfile.mkdtemp(prefix="from_graph_"), "logreg_training.onnx"))
    print(f"w = {state['w']}, b = {state['b']:.3f}, accuracy {accuracy:.3f}; training model saved to {path}")
    return {"loss": loss, "accuracy": accuracy, "path": path}


if __name__ == "__main__":
    main(out_dir=sys.argv[1] if len(sys.argv) > 1 else None)
