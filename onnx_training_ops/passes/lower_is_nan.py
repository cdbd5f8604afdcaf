"""Pass: ``IsNaN(x)`` -> ``Not(Equal(x, x))``.

onnxruntime-web's WebGPU execution provider has no IsNaN kernel (1.30); torch's attention
export tests its softmax for NaN (a fully masked row). NaN is the only value unequal to itself
(IEEE 754), and onnxruntime's WebGPU Equal compares as IEEE does (checked in Chromium by
js/test/webgpu.test.js on a NaN input).
"""

from __future__ import annotations

from onnx import ModelProto, NodeProto, helper

from ._rewrite import Names, replace_nodes


def _lower(node: NodeProto, names: Names) -> list[NodeProto]:
    same = names("equal")
    return [helper.make_node("Equal", [node.input[0], node.input[0]], [same]),
            helper.make_node("Not", [same], [node.output[0]], name=node.name)]


def lower_is_nan(model: ModelProto) -> ModelProto:
    """Replace every IsNaN of the main graph (in place; returns ``model``).

    Args:
        model: the model to rewrite.

    Returns:
        ``model``.
    """
    return replace_nodes(model, "IsNaN", "is_nan", _lower)
