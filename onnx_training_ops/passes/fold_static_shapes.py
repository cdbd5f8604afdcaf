"""Pass: ``Shape`` and ``Size`` of a value whose shape is static, and ``NonZero`` of a
constant, become constants.

With the data inputs' shapes fixed, the shape arithmetic a gradient carries (Shape, Size, then
int64 Div/Reshape/Concat on them) is constant; onnxruntime's constant folding then folds what
reads them. onnxruntime folds Shape itself but not Size, nor NonZero (a gradient's empty
reduction axes come out of one); WebGPU runs none of them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import ModelProto, helper, numpy_helper

from ..autodiff.contrib_shapes import complete
from ..autodiff.emitter import ValueMeta
from ._rewrite import constants


def _static_shapes(model: ModelProto) -> dict[str, list[int]]:
    """Static shapes by onnx's inference, continued past onnxruntime's contrib ops (which onnx
    does not know) by :func:`~onnx_training_ops.autodiff.contrib_shapes.complete`."""
    g = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    meta = {t.name: ValueMeta(t.data_type, tuple(t.dims)) for t in g.initializer}
    for vi in (*g.input, *g.output, *g.value_info):
        meta[vi.name] = ValueMeta.from_type(vi.type)
    small = {t.name: t for t in g.initializer if len(t.dims) <= 1 and int(np.prod(t.dims)) <= 64}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.attribute and n.attribute[0].name == "value":
            small[n.output[0]] = n.attribute[0].t
    complete(g.node, meta, small, model.opset_import)
    return {name: list(m.shape) for name, m in meta.items()
            if m.shape is not None and all(isinstance(d, int) for d in m.shape)}


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
