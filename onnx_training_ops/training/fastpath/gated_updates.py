"""Gated optimizer updates on the fast path (dynamic loss scaling, :mod:`...builder.loss_scaling`).

A loss-scaled model binds each state variable S to ``Where(finite, S_new, S)``: the update
lands only when the gradients were finite. The fast path cuts an optimizer node only when its
outputs feed ``update_binding`` directly, so before the cut :func:`ungate` binds S to S_new
(the Where nodes leave the graph) and returns the flag; :func:`regate` puts the Where nodes
back for the states whose node was not cut after all. The cut updates (``CutNodes``) then read
the flag, an output of the run, and skip the whole in-place update when it is false: the
same values as the graph (parameters and optimizer state unchanged on a skipped step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from ...schema import DOMAIN, OPTIMIZERS


@dataclass
class Gate:
    """The Where nodes taken out of the graph and the flag they tested."""

    flag: str
    wheres: dict[str, onnx.NodeProto] = field(default_factory=dict)  # state -> its Where node


def ungate(graph: onnx.GraphProto, binding: dict[str, str], state_inputs: list[str]) -> Gate | None:
    """Bind each optimizer-updated state to its ungated new value (``graph`` and ``binding`` in
    place); None when there is no such gate (one flag for all, as the builder writes it)."""
    state = set(state_inputs)
    by_output = {n.output[0]: n for n in graph.node if n.op_type == "Where" and not n.domain and len(n.output) == 1}
    optimizer_outputs = {o for n in graph.node if n.domain == DOMAIN and n.op_type in OPTIMIZERS for o in n.output}
    consumed: dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            consumed[name] = consumed.get(name, 0) + 1
    gate: Gate | None = None
    for s, value in binding.items():
        where = by_output.get(value)
        if where is None or s not in state or where.input[2] != s or where.input[1] not in optimizer_outputs \
                or consumed.get(where.input[1], 0) != 1 or consumed.get(value, 0):
            continue
        if gate is None:
            gate = Gate(where.input[0])
        elif where.input[0] != gate.flag:
            continue
        gate.wheres[s] = where
    if gate is None:
        return None
    for s, where in gate.wheres.items():
        binding[s] = where.input[1]
    _swap_outputs(graph, {w.output[0]: w.input[1] for w in gate.wheres.values()})
    kept = [n for n in graph.node if not any(n is w for w in gate.wheres.values())]
    del graph.node[:]
    graph.node.extend(kept)
    return gate


def regate(graph: onnx.GraphProto, binding: dict[str, str], gate: Gate, cut_nodes: list[onnx.NodeProto]) -> None:
    """Put back the Where nodes of the states whose optimizer node was not cut."""
    cut = {o for n in cut_nodes for o in n.output}
    back = {s: w for s, w in gate.wheres.items() if w.input[1] not in cut}
    for s, where in back.items():
        binding[s] = where.output[0]
        graph.node.append(where)
    _swap_outputs(graph, {w.input[1]: w.output[0] for w in back.values()})
    for s in back:
        del gate.wheres[s]


def _swap_outputs(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    for out in graph.output:
        if out.name in renamed:
            out.name = renamed[out.name]
