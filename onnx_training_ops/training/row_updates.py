"""The fast path of row updates (:mod:`onnx_training_ops.sparse_updates`, mode ``"lazy"``).

A lazy update is, in the graph, ``Gather(S, u)`` of the touched rows of every state S of one
table (X, V, H) -> a one-tensor optimizer node of the training domain -> ``ScatterND(S,
Unsqueeze(u, 1), S_rows_new)`` bound back to S. Run by onnxruntime, each ScatterND copies
its whole table (1M x 64 float32: 256 MB per state per step). The session finds this pattern
(:func:`row_groups`), cuts its nodes, lets onnxruntime output only ``u`` and the summed
gradient rows, and applies the update in place on its state arrays (:func:`apply_row_groups`):
gather the touched rows, the same kernel as the plugin (:data:`..kernels.apply.STEPS`),
scatter them back — no temporary of the table's size, and the same bits as the graph path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import node_label
from ..kernels.apply import STEPS
from ..passes.encode_exact_attributes import node_attributes
from ..passes.fill_defaults import fill_default_attributes
from ..schema import DOMAIN, OPTIMIZERS


@dataclass
class RowGroup:
    """One table's lazy update, cut out of the graph."""

    node: onnx.NodeProto  # the optimizer node on the row slices
    nodes: list  # every cut node (Gathers, the optimizer, ScatterNDs)
    states: list[str]  # the state variable per input role except G (X, V[, H])
    rows: str  # the summed gradient rows (G of the node)
    unique: str  # the touched rows
    reads: list[str]  # R, T, rows, unique: values the session must provide


def _axis(node: onnx.NodeProto) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)


def _constant(name: str, producers, inits) -> np.ndarray | None:
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant" and node.attribute:
        return numpy_helper.to_array(node.attribute[0].t)
    return None


def row_groups(graph: onnx.GraphProto, binding: Mapping[str, str], state_inputs: list[str],
               taken: set[str]) -> list[RowGroup]:
    """The lazy row updates of ``graph`` the session can apply in place (none of whose
    states is in ``taken``, the dense fast path's)."""
    producers = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    reverse: dict[str, list[str]] = {}
    for key, value in binding.items():
        reverse.setdefault(value, []).append(key)
    state, groups, used = set(state_inputs), [], set(taken)
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type not in OPTIMIZERS:
            continue
        spec = OPTIMIZERS[node.op_type]
        if spec.n_tensors(len(node.input)) != 1 or len(node.output) != spec.n_groups_out:
            continue
        group = _match(node, spec, producers, consumers, inits, outputs, reverse, binding, state)
        if group is not None and not set(group.states) & used:
            used |= set(group.states)
            groups.append(group)
    return groups


def _match(node, spec, producers, consumers, inits, outputs, reverse, binding, state) -> RowGroup | None:
    states, unique, at, nodes = [], None, None, [node]
    for j, role in enumerate(spec.tensor_inputs):
        if role == "G":
            continue
        name = node.input[2 + j]
        gather = producers.get(name)
        if gather is None or gather.op_type != "Gather" or gather.domain not in ("", "ai.onnx") \
                or _axis(gather) != 0 or consumers.get(name) != [node] or name in outputs:
            return None
        s, u = gather.input
        if s not in state or (unique is not None and u != unique):
            return None
        unique = u
        out = node.output[spec.tensor_outputs.index(role + "_new")]
        scatter = consumers.get(out, [None])
        if len(scatter) != 1 or scatter[0] is None or out in outputs:
            return None
        scatter = scatter[0]
        reduction = next((helper.get_attribute_value(a) for a in scatter.attribute
                          if a.name == "reduction"), b"none")
        if scatter.op_type != "ScatterND" or list(scatter.input)[::2] != [s, out] or \
                reduction not in (b"none", "none") or (at is not None and scatter.input[1] != at):
            return None
        at = scatter.input[1]
        new = scatter.output[0]
        if binding.get(s) != new or reverse.get(new) != [s] or consumers.get(new):
            return None
        states.append(s)
        nodes += [gather, scatter]
    unsqueeze = producers.get(at)
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.input[0] != unique:
        return None
    axes = _constant(unsqueeze.input[1], producers, inits) if len(unsqueeze.input) > 1 else None
    if axes is None or list(np.asarray(axes).reshape(-1)) not in ([1], [-1]):
        return None
    rows = node.input[2 + spec.tensor_inputs.index("G")]
    return RowGroup(node, nodes, states, rows, unique, [node.input[0], node.input[1], rows, unique])


@dataclass
class RowPlan:
    """A row group ready to run: its kernel, attributes and state arrays."""

    step: Any
    attributes: dict
    label: str
    reads: list[str]
    arrays: list[np.ndarray]  # state arrays, viewed as [rows, row size]


def plan(groups: list[RowGroup], state: Mapping[str, np.ndarray]) -> list[RowPlan]:
    plans = []
    for g in groups:
        filled = onnx.ModelProto()
        filled.graph.node.append(g.node)
        fill_default_attributes(filled)
        arrays = [state[s].reshape(state[s].shape[0], -1) for s in g.states]
        plans.append(RowPlan(STEPS[g.node.op_type], node_attributes(filled.graph.node[0]),
                             node_label(g.node), g.reads, arrays))
    return plans


def apply_row_groups(plans: list[RowPlan], values: Mapping[str, Any]) -> None:
    """Update the touched rows of each table in place; ``values`` gives R, T, rows, unique."""
    for p in plans:
        r, t, rows, unique = (np.asarray(values[name]) for name in p.reads)
        x, *rest = p.arrays
        p.step(r, t, x, rows.reshape(len(unique), x.shape[1]), *rest, p.attributes,
               inplace=True, rows=unique)
