"""Build the sample training models of this folder: ``python models/build_models.py [OUT_DIR]``.

* ``linear_regression_adam.onnx`` — written by hand with ``onnx.helper``, *not* by the
  builder: y = x W + b, mean squared error, the gradient spelled out with ordinary ops
  (no Gradient node), one multi-tensor Adam node and T <- T + 1; an initialization graph
  resets T. Shows the IR spec's training model in its plainest form.
* ``mlp_momentum.onnx`` — MLP 4-16-3 (ReLU), cross-entropy, SGD with Nesterov momentum,
  from :func:`onnx_training_ops.build_training_model`.
* ``mlp_adagrad.onnx`` — the same MLP with Adagrad.

Each loads with ``onnx_training_ops.TrainingSession(path)`` (see tests/test_models.py).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINING_DOMAIN = "ai.onnx.preview.training"


def linear_regression_adam(n_in: int = 3, n_out: int = 2, lr: float = 0.05, seed: int = 0) -> onnx.ModelProto:
    """The hand-written training model: linear regression trained by Adam (see the module doc).

    Feeds of a step: ``x`` [N, n_in], ``target`` [N, n_out] (and optionally ``learning_rate``).
    State: W, b (main graph), W.V, b.V, W.H, b.H, T (algorithm graph).
    """
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_in, n_out)) * 0.1).astype(np.float32)
    b = np.zeros(n_out, np.float32)
    main = h.make_graph(
        [h.make_node("MatMul", ["x", "W"], ["xW"]), h.make_node("Add", ["xW", "b"], ["y"])],
        "linear_regression",
        [h.make_tensor_value_info("x", TP.FLOAT, ["N", n_in])],
        [h.make_tensor_value_info("y", TP.FLOAT, ["N", n_out])],
        [nh.from_array(w, "W"), nh.from_array(b, "b")],
    )
    algorithm_nodes = [
        # loss = mean((y - target)^2)
        h.make_node("Sub", ["y", "target"], ["residual"]),
        h.make_node("Mul", ["residual", "residual"], ["squared"]),
        h.make_node("ReduceMean", ["squared"], ["loss"], keepdims=0),
        # dloss/dy = 2 (y - target) / size(y)
        h.make_node("Size", ["residual"], ["size"]),
        h.make_node("Cast", ["size"], ["size_f"], to=TP.FLOAT),
        h.make_node("Div", ["two", "size_f"], ["scale"]),
        h.make_node("Mul", ["residual", "scale"], ["dy"]),
        # dloss/dW = x^T dy, dloss/db = sum(dy, axis 0)
        h.make_node("Transpose", ["x"], ["xT"]),
        h.make_node("MatMul", ["xT", "dy"], ["W.grad"]),
        h.make_node("ReduceSum", ["dy", "axis0"], ["b.grad"], keepdims=0),
        # Adam sees the 1-based step (T + 1) so its bias correction matches torch/TF
        h.make_node("Add", ["T", "one"], ["T.new"]),
        h.make_node(
            "Adam",
            ["learning_rate", "T.new", "W", "b", "W.grad", "b.grad", "W.V", "b.V", "W.H", "b.H"],
            ["W.new", "b.new", "W.V.new", "b.V.new", "W.H.new", "b.H.new"],
            domain=TRAINING_DOMAIN, name="adam", alpha=0.9, beta=0.999, epsilon=1e-8,
        ),
    ]
    outputs = [h.make_tensor_value_info("loss", TP.FLOAT, [])]
    for name, shape in (("W", [n_in, n_out]), ("b", [n_out])):
        for suffix in (".new", ".V.new", ".H.new"):
            outputs.append(h.make_tensor_value_info(name + suffix, TP.FLOAT, shape))
    outputs.append(h.make_tensor_value_info("T.new", TP.INT64, []))
    algorithm = h.make_graph(
        algorithm_nodes,
        "algorithm",
        [h.make_tensor_value_info("target", TP.FLOAT, ["N", n_out]),
         h.make_tensor_value_info("learning_rate", TP.FLOAT, [])],
        outputs,
        [
            nh.from_array(np.array(lr, np.float32), "learning_rate"),  # the input's default value
            nh.from_array(np.array(2.0, np.float32), "two"),
            nh.from_array(np.array([0], np.int64), "axis0"),
            nh.from_array(np.array(1, np.int64), "one"),
            nh.from_array(np.array(0, np.int64), "T"),
            nh.from_array(np.zeros_like(w), "W.V"),
            nh.from_array(np.zeros_like(b), "b.V"),
            nh.from_array(np.zeros_like(w), "W.H"),
            nh.from_array(np.zeros_like(b), "b.H"),
        ],
    )
    initialization = h.make_graph(
        [h.make_node("Constant", [], ["T.init"], value=nh.from_array(np.array(0, np.int64)))],
        "initialization", [], [h.make_tensor_value_info("T.init", TP.INT64, [])],
    )
    model = h.make_model(
        main, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(TRAINING_DOMAIN, 1)],
        producer_name="models/build_models.py",
    )
    model.ir_version = 10
    info = model.training_info.add()
    info.initialization.CopyFrom(initialization)
    info.initialization_binding.add(key="T", value="T.init")
    info.algorithm.CopyFrom(algorithm)
    for key in ("W", "b", "W.V", "b.V", "W.H", "b.H", "T"):
        info.update_binding.add(key=key, value=key + ".new")
    return model


def mlp_momentum() -> onnx.ModelProto:
    from onnx_training_ops import Momentum, build_training_model
    from onnx_training_ops.demo import make_mlp

    return build_training_model(make_mlp((4, 16, 3), seed=1), "cross_entropy",
                                Momentum(lr=0.05, momentum=0.9, nesterov=True))


def mlp_adagrad() -> onnx.ModelProto:
    from onnx_training_ops import Adagrad, build_training_model
    from onnx_training_ops.demo import make_mlp

    return build_training_model(make_mlp((4, 16, 3), seed=2), "cross_entropy", Adagrad(lr=0.1))


MODELS = {
    "linear_regression_adam.onnx": linear_regression_adam,
    "mlp_momentum.onnx": mlp_momentum,
    "mlp_adagrad.onnx": mlp_adagrad,
}


def main(out_dir: str = HERE) -> list[str]:
    paths = []
    for filename, build in MODELS.items():
        model = build()
        onnx.checker.check_model(model, full_check=True)
        path = os.path.join(out_dir, filename)
        onnx.save(model, path)
        paths.append(path)
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
