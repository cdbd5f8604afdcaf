"""Pass: ``OneHot`` -> Cast, Where, Unsqueeze, Equal against a float range, Where.

onnxruntime-web's WebGPU execution provider has no OneHot kernel (1.30) and runs no int64
arithmetic. The lowered form compares the indices, cast to float32, with the constant range
``0 .. depth-1`` laid along the one-hot axis, and picks ``values[1]`` where they are equal,
``values[0]`` elsewhere. Negative indices count from ``depth`` as OneHot's do. float32 holds
every integer up to 2^24 exactly: a larger depth is refused. ``depth`` and ``values`` must be
constants (what the cross-entropy lowering writes).
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper

from ..errors import TrainingOpError, node_label
from ._rewrite import Names, constant, constants, has_op, opset, ranks, replace_nodes

_EXACT = 2 ** 24


def lower_one_hot(model: ModelProto) -> ModelProto:
    """Replace every OneHot of the main graph (in place; returns ``model``).

    Args:
        model: the model to rewrite.

    Returns:
        ``model``.

    Raises:
        TrainingOpError: a OneHot whose depth or values are not constants, a depth over 2^24,
            or a positive axis on indices of unknown rank.
    """
    if not has_op(model.graph, "OneHot"):
        return model
    values_of = constants(model.graph)
    known = ranks(model)
    version = opset(model)

    def lower(node: NodeProto, names: Names) -> list[NodeProto]:
        indices, depth_name, values_name = node.input
        if depth_name not in values_of or values_name not in values_of:
            raise TrainingOpError(f"lower_one_hot: {node_label(node)}: depth and values must be constants "
                                  f"(found {'depth' if depth_name not in values_of else 'values'} computed)")
        depth = int(values_of[depth_name].reshape(-1)[0])
        if not 0 < depth <= _EXACT:
            raise TrainingOpError(f"lower_one_hot: {node_label(node)}: depth {depth} is outside 1..2^24 "
                                  "(float32 compares integers exactly up to 2^24)")
        off, on = values_of[values_name].reshape(-1)[:2]
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        if axis < 0:
            trailing = -axis - 1
        elif node.input[0] in known:
            trailing = known[node.input[0]] - axis
        else:
            raise TrainingOpError(f"lower_one_hot: {node_label(node)}: axis {axis} on indices of unknown rank")
        out = []
        as_float = names("indices")
        out.append(helper.make_node("Cast", [indices], [as_float], to=TensorProto.FLOAT))
        zero, zero_name = constant(names, "zero", np.array(0, np.float32))
        size, size_name = constant(names, "depth", np.array(depth, np.float32))
        negative, wrapped, index = names("negative"), names("wrapped"), names("index")
        out += [zero, size,
                helper.make_node("Less", [as_float, zero_name], [negative]),
                helper.make_node("Add", [as_float, size_name], [wrapped]),
                helper.make_node("Where", [negative, wrapped, as_float], [index])]
        expanded = names("unsqueezed")  # OneHot's axis and Unsqueeze's both count in the output's rank
        if version >= 13:
            axes, axes_name = constant(names, "axes", np.array([axis], np.int64))
            out += [axes, helper.make_node("Unsqueeze", [index, axes_name], [expanded])]
        else:
            out.append(helper.make_node("Unsqueeze", [index], [expanded], axes=[axis]))
        grid, grid_name = constant(names, "range",
                                   np.arange(depth, dtype=np.float32).reshape((depth,) + (1,) * trailing))
        hit = names("equal")
        on_node, on_name = constant(names, "on", np.array(on))
        off_node, off_name = constant(names, "off", np.array(off))
        out += [grid, on_node, off_node, helper.make_node("Equal", [expanded, grid_name], [hit]),
                helper.make_node("Where", [hit, on_name, off_name], [node.output[0]], name=node.name)]
        return out

    return replace_nodes(model, "OneHot", "one_hot", lower)
