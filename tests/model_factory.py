"""Small builders of training-domain models for the tests."""

from __future__ import annotations

import onnx
from onnx import TensorProto
from onnx import helper as h

DOMAIN = "ai.onnx.preview.training"
GROUPS = {"Adam": ("X", "G", "V", "H"), "Momentum": ("X", "G", "V"), "Adagrad": ("X", "G", "H")}
OUT_GROUPS = {"Adam": ("X", "V", "H"), "Momentum": ("X", "V"), "Adagrad": ("X", "H")}
MOMENTUM_ATTRS = dict(alpha=0.9, beta=0.1, mode="standard", norm_coefficient=0.0)


def optimizer_model(
    op_type: str,
    n: int = 1,
    shapes=None,
    elem_type: int = TensorProto.FLOAT,
    r_type: int = TensorProto.FLOAT,
    r_shape=(),
    t_type: int = TensorProto.INT64,
    t_shape=(),
    types=None,
    attributes=None,
    name: str = "opt",
    n_outputs: int | None = None,
    opsets=None,
) -> onnx.ModelProto:
    """One optimizer node with R, T and n tensors as graph inputs; its outputs as graph outputs."""
    shapes = shapes or [[3]] * n
    if attributes is None:
        attributes = dict(MOMENTUM_ATTRS) if op_type == "Momentum" else {}
    groups = GROUPS[op_type]
    names = [f"{g}{i}" for g in groups for i in range(n)]
    types = types or {}
    inputs = [
        h.make_tensor_value_info("R", r_type, list(r_shape) if r_shape is not None else None),
        h.make_tensor_value_info("T", t_type, list(t_shape)),
    ] + [
        h.make_tensor_value_info(nm, types.get(nm, elem_type), list(shapes[i % n]) if shapes[i % n] is not None else None)
        for i, nm in enumerate(names)
    ]
    outputs = [f"{g}{i}_new" for g in OUT_GROUPS[op_type] for i in range(n)]
    if n_outputs is not None:
        outputs = outputs[:n_outputs] if n_outputs <= len(outputs) else outputs + [f"extra{k}" for k in range(n_outputs - len(outputs))]
    node = h.make_node(op_type, ["R", "T", *names], outputs, name=name, domain=DOMAIN, **attributes)
    graph = h.make_graph([node], "g", inputs, [h.make_tensor_value_info(o, elem_type, None) for o in outputs])
    opsets = opsets or [h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)]
    return h.make_model(graph, opset_imports=opsets)
