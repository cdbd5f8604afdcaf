"""Pass: keep a step's state when its loss is not finite, so the state can be updated in place.

A step model with state inputs and the outputs fed back to them (an export's ``feedback``)
writes its new state into fresh buffers. To write it over the state itself (one copy of the
parameters and the optimizer state on a device, not two), a NaN or infinite loss must not
reach the state: this pass routes each fed-back output through
``Where(IsFinite(loss), new, old)`` (``IsFinite`` as ``Not(Or(IsNaN, IsInf))``), which is the
new value bit for bit when the loss is finite and the old one otherwise. A bool ``gate``
input can be ANDed in: with it False the step writes nothing (a warm-up run, such as those
onnxruntime makes while it captures a CUDA graph).

:func:`in_place_unsafe` tells which state inputs may not share a buffer with their new value:
those read by a node that need not run before the value is written (onnxruntime runs nodes in
an order of their data dependencies only). Reads through ops that may alias their input
(Reshape, Identity, Flatten, Squeeze, Unsqueeze) count as reads of the state.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import helper

from ..walk import subgraphs
from ._graph import all_names, unique_name

ALIASING_OPS = {"Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze"}


def guard_feedback(model: onnx.ModelProto, feedback: Mapping[str, str], loss: str | None,
                   gate: str | None = None) -> dict[str, str]:
    """Guard every fed-back output of ``model`` by the loss being finite (in place).

    Args:
        model: a step model (state inputs, the new values as outputs).
        feedback: state input -> the output holding its new value.
        loss: the scalar loss output (None: no loss check, ``gate`` alone).
        gate: a bool scalar input ANDed into the guard: False keeps the old state whatever the
            loss (a warm-up run, such as the runs onnxruntime makes to capture a CUDA graph,
            then changes nothing). Added to the graph's inputs.

    Returns:
        state input -> the guarded output that now holds its new value (the graph outputs are
        renamed to these).
    """
    graph = model.graph
    taken = all_names(graph)
    nodes = []
    ok = gate
    if loss is not None:
        nan, inf, bad, finite = (unique_name(taken, f"{loss}/{what}") for what in ("is_nan", "is_inf", "bad", "finite"))
        nodes += [helper.make_node("IsNaN", [loss], [nan]), helper.make_node("IsInf", [loss], [inf]),
                  helper.make_node("Or", [nan, inf], [bad]), helper.make_node("Not", [bad], [finite])]
        ok = finite
    if gate is not None:
        graph.input.append(helper.make_tensor_value_info(gate, onnx.TensorProto.BOOL, []))
        if loss is not None:
            gated = unique_name(taken, f"{loss}/finite_and_applied")
            nodes.append(helper.make_node("And", [finite, gate], [gated]))
            ok = gated
    if ok is None:
        raise ValueError("guard_feedback: neither a loss nor a gate to guard with")
    guarded = {}
    outputs = {o.name: o for o in graph.output}
    for state, new in feedback.items():
        kept = unique_name(taken, f"{new}/guarded")
        nodes.append(helper.make_node("Where", [ok, new, state], [kept]))
        guarded[state] = kept
        outputs[new].name = kept
    graph.node.extend(nodes)
    return guarded


def node_reads(node: onnx.NodeProto) -> set[str]:
    """What ``node`` reads: its inputs and every name the nodes of its subgraphs read."""
    names = set(node.input)
    pending = list(subgraphs(node))
    while pending:
        sub = pending.pop()
        for inner in sub.node:
            names.update(inner.input)
            pending.extend(subgraphs(inner))
    names.discard("")
    return names


def state_readers(graph: onnx.GraphProto, consumers: Mapping[str, list[int]], name: str) -> set[int]:
    """Indices of the nodes reading ``name``, directly or through ops that may alias it."""
    found: set[int] = set()
    pending, seen = [name], {name}
    while pending:
        for i in consumers.get(pending.pop(), ()):
            found.add(i)
            node = graph.node[i]
            if node.op_type in ALIASING_OPS and node.domain in ("", "ai.onnx"):
                for out in node.output:
                    if out and out not in seen:
                        seen.add(out)
                        pending.append(out)
    return found


def in_place_unsafe(model: onnx.ModelProto, written: Mapping[str, str]) -> list[str]:
    """The state inputs of ``written`` (state -> the output that will be written over it) that a
    node may still read after that output is written: each reader must be the writer or one of
    its ancestors."""
    graph = model.graph
    reads = [node_reads(node) for node in graph.node]
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    consumers: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        for name in names:
            consumers.setdefault(name, []).append(i)
    unsafe = []
    for state, out in written.items():
        writer = producer.get(out)
        if writer is None:
            unsafe.append(state)
            continue
        ancestors, pending = set(), [writer]
        while pending:
            for name in reads[pending.pop()]:
                j = producer.get(name)
                if j is not None and j not in ancestors:
                    ancestors.add(j)
                    pending.append(j)
        if any(i != writer and i not in ancestors for i in state_readers(graph, consumers, state)):
            unsafe.append(state)
    return unsafe
