"""Pass: ``SplitToSequence`` read only by ``SequenceAt`` at constant positions -> ``Split``.

The dynamo exporter writes ``torch.split``/``chunk`` this way (GPT-2's fused q/k/v). Tensor
sequences carry no gradient in :mod:`~onnx_training_ops.autodiff`, while ``Split`` has a
rule; the two forms compute the same values. Other uses of sequences are left alone.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, helper, numpy_helper

from ..storage.tensors import constant_values
from ..walk import all_graphs
from ._graph import value_types


def _constants(graph: GraphProto) -> dict[str, np.ndarray]:
    values = constant_values(graph.initializer)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])  # value, value_ints, ...
            if isinstance(value, onnx.TensorProto):
                values[node.output[0]] = numpy_helper.to_array(value)
            elif isinstance(value, (int, float, list)):
                values[node.output[0]] = np.asarray(value)
    return values


def _sizes(split: np.ndarray, dim) -> list[int] | None:
    """Piece sizes: the 1-D ``split`` itself, or chunks of a scalar ``split`` over a static
    ``dim`` (the last one shorter), as SplitToSequence defines them."""
    if np.ndim(split) == 1:
        return [int(v) for v in split]
    if np.ndim(split) == 0 and isinstance(dim, int) and int(split) > 0:
        chunk = int(split)
        return [min(chunk, dim - start) for start in range(0, dim, chunk)]
    return None


def _rewrite(graph: GraphProto, types: dict) -> None:
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    constants = _constants(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx"):
            continue
        seq = node.output[0]
        users = consumers.get(seq, [])
        split = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if seq in outputs or not users or split is None or \
                any(u.op_type != "SequenceAt" or u.input[1] not in constants for u in users):
            continue
        axis = int(attrs.get("axis", 0))
        known = types.get(node.input[0])
        dim = None
        if known is not None and known.shape is not None and -len(known.shape) <= axis < len(known.shape):
            dim = known.shape[axis]
        sizes = _sizes(split, dim)
        if sizes is None:
            continue
        pieces = [f"{seq}/piece{i}" for i in range(len(sizes))]
        split_name = f"{seq}/sizes"
        new = [helper.make_node("Constant", [], [split_name],
                                value=numpy_helper.from_array(np.asarray(sizes, np.int64))),
               helper.make_node("Split", [node.input[0], split_name], pieces, axis=axis,
                                name=node.name or seq)]
        for user in users:
            position = int(np.asarray(constants[user.input[1]]).reshape(-1)[0])
            new.append(helper.make_node("Identity", [pieces[position]], [user.output[0]],
                                        name=user.name or user.output[0]))
            dropped.add(id(user))
        replaced[id(node)] = new
    if not replaced:
        return
    kept = []
    for node in graph.node:
        if id(node) in replaced:
            kept.extend(replaced[id(node)])
        elif id(node) not in dropped:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


def split_sequences(model: ModelProto) -> ModelProto:
    """Rewrite every eligible ``SplitToSequence`` (in place); returns ``model``."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graphs = list(all_graphs(model.graph))
    for info in model.training_info:
        graphs += [g for graph in (info.initialization, info.algorithm) for g in all_graphs(graph)]
    if opset < 13 or not any(n.op_type == "SplitToSequence" for g in graphs for n in g.node):
        return model
    types = value_types(model)
    for graph in graphs:
        _rewrite(graph, types)
    return model
