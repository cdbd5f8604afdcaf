"""Single-node models of the training domain's optimizers, built with plain ``onnx.helper``.

``single_node_model(op_type, r, t, groups, attributes)`` builds a model whose only node is
``op_type(R, T, X1..Xn, G1..Gn, V1..Vn[, H1..Hn])`` with every input a graph input typed
and shaped like the array that will be fed, and every output a graph output (typed like
its X, shaped like its X). The model is left at onnx's default IR version and opset, as
a user would write it; ``onnx_training_ops.prepare`` has to fit it to onnxruntime.

``groups`` is a list of per-tensor tuples ``(X, G, V[, H])`` of numpy arrays; the inputs
and outputs are laid out in op order (all X, then all G, ...), the layout the reference
kernels and the spec use.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

DOMAIN = "ai.onnx.preview.training"

INPUT_GROUPS = {"Adam": ("X", "G", "V", "H"), "Momentum": ("X", "G", "V"), "Adagrad": ("X", "G", "H")}
OUTPUT_GROUPS = {"Adam": ("X_new", "V_new", "H_new"), "Momentum": ("X_new", "V_new"), "Adagrad": ("X_new", "H_new")}


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
