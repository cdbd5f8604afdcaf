"""The fast path of RMSProp: its standard-op update cut out and run by one numba loop in place.

RMSProp has no op in the training domain: the builder writes it as standard ops
(:func:`onnx_training_ops.optim.rmsprop.emit_rmsprop`). For each trainable the session re-emits that
update for the model's recorded optimizer into a template and matches it node for node
against the graph, from the values bound to X and its states back to X, G, the states and R
(same op types, attributes and constants). A match whose inner values nothing else reads is
cut; onnxruntime outputs G and R into preallocated buffers, and
:func:`onnx_training_ops.kernels.fused.rmsprop_` applies the same arithmetic in place (tests
compare it bit for bit with the graph path).

A lazy table (:mod:`onnx_training_ops.builder.sparse_updates`) matches the same template between
``Gather(S, u)`` of its rows and ``ScatterND(S, Unsqueeze(u, 1), ·)`` bound back to S; those
and the builder's deduplication are cut too, and the loop runs on the touched rows in place
(:func:`.row_updates.dedup_nodes`, :func:`.row_updates._dedup`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...builder.metadata import TrainingMetadata
from ...builder.ops import Ops
from ...errors import TrainingOpError
from ...kernels.apply import fused_available, rmsprop_step
from ...optim.registry import from_record
from ...optim.rmsprop import RMSProp, emit_rmsprop
from .row_updates import _dedup, dedup_nodes


@dataclass
class RMSPropGroup:
    """One tensor's RMSProp update, cut out of the graph."""

    optimizer: RMSProp
    nodes: list
    x: str  # the parameter (state)
    states: dict[str, str]  # square_avg / momentum_buffer / grad_avg -> state variable
    reads: list[str]  # [R in the tensor's dtype, G] (rows: [R, G rows, u]; dedup: [R, g, index])
    rows: bool = False
    dedup: bool = False


def _template(opt: RMSProp, dtype: np.dtype) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    nodes: list[onnx.NodeProto] = []
    count = iter(range(1 << 30))
    ops = Ops(lambda base: f"t{next(count)}", nodes, "t")
    states = {s: f"S.{s}" for s in opt.states}
    emit_rmsprop(ops, opt, "R", "X", "G", states, "X.new", {s: f"S.{s}.new" for s in opt.states}, dtype)
    return nodes, states


def _const(node: onnx.NodeProto | None) -> np.ndarray | None:
    if node is None or node.op_type != "Constant" or len(node.attribute) != 1 or node.attribute[0].name != "value":
        return None
    return numpy_helper.to_array(node.attribute[0].t)


def _match(template, graph_producers, consumers, outputs, start: dict[str, str], allowed=()):
    """Map template names to graph names from ``start`` (outputs) backwards; (mapping, nodes) or
    None. ``allowed``: nodes outside the template that may read its values."""
    t_producers = {o: n for n in template for o in n.output}
    mapping, pending = dict(start), list(start)
    nodes: list[onnx.NodeProto] = []
    while pending:
        t_name = pending.pop()
        t_node = t_producers.get(t_name)
        if t_node is None:
            continue  # a leaf: X, G, R or a state
        g_node = graph_producers.get(mapping[t_name])
        if g_node is None or g_node.op_type != t_node.op_type or g_node.domain != t_node.domain \
                or len(g_node.input) != len(t_node.input) \
                or [(a.name, helper.get_attribute_value(a)) for a in g_node.attribute if a.name != "value"] != \
                [(a.name, helper.get_attribute_value(a)) for a in t_node.attribute if a.name != "value"]:
            return None
        if any(n is g_node for n in nodes):
            continue
        if t_node.op_type == "Constant":
            expected, found = _const(t_node), _const(g_node)
            if found is None or expected is None or found.dtype != expected.dtype \
                    or not np.array_equal(found, expected):
                return None
        nodes.append(g_node)
        for t_in, g_in in zip(t_node.input, g_node.input):
            if mapping.setdefault(t_in, g_in) != g_in:
                return None
            pending.append(t_in)
    inner = {v for t, v in mapping.items() if t in t_producers}
    ids = {id(n) for n in [*nodes, *allowed]}
    for name in inner:  # nothing outside the update reads its intermediate values
        if any(id(c) not in ids for c in consumers.get(name, [])):
            return None
        if name in outputs and name not in start.values():
            return None
    return mapping, nodes


def rmsprop_groups(graph: onnx.GraphProto, binding: Mapping[str, str], state: Mapping[str, np.ndarray],
                   meta: TrainingMetadata, taken: set[str]) -> list[RMSPropGroup]:
    """The RMSProp updates of the builder's model (its ``optimizer`` metadata) the session can
    apply in place; none touches a state in ``taken``."""
    try:
        opt = from_record(dict(meta.optimizer or {}))
    except (ValueError, KeyError, TypeError):
        return []
    if not isinstance(opt, RMSProp) or not fused_available():
        return []
    producers = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    reverse: dict[str, list[str]] = {}
    for key, value in binding.items():
        reverse.setdefault(value, []).append(key)
    inits = {t.name: t for t in graph.initializer}
    templates: dict[np.dtype, tuple] = {}
    groups = []
    for x in meta.trainable:
        if x not in state or x in taken or x not in binding:
            continue
        dtype = state[x].dtype
        if dtype not in templates:
            templates[dtype] = _template(opt, dtype)
        template, t_states = templates[dtype]
        names = {s: f"{x}.{s}" for s in opt.states}  # the builder's state names
        if any(n not in state or n in taken or n not in binding for n in names.values()):
            continue
        start = {"X.new": binding[x], **{f"S.{s}.new": binding[n] for s, n in names.items()}}
        if any(reverse.get(v) != [k] for k, v in [(x, binding[x]), *((n, binding[n]) for n in names.values())]):
            continue
        group = _dense(template, t_states, opt, x, names, start, producers, consumers, outputs) or \
            _rows(template, t_states, opt, x, names, start, producers, consumers, outputs, inits)
        if group is not None:
            groups.append(group)
            taken |= {x, *names.values()}
    return groups


