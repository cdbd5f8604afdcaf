"""Small builders of training-domain models for the tests.

``optimizer_model`` builds one node from declared types and shapes (valid or not: the
bad-input tests need both); ``single_node_model`` builds one node from the arrays that will be
fed, at onnx's default IR version and opset, as a user would write it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

DOMAIN = "ai.onnx.preview.training"
GROUPS = {"Adam": ("X", "G", "V", "H"), "Momentum": ("X", "G", "V"), "Adagrad": ("X", "G", "H")}
OUT_GROUPS = {"Adam": ("X", "V", "H"), "Momentum": ("X", "V"), "Adagrad": ("X", "H")}
INPUT_GROUPS = GROUPS
OUTPUT_GROUPS = {op: tuple(f"{g}_new" for g in groups) for op, groups in OUT_GROUPS.items()}
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
        helper.make_tensor_value_info("R", r_type, list(r_shape) if r_shape is not None else None),
        helper.make_tensor_value_info("T", t_type, list(t_shape)),
    ] + [
        helper.make_tensor_value_info(nm, types.get(nm, elem_type),
                                      list(shapes[i % n]) if shapes[i % n] is not None else None)
        for i, nm in enumerate(names)
    ]
    outputs = [f"{g}{i}_new" for g in OUT_GROUPS[op_type] for i in range(n)]
    if n_outputs is not None:
        extra = [f"extra{k}" for k in range(n_outputs - len(outputs))]
        outputs = outputs[:n_outputs] if n_outputs <= len(outputs) else outputs + extra
    node = helper.make_node(op_type, ["R", "T", *names], outputs, name=name, domain=DOMAIN, **attributes)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, elem_type, None) for o in outputs])
    opsets = opsets or [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _value_info(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(array.dtype)
    return helper.make_tensor_value_info(name, elem, list(array.shape))


def layout(op_type: str, groups: Sequence[Sequence[np.ndarray]]) -> tuple[list[str], list[np.ndarray], list[str]]:
    """(tensor input names, tensor input arrays, output names) in op order for ``groups``."""
    roles = INPUT_GROUPS[op_type]
    n = len(groups)
    names = [f"{role}{i}" for role in roles for i in range(n)]
    arrays = [np.asarray(groups[i][j]) for j in range(len(roles)) for i in range(n)]
    outputs = [f"{role}{i}" for role in OUTPUT_GROUPS[op_type] for i in range(n)]
    return names, arrays, outputs


def single_node_model(
    op_type: str,
    r: np.ndarray,
    t: np.ndarray,
    groups: Sequence[Sequence[np.ndarray]],
    attributes: Mapping[str, float | str],
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
    """One ``op_type`` node over ``groups``; returns (model, input feed, output names in op order).

    Float attributes are stored as ONNX FLOAT attributes, i.e. rounded to float32, as any
    model holds them.
    """
    r, t = np.asarray(r), np.asarray(t)
    names, arrays, outputs = layout(op_type, groups)
    n = len(groups)
    node = helper.make_node(
        op_type, ["R", "T", *names], outputs, name=f"{op_type.lower()}_node", domain=DOMAIN, **attributes
    )
    inputs = [_value_info("R", r), _value_info("T", t)] + [_value_info(k, a) for k, a in zip(names, arrays)]
    n_out_groups = len(OUTPUT_GROUPS[op_type])
    xs = arrays[:n]
    out_infos = [
        helper.make_tensor_value_info(
            outputs[j * n + i], helper.np_dtype_to_tensor_dtype(xs[i].dtype), list(xs[i].shape)
        )
        for j in range(n_out_groups)
        for i in range(n)
    ]
    graph = helper.make_graph([node], f"single_{op_type.lower()}", inputs, out_infos)
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", onnx.defs.onnx_opset_version()),
            helper.make_opsetid(DOMAIN, 1),
        ],
    )
    feed = {"R": r, "T": t, **dict(zip(names, arrays))}
    return model, feed, outputs
