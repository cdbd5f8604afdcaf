"""The fast path of row updates (:mod:`onnx_training_ops.builder.sparse_updates`, mode ``"lazy"``).

A lazy update is, in the graph, ``Gather(S, u)`` of the touched rows of every state S of one
table (X, V, H) -> a one-tensor optimizer node of the training domain -> ``ScatterND(S,
Unsqueeze(u, 1), S_rows_new)`` bound back to S. Run by onnxruntime, each ScatterND copies
its whole table (1M x 64 float32: 256 MB per state per step). The session finds this pattern
(:func:`row_groups`), cuts its nodes, lets onnxruntime output only ``u`` and the summed
gradient rows, and applies the update in place on its state arrays (:func:`apply_row_groups`)
through the plugin's entry point (:data:`...kernels.apply.STEPS` with ``rows=``): the fused
element loop runs on each touched row of X, V, H (:mod:`...kernels._numba_rows`; gather ->
kernel -> scatter if the fused kernels do not apply) — nothing of the table's size per step,
and the same bits as the graph path.

When ``u`` and the rows come from the builder's deduplication (:func:`...builder.sparse_updates.gradient_rows`:
``Unique`` -> ``ScatterND(zeros, inverse, g, reduction="add")``), that is cut too: onnxruntime's
``Unique`` takes ~1.7 ms for 4,096 ids. The session sums the duplicate rows itself
(:func:`_dedup`: a row -> slot table kept between steps, rows summed in order of appearance
from zero, as ScatterND adds them) and runs the row update on the distinct rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import node_label
from ...kernels.apply import STEPS
from ...passes.encode_exact_attributes import node_attributes
from ...passes.fill_defaults import fill_default_attributes
from ...schema import DOMAIN, OPTIMIZERS


@dataclass
class RowGroup:
    """One table's lazy update, cut out of the graph."""

    node: onnx.NodeProto  # the optimizer node on the row slices
    nodes: list  # every cut node (Gathers, the optimizer, ScatterNDs)
    states: list[str]  # the state variable per input role except G (X, V[, H])
    rows: str  # the summed gradient rows (G of the node)
    unique: str  # the touched rows
    reads: list[str]  # R, T, rows, unique (or, deduplicated here: R, T, every gradient row, its index)
    dedup: bool = False


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
        found = group and dedup_nodes(group.unique, group.rows, group.nodes, producers, consumers,
                                      inits, outputs)
        if found and group is not None:
            extra, g, index = found
            group.nodes += extra
            group.reads = [group.node.input[0], group.node.input[1], g, index]
            group.dedup = True
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
        out = node.output[spec.updated_inputs.index(role)]
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


def _only(consumers, name: str, outputs, op_type: str | None = None):
    """The one node reading ``name`` (of ``op_type``), or None."""
    found = consumers.get(name, [])
    if len(found) != 1 or name in outputs or (op_type and found[0].op_type != op_type):
        return None
    return found[0]


