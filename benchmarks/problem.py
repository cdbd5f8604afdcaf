"""The benchmarked problem: one optimizer step on ``n`` float32 parameters.

Every contender starts from the same tensors (:func:`make_state`), attributes
(:data:`ATTRS`), learning rate :data:`R` and step count :data:`T`; :func:`step_model` is the
one-node ONNX model the graph-based contenders run.
"""

from __future__ import annotations

import numpy as np
import onnx

OPS = ("adam", "momentum", "nesterov", "adagrad")
SIZES = (10**4, 10**5, 10**6, 10**7)
ONNX_OP = {"adam": "Adam", "momentum": "Momentum", "nesterov": "Momentum", "adagrad": "Adagrad"}
# Passes over N*itemsize bytes one step must make at least: (reads, writes).
TRAFFIC = {"adam": (4, 3), "momentum": (3, 2), "nesterov": (3, 2), "adagrad": (3, 2)}

R = float(np.float32(1e-3))
T = 10  # T > 0: Adam's bias correction and Momentum's beta are in play
F32 = lambda v: float(np.float32(v))  # noqa: E731 - attribute values as a model (float32) holds them
ATTRS = {
    "adam": dict(alpha=F32(0.9), beta=F32(0.999), epsilon=F32(1e-8), norm_coefficient=0.0, norm_coefficient_post=0.0),
    # torch SGD(momentum=0.9, dampening=0) <-> Momentum(alpha=0.9, beta=1)
    "momentum": dict(alpha=F32(0.9), beta=1.0, mode="standard", norm_coefficient=0.0),
    "nesterov": dict(alpha=F32(0.9), beta=1.0, mode="nesterov", norm_coefficient=0.0),
    "adagrad": dict(decay_factor=0.0, epsilon=F32(1e-10), norm_coefficient=0.0),
}
STATE_NAMES = {"adam": ("X", "G", "V", "H"), "momentum": ("X", "G", "V"), "nesterov": ("X", "G", "V"),
               "adagrad": ("X", "G", "H")}


class NotAvailable(Exception):
    """A contender cannot run this op (missing package, unsupported mode, ...)."""


def make_state(op: str, n: int, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    """The op's tensors X, G and V/H (as named in STATE_NAMES), the same for every contender."""
    rng = np.random.default_rng(seed)
    state = {"X": rng.standard_normal(n).astype(dtype), "G": (rng.standard_normal(n) * 1e-2).astype(dtype)}
    if "V" in STATE_NAMES[op]:
        state["V"] = (rng.standard_normal(n) * 1e-2).astype(dtype)
    if "H" in STATE_NAMES[op]:
        state["H"] = (rng.random(n) * 1e-4).astype(dtype)
    return state


def step_model(op: str, n: int | None, initializers: dict[str, np.ndarray] | None = None,
               count_output: bool = False) -> onnx.ModelProto:
    """A model of one ``op`` node on tensors of ``n`` float32 (``n=None``: unknown shape);
    ``initializers`` become initializers (and stay graph inputs with a default).
    ``count_output`` adds a scalar ``T_out = Identity(T)`` node and output (see
    :func:`.contenders.training_session`)."""
    from onnx import TensorProto, helper, numpy_helper

    from onnx_training_ops.schema import DOMAIN

    names = STATE_NAMES[op]
    updated = [k for k in names if k != "G"]
    node = helper.make_node(ONNX_OP[op], ["R", "T", *names], [f"{k}_new" for k in updated], domain=DOMAIN, **ATTRS[op])
    shape = None if n is None else [n]
    f32 = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [node]
    outputs = [f32(f"{k}_new") for k in updated]
    if count_output:
        nodes.append(helper.make_node("Identity", ["T"], ["T_out"]))
        outputs.append(helper.make_tensor_value_info("T_out", TensorProto.INT64, []))
    graph = helper.make_graph(
        nodes,
        "step",
        [helper.make_tensor_value_info("R", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("T", TensorProto.INT64, []),
         *(f32(k) for k in names)],  # fmt: skip
        outputs,
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8  # onnxruntime rejects onnx 1.23's default (IR 14)
    return model
