"""Small helpers for the node-for-node lowerings (lower_log_softmax, lower_one_hot, lower_sum):
the default-domain opset, fresh names, constant values and shape-inferred types of one graph."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, helper, numpy_helper


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