def _dense(template, t_states, opt, x, names, start, producers, consumers, outputs):
    found = _match(template, producers, consumers, outputs, start)
    if found is None:
        return None
    mapping, nodes = found
    if mapping.get("X") != x or any(mapping.get(t) != names[s] for s, t in t_states.items()):
        return None
    return RMSPropGroup(opt, nodes, x, names, [mapping["R"], mapping["G"]])


def _rows(template, t_states, opt, x, names, start, producers, consumers, outputs, inits):
    """A lazy table: ScatterND(S, at, new rows) bound to each state, rows from Gather(S, u)."""
    scatters = {t: producers.get(v) for t, v in start.items()}
    if any(n is None or n.op_type != "ScatterND" or len(n.input) != 3 or
           any(a.name == "reduction" and helper.get_attribute_value(a) not in (b"none", "none")
               for a in n.attribute) for n in scatters.values()):
        return None
    at = {n.input[1] for n in scatters.values()}
    if len(at) != 1:
        return None
    at = at.pop()
    owner = {"X.new": x, **{f"S.{s}.new": n for s, n in names.items()}}
    if any(n.input[0] != owner[t] for t, n in scatters.items()):
        return None
    found = _match(template, producers, consumers, outputs,
                   {t: n.input[2] for t, n in scatters.items()}, allowed=list(scatters.values()))
    if found is None:
        return None
    mapping, nodes = found
    leaves = {"X": x, **{t: names[s] for s, t in t_states.items()}}
    gathers, unique = [], None
    for t, table in leaves.items():
        gather = producers.get(mapping.get(t, ""))
        if gather is None or gather.op_type != "Gather" or gather.input[0] != table or \
                any(a.name == "axis" and helper.get_attribute_value(a) != 0 for a in gather.attribute) or \
                (unique is not None and gather.input[1] != unique) or gather.output[0] in outputs:
            return None
        unique = gather.input[1]
        gathers.append(gather)
    unsqueeze = producers.get(at)
    axes = _const(producers.get(unsqueeze.input[1])) if unsqueeze is not None and len(unsqueeze.input) > 1 else None
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.input[0] != unique or \
            axes is None or list(axes.reshape(-1)) not in ([1], [-1]):
        return None
    group = [*nodes, *gathers, *scatters.values()]
    ids = {id(n) for n in group}
    for gather in gathers:  # the gathered rows feed only the update
        if any(id(c) not in ids for c in consumers.get(gather.output[0], [])):
            return None
    found = dedup_nodes(unique, mapping["G"], group, producers, consumers, inits, outputs)
    if found is None:
        return RMSPropGroup(opt, group, x, names, [mapping["R"], mapping["G"], unique], rows=True)
    extra, g, index = found
    return RMSPropGroup(opt, group + extra, x, names, [mapping["R"], g, index], rows=True, dedup=True)


@dataclass
class RMSPropPlan:
    optimizer: RMSProp
    x: np.ndarray  # 2-D [rows, row size] for a lazy table
    states: dict[str, np.ndarray]
    reads: list[str]
    rows: bool
    slots: np.ndarray | None  # row -> slot, when deduplicating here


def plan(groups: list[RMSPropGroup], state: Mapping[str, np.ndarray]) -> list[RMSPropPlan]:
    def view(a, rows):
        return a.reshape(a.shape[0], -1) if rows else a

    return [RMSPropPlan(g.optimizer, view(state[g.x], g.rows),
                        {s: view(state[n], g.rows) for s, n in g.states.items()}, g.reads, g.rows,
                        np.full(state[g.x].shape[0], -1, np.int64) if g.dedup else None)
            for g in groups]


def apply_rmsprop(plans: list[RMSPropPlan], values: Mapping[str, Any]) -> None:
    """Each planned RMSProp update in place; ``values`` gives R (in the tensor's dtype), G and,
    for a lazy table, the touched rows (or every gradient row and its index)."""
    for p in plans:
        g, rows = np.asarray(values[p.reads[1]]), None
        if p.rows:
            rows = np.asarray(values[p.reads[2]]).astype(np.int64, copy=False)
            g = g.reshape(len(rows), p.x.shape[1])
            if p.slots is not None:
                rows, g = _dedup(rows, g, p.slots)
            g = np.ascontiguousarray(g)
        if not rmsprop_step(np.asarray(values[p.reads[0]]), p.x, g, p.states, p.optimizer, rows=rows):
            raise TrainingOpError("RMSProp fast path: the fused kernel does not apply to the state "
                                  "arrays (dtype or layout changed?)")
