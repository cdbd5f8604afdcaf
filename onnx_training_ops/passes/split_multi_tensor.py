"""Pass: split every multi-tensor optimizer node into one node per optimized tensor.

The spec applies the update to each tensor independently, and onnxruntime-extensions
registers a kernel with a fixed arity, so ``Adam(R, T, X1, X2, G1, G2, ...)`` becomes
``Adam(R, T, X1, G1, V1, H1)`` and ``Adam(R, T, X2, G2, V2, H2)``. Empty output names
(outputs the graph does not use) get fresh names, since the kernel always writes them.
"""

from __future__ import annotations

import onnx
from onnx import GraphProto, ModelProto

from ..schema import DOMAIN, OPTIMIZERS
from ..walk import model_graphs
from ._graph import all_names, unique_name


def _split_graph(graph: GraphProto, taken: set[str]) -> None:
    new_nodes = []
    for node in graph.node:
        spec = OPTIMIZERS.get(node.op_type) if node.domain == DOMAIN else None
        if spec is None:
            new_nodes.append(node)
            continue
        n = spec.n_tensors(len(node.input)) or 1
        base = node.name or node.output[0] or node.op_type
        for i in range(n):
            inputs = list(node.input[:2]) + [node.input[2 + j * n + i] for j in range(spec.n_groups_in)]
            outputs = [node.output[j * n + i] for j in range(spec.n_groups_out)]
            outputs = [o or unique_name(taken, f"{base}/{role}{i}_unused")
                       for o, role in zip(outputs, spec.tensor_outputs)]
            if n == 1 and list(node.output) == outputs:
                new_nodes.append(node)
                continue
            part = onnx.helper.make_node(
                node.op_type, inputs, outputs,
                name=unique_name(taken, f"{base}/{i}") if n > 1 else node.name,
                domain=DOMAIN, doc_string=node.doc_string,
            )
            part.attribute.extend(node.attribute)
            new_nodes.append(part)
    del graph.node[:]
    graph.node.extend(new_nodes)


def split_multi_tensor_nodes(model: ModelProto) -> ModelProto:
    """Rewrite multi-tensor optimizer nodes as per-tensor nodes in every graph (subgraphs and
    training_info included; in place)."""
    graphs = list(model_graphs(model))
    taken: set[str] = set()
    for graph in graphs:
        taken |= all_names(graph)
    # bodies before the graphs that hold them: rewriting a graph's node list copies its nodes,
    # which would detach a body fetched before
    for graph in reversed(graphs):
        _split_graph(graph, taken)
    return model
