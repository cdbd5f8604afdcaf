"""Pass: ``IsNaN(x)`` -> ``Not(Equal(x, x))``.

onnxruntime-web's WebGPU execution provider has no IsNaN kernel (1.30); torch's attention
export tests its softmax for NaN (a fully masked row). NaN is the only value unequal to itself
(IEEE 754), and onnxruntime's WebGPU Equal compares as IEEE does (checked in Chromium by
js/test/webgpu.test.js on a NaN input).
"""

from __future__ import annotations

from onnx import ModelProto, helper

from ._rewrite import Names


def lower_is_nan(model: ModelProto) -> ModelProto:
    """Replace every IsNaN of the main graph (in place; returns ``model``).

    Args:
        model: the model to rewrite.

    Returns:
        ``model``.
    """
    graph = model.graph
    if not any(n.op_type == "IsNaN" for n in graph.node):
        return model
    names = Names(graph, "is_nan")
    nodes = []
    for node in graph.node:
        if node.op_type != "IsNaN" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        same = names("equal")
        nodes += [helper.make_node("Equal", [node.input[0], node.input[0]], [same]),
                  helper.make_node("Not", [same], [node.output[0]], name=node.name)]
    del graph.node[:]
    graph.node.extend(nodes)
    return model
