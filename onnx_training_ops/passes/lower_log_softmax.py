"""Pass: ``LogSoftmax`` -> ReduceMax, Sub, Exp, ReduceSum, Log, Sub.

onnxruntime-web's WebGPU execution provider has no LogSoftmax kernel (1.30): the node runs on
the CPU and its input and output cross between the devices every step. The lowered form,
``(x - max) - log(sum(exp(x - max)))`` over the same axis, runs on WebGPU and is the
computation onnxruntime's CPU kernel does (equal to float32 rounding). Opset 13 and later
(the axis is one axis); earlier opsets' flattening semantics are refused unless the axis is
the last one.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, NodeProto, helper

from ..errors import TrainingOpError, node_label
from ._rewrite import Names, constant, has_op, opset, ranks, replace_nodes


def _reduce(op: str, x: str, axis: int, out: str, version: int, names: Names) -> list:
    if (op == "ReduceSum" and version >= 13) or version >= 18:
        node, axes = constant(names, "axes", np.array([axis], np.int64))
        return [node, helper.make_node(op, [x, axes], [out], keepdims=1)]
    return [helper.make_node(op, [x], [out], axes=[axis], keepdims=1)]


def lower_log_softmax(model: ModelProto) -> ModelProto:
    """Replace every LogSoftmax of the main graph by ops WebGPU runs (in place; returns ``model``).

    Args:
        model: the model to rewrite.

    Returns:
        ``model``.

    Raises:
        TrainingOpError: an opset-12-or-earlier LogSoftmax over an axis other than the last.
    """
    version = opset(model)
    if not has_op(model.graph, "LogSoftmax"):
        return model
    known = ranks(model) if version < 13 else {}

    def lower(node: NodeProto, names: Names) -> list[NodeProto]:
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1 if version >= 13 else 1)
        if version < 13:
            rank = known.get(node.input[0])
            if rank is None or axis not in (rank - 1, -1):
                raise TrainingOpError(f"lower_log_softmax: {node_label(node)} (opset {version}) flattens from "
                                      f"axis {axis}; only the last axis is lowered (input rank {rank})")
        x = node.input[0]
        top, shifted, exp, total, log = (names(h) for h in ("max", "shifted", "exp", "sum", "log"))
        return [*_reduce("ReduceMax", x, axis, top, version, names),
                helper.make_node("Sub", [x, top], [shifted]),
                helper.make_node("Exp", [shifted], [exp]),
                *_reduce("ReduceSum", exp, axis, total, version, names),
                helper.make_node("Log", [total], [log]),
                helper.make_node("Sub", [shifted, log], [node.output[0]], name=node.name)]

    return replace_nodes(model, "LogSoftmax", "log_softmax", lower)
