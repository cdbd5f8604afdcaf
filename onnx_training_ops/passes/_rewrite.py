"""Small helpers for the node-for-node lowerings (lower_is_nan, lower_log_softmax, lower_one_hot, lower_sum):
the default-domain opset, fresh names, constant values and shape-inferred types of one graph, and the loop
that replaces every node of one op type by the nodes a lowering writes."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper


def opset(model: ModelProto) -> int:
    """The model's default-domain opset version."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def constants(graph: GraphProto) -> dict[str, np.ndarray]:
    """Values known when the graph is built: initializers not listed as inputs, Constant nodes."""
    inputs = {vi.name for vi in graph.input}
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name not in inputs}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute \
                and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def ranks(model: ModelProto) -> dict[str, int]:
    """The rank of every value whose shape onnx's shape inference knows."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    return {vi.name: len(vi.type.tensor_type.shape.dim) for vi in (*g.input, *g.output, *g.value_info)
            if vi.type.tensor_type.HasField("shape")}


class Names:
    """Fresh value names under a prefix, unused in the graph."""

    def __init__(self, graph: GraphProto, prefix: str):
        self.used = {n for node in graph.node for n in (*node.input, *node.output)}
        self.used |= {vi.name for vi in (*graph.input, *graph.output)} | {t.name for t in graph.initializer}
        self.counter = itertools.count()
        self.prefix = prefix

    def __call__(self, hint: str) -> str:
        while True:
            name = f"{self.prefix}/{hint}{next(self.counter)}"
            if name not in self.used:
                self.used.add(name)
                return name


def constant(names: Names, hint: str, value: np.ndarray) -> tuple[onnx.NodeProto, str]:
    """A Constant node holding ``value`` and its output name."""
    out = names(hint)
    return helper.make_node("Constant", [], [out], value=numpy_helper.from_array(np.asarray(value), out)), out


def has_op(graph: GraphProto, op_type: str) -> bool:
    """Whether the graph holds a default-domain node of ``op_type``."""
    return any(n.op_type == op_type and n.domain in ("", "ai.onnx") for n in graph.node)


def replace_nodes(model: ModelProto, op_type: str, prefix: str,
                  lower: Callable[[NodeProto, Names], list[NodeProto]]) -> ModelProto:
    """Replace every default-domain ``op_type`` node of the main graph by the nodes ``lower`` writes.

    The graph changes only once every node is lowered: an error raised by ``lower`` leaves it as it was.

    Args:
        model: the model to rewrite (in place).
        op_type: the op to replace.
        prefix: the prefix of the fresh value names (see :class:`Names`).
        lower: given one node and the fresh-name source, the nodes that compute its outputs.

    Returns:
        ``model``.
    """
    graph = model.graph
    if not has_op(graph, op_type):
        return model
    names = Names(graph, prefix)
    nodes: list[NodeProto] = []
    for node in graph.node:
        if node.op_type == op_type and node.domain in ("", "ai.onnx"):
            nodes += lower(node, names)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model
