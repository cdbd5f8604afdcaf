"""Pruning a graph down to what its outputs need: the nodes, inputs and initializers no one reads."""

from __future__ import annotations

import onnx
from onnx import helper

from ...schema import DOMAIN
from ...walk import all_graphs, drop_named, remove_nodes, subgraphs


def used_names(graph: onnx.GraphProto) -> set[str]:
    """Every name read by a node of ``graph`` (subgraphs included) or listed as its output."""
    used: set[str] = set()
    for g in all_graphs(graph):
        for node in g.node:
            used.update(node.input)
    used.update(o.name for o in graph.output)
    used.discard("")
    return used


def node_reads(node: onnx.NodeProto) -> list[str]:
    """What ``node`` reads: its inputs, the outer values its subgraphs read, and a Gradient's
    ``y`` and ``zs`` (attributes, not inputs)."""
    names = list(node.input)
    for sub in subgraphs(node):
        names += used_names(sub)
    if node.domain == DOMAIN and node.op_type == "Gradient":
        for a in node.attribute:
            if a.name == "y":
                names.append(helper.get_attribute_value(a).decode())
            elif a.name == "zs":
                names += [z.decode() for z in helper.get_attribute_value(a)]
    return names


def prune_dead_nodes(graph: onnx.GraphProto) -> None:
    """Keep only the nodes some output of ``graph`` depends on. onnxruntime runs every node
    of a graph, even one nothing reads: in a ``mode="train"`` model the main graph's
    eval-mode forward pass would run in every step for nothing."""
    producer = {o: i for i, node in enumerate(graph.node) for o in node.output if o}
    live: set[int] = set()
    pending = [o.name for o in graph.output]
    while pending:
        i = producer.get(pending.pop())
        if i is not None and i not in live:
            live.add(i)
            pending += node_reads(graph.node[i])
    if len(live) < len(graph.node):
        remove_nodes(graph, [node for i, node in enumerate(graph.node) if i not in live])


def prune_unused_inputs(graph: onnx.GraphProto) -> None:
    """Drop the graph inputs no node reads (a stage program takes only the feeds it needs)."""
    used = used_names(graph)
    kept = [vi for vi in graph.input if vi.name in used]
    del graph.input[:]
    graph.input.extend(kept)


def prune_unused_initializers(graph: onnx.GraphProto, droppable_inputs=()) -> None:
    """Drop the initializers no node reads (a cut optimizer node leaves its constants and
    learning rate behind); onnxruntime would drop them too, with a warning per tensor at
    every session. An initializer that is also a graph input goes only if named in
    ``droppable_inputs`` (the learning rates, which the fast path reads from its own buffers)."""
    used = used_names(graph)
    inputs = {vi.name for vi in graph.input}
    drop = {t.name for t in graph.initializer
            if t.name not in used and (t.name not in inputs or t.name in droppable_inputs)}
    drop_named(graph.initializer, drop)
    drop_named(graph.input, drop)
