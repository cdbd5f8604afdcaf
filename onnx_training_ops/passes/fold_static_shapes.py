"""Pass: ``Shape`` and ``Size`` of a value whose shape is static, and ``NonZero`` of a
constant, become constants.

With the data inputs' shapes fixed, the shape arithmetic a gradient carries (Shape, Size, then
int64 Div/Reshape/Concat on them) is constant; onnxruntime's constant folding then folds what
reads them. onnxruntime folds Shape itself but not Size, nor NonZero (a gradient's empty
reduction axes come out of one); WebGPU runs none of them.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from ._graph import value_types
from ._rewrite import constants


def _static_shapes(model: ModelProto) -> dict[str, list[int]]:
    """The values of static shape: onnx's inference, carried through the onnxruntime contrib ops
    it does not know (an onnxruntime-genai graph's MatMulNBits, GroupQueryAttention...)."""
    return {name: list(t.static_shape) for name, t in value_types(model).items() if t.static_shape is not None}


def fold_static_shapes(model: ModelProto) -> ModelProto:
    """Replace Shape/Size nodes of the main graph on static shapes, and NonZero of a constant, by Constants (in place).

    Args:
        model: the model to rewrite (its inputs' shapes static where they matter).

    Returns:
        ``model``.
    """
    shapes = _static_shapes(model)
    known = constants(model.graph)
    nodes = []
    for node in model.graph.node:
        if node.op_type == "NonZero" and node.domain in ("", "ai.onnx") and node.input[0] in known:
            value = np.array(np.nonzero(known[node.input[0]]), np.int64)
            nodes.append(helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                          value=numpy_helper.from_array(value, node.output[0])))
            continue
        shape = shapes.get(node.input[0]) if node.input and node.domain in ("", "ai.onnx") else None
        if shape is None or node.op_type not in ("Shape", "Size"):
            nodes.append(node)
            continue
        if node.op_type == "Size":
            value = np.array(int(np.prod(shape)), np.int64)
        else:
            attrs = {a.name: a.i for a in node.attribute}
            rank = len(shape)
            start, end = attrs.get("start", 0), attrs.get("end", rank)
            window = slice(start + rank if start < 0 else start, end + rank if end < 0 else end)
            value = np.array(shape[window], np.int64)
        nodes.append(helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                      value=numpy_helper.from_array(value, node.output[0])))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model