def dedup_nodes(unique_name: str, rows_name: str, group: list, producers, consumers, inits,
                outputs) -> tuple[list, str, str] | None:
    """If ``unique_name`` and ``rows_name`` come from the builder's deduplication and only the
    ``group`` nodes read them: (its nodes, every gradient row, their indices); else None."""
    unique = producers.get(unique_name)
    summed = producers.get(rows_name)
    ids = {id(n) for n in group}
    if unique is None or summed is None or unique.op_type != "Unique" or len(unique.output) < 3 \
            or not unique.output[2] or summed.op_type != "ScatterND" or rows_name in outputs \
            or any(id(n) not in ids for n in consumers.get(rows_name, [])):
        return None
    reduction = next((helper.get_attribute_value(a) for a in summed.attribute if a.name == "reduction"), b"")
    zeros, at, g = summed.input
    fill, at_node = producers.get(zeros), producers.get(at)
    if reduction not in (b"add", "add") or fill is None or fill.op_type != "ConstantOfShape" \
            or at_node is None or at_node.op_type != "Unsqueeze" or at_node.input[0] != unique.output[2]:
        return None
    axes = _constant(at_node.input[1], producers, inits) if len(at_node.input) > 1 else None
    value = numpy_helper.to_array(fill.attribute[0].t) if fill.attribute else np.zeros(1)
    if axes is None or list(np.asarray(axes).reshape(-1)) not in ([1], [-1]) or value.any():
        return None
    concat = producers.get(fill.input[0])
    shape = producers.get(concat.input[0]) if concat is not None and concat.op_type == "Concat" else None
    if shape is None or shape.op_type != "Shape" or list(shape.input) != [unique_name]:
        return None
    chain = [(fill.output[0], summed), (at, summed), (unique.output[2], at_node),
             (concat.output[0], fill), (shape.output[0], concat)]
    if any(_only(consumers, name, outputs) is not reader for name, reader in chain):
        return None
    extra = [unique, summed, fill, at_node, concat, shape]
    ids |= {id(n) for n in extra}
    # what still reads u: the group's Gathers, Shape, and the Unsqueeze feeding the group's ScatterNDs
    for reader in consumers.get(unique_name, []):
        if id(reader) in ids:
            continue
        if reader.op_type != "Unsqueeze" or any(id(n) not in ids for n in consumers.get(reader.output[0], [])):
            return None
        extra.append(reader)
        ids.add(id(reader))
    if any(o in outputs for n in extra for o in n.output):
        return None
    return extra, g, unique.input[0]


@dataclass
class RowPlan:
    """A row group ready to run: its kernel, attributes and state arrays."""

    step: Any
    attributes: dict
    label: str
    reads: list[str]
    arrays: list[np.ndarray]  # state arrays, viewed as [rows, row size]
    slots: np.ndarray | None = None  # row -> slot (-1 when free), for deduplicating here


def plan(groups: list[RowGroup], state: Mapping[str, np.ndarray]) -> list[RowPlan]:
    plans = []
    for g in groups:
        filled = onnx.ModelProto()
        filled.graph.node.append(g.node)
        fill_default_attributes(filled)
        arrays = [state[s].reshape(state[s].shape[0], -1) for s in g.states]
        slots = np.full(arrays[0].shape[0], -1, np.int64) if g.dedup else None
        plans.append(RowPlan(STEPS[g.node.op_type], node_attributes(filled.graph.node[0]),
                             node_label(g.node), g.reads, arrays, slots))
    return plans


def apply_row_groups(plans: list[RowPlan], values: Mapping[str, Any]) -> None:
    """Update the touched rows of each table in place; ``values`` gives R, T, rows, unique."""
    for p in plans:
        r, t, rows, unique = (np.asarray(values[name]) for name in p.reads)
        x, *rest = p.arrays
        if p.slots is not None:  # every gradient row and its index: sum the duplicates first
            unique, rows = _dedup(unique.astype(np.int64, copy=False),
                                  rows.reshape(len(unique), x.shape[1]), p.slots)
        p.step(r, t, x, rows.reshape(len(unique), x.shape[1]), *rest, p.attributes,
               inplace=True, rows=unique)


def _dedup(index: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct indices, their summed rows), rows added from zero in order of appearance."""
    if _dedup_numba is None:
        unique, inverse = np.unique(index, return_inverse=True)
        summed = np.zeros((len(unique), rows.shape[1]), rows.dtype)
        np.add.at(summed, inverse, rows)
        return unique, summed
    order = np.empty(len(index), np.int64)
    summed = np.empty(rows.shape, rows.dtype)
    count = _dedup_numba(index, np.ascontiguousarray(rows), slots, order, summed)
    return order[:count], summed[:count]


try:
    from ...kernels._numba_rows import dedup_rows as _dedup_numba
except ImportError:  # pragma: no cover - without numba
    _dedup_numba = None
