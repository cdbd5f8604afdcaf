"""Walking a model's graphs: a node's subgraphs, a graph and all below it, every graph of a model.

Foundation code (imports only onnx): storage, passes, build and training all walk graphs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import onnx
from onnx import GraphProto, ModelProto, NodeProto


def subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    """The graphs held in a node's attributes (If branches, Loop/Scan bodies)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def all_graphs(graph: GraphProto) -> Iterator[GraphProto]:
    """``graph`` and, depth first, every subgraph below it."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def model_graphs(model: ModelProto) -> Iterator[GraphProto]:
    """Every graph of ``model``: the main graph, the training_info initialization and
    algorithm graphs, and all their subgraphs."""
    yield from all_graphs(model.graph)
    for info in model.training_info:
        yield from all_graphs(info.initialization)
        yield from all_graphs(info.algorithm)


def drop_named(field, names) -> None:
    """Remove from ``field`` (a graph's ``input``, ``initializer``, ``output``...) the entries
    whose ``name`` is in ``names``, in place, keeping the order of the rest."""
    kept = [entry for entry in field if entry.name not in names]
    del field[:]
    field.extend(kept)


def remove_nodes(graph: GraphProto, doomed: Iterable[NodeProto]) -> None:
    """Delete ``doomed`` (node objects of ``graph.node``) in place. The nodes kept stay the
    same objects: rebuilding the list (``del graph.node[:]``, ``extend``) would copy them,
    and a node held elsewhere (an optimizer node the fast path cuts) would then no longer
    be one of the graph's, so removing it by identity would silently miss it."""
    ids = {id(node) for node in doomed}
    for i in reversed([i for i, node in enumerate(graph.node) if id(node) in ids]):
        del graph.node[i]
