"""Pass: ``Sum`` -> a chain of ``Add`` (one input: ``Identity``).

onnxruntime-web's WebGPU execution provider has no Sum kernel (1.30), not even for two
inputs; the expanded gradient accumulates with Sum. Add broadcasts as Sum does (numpy rules);
the chain adds left to right, the order onnxruntime's CPU Sum kernel adds in.
"""

from __future__ import annotations

from onnx import ModelProto, NodeProto, helper

from ._rewrite import Names, replace_nodes


def _lower(node: NodeProto, names: Names) -> list[NodeProto]:
    terms = list(node.input)
    if len(terms) == 1:
        return [helper.make_node("Identity", terms, [node.output[0]], name=node.name)]
    nodes = []
    total = terms[0]
    for i, term in enumerate(terms[1:], start=2):
        out = node.output[0] if i == len(terms) else names("partial")
        nodes.append(helper.make_node("Add", [total, term], [out]))
        total = out
    return nodes


def lower_sum(model: ModelProto) -> ModelProto:
    """Replace every Sum of the main graph by Adds (in place; returns ``model``).

    Args:
        model: the model to rewrite; a Sum of one input becomes an Identity.

    Returns:
        ``model``, whose Sums are now chains of Add.
    """
    return replace_nodes(model, "Sum", "sum", _lower)
