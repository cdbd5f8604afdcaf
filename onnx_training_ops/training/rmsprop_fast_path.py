"""The fast path of RMSProp: its standard-op update cut out and run by one numba loop in place.

RMSProp has no op in the training domain: the builder writes it as standard ops
(:func:`onnx_training_ops.rmsprop.emit_rmsprop`). For each trainable the session re-emits that
update for the model's recorded optimizer into a template and matches it node for node
against the graph, from the values bound to X and its states back to X, G, the states and R
(same op types, attributes and constants). A match whose inner values nothing else reads is
cut; onnxruntime outputs G and R into preallocated buffers, and
:func:`onnx_training_ops.kernels.fused.rmsprop_` applies the same arithmetic in place (tests
compare it bit for bit with the graph path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import TrainingOpError
from ..kernels.apply import fused_available, rmsprop_step
from ..optimizers import from_json
from ..rmsprop import RMSProp, emit_rmsprop
from ..update_graph import Ops


@dataclass
class RMSPropGroup:
    """One tensor's RMSProp update, cut out of the graph."""

    optimizer: RMSProp
    nodes: list
    x: str  # the parameter (state)
    states: dict[str, str]  # square_avg / momentum_buffer / grad_avg -> state variable
    reads: list[str]  # [R in the tensor's dtype, G]


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


def _match(template, graph_producers, consumers, outputs, start: dict[str, str]):
    """Map template names to graph names from ``start`` (outputs) backwards; (mapping, nodes) or None."""
    t_producers = {o: n for n in template for o in n.output}
    mapping, nodes, pending = dict(start), [], list(start)
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
            if found is None or found.dtype != expected.dtype or not np.array_equal(found, expected):
                return None
        nodes.append(g_node)
        for t_in, g_in in zip(t_node.input, g_node.input):
            if mapping.setdefault(t_in, g_in) != g_in:
                return None
            pending.append(t_in)
    inner = {v for t, v in mapping.items() if t in t_producers}
    ids = {id(n) for n in nodes}
    for name in inner:  # nothing outside the update reads its intermediate values
        if any(id(c) not in ids for c in consumers.get(name, [])):
            return None
        if name in outputs and name not in start.values():
            return None
    return mapping, nodes


def rmsprop_groups(graph: onnx.GraphProto, binding: Mapping[str, str], state: Mapping[str, np.ndarray],
                   meta: Mapping[str, str], taken: set[str]) -> list[RMSPropGroup]:
    """The RMSProp updates of the builder's model (its ``optimizer`` metadata) the session can
    apply in place; none touches a state in ``taken``."""
    try:
        opt = from_json(meta.get("optimizer", ""))
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
    templates: dict[np.dtype, tuple] = {}
    groups = []
    for x in meta.get("trainable", "").split(","):
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
        found = _match(template, producers, consumers, outputs, start)
        if found is None:
            continue
        mapping, nodes = found
        if mapping.get("X") != x or any(mapping.get(t) != names[s] for s, t in t_states.items()):
            continue
        groups.append(RMSPropGroup(opt, nodes, x, names, [mapping["R"], mapping["G"]]))
        taken |= {x, *names.values()}
    return groups


@dataclass
class RMSPropPlan:
    optimizer: RMSProp
    x: np.ndarray
    states: dict[str, np.ndarray]
    reads: list[str]


def plan(groups: list[RMSPropGroup], state: Mapping[str, np.ndarray]) -> list[RMSPropPlan]:
    return [RMSPropPlan(g.optimizer, state[g.x], {s: state[n] for s, n in g.states.items()}, g.reads)
            for g in groups]


def apply_rmsprop(plans: list[RMSPropPlan], values: Mapping[str, Any]) -> None:
    """Each planned RMSProp update in place; ``values`` gives R (in the tensor's dtype) and G."""
    for p in plans:
        if not rmsprop_step(np.asarray(values[p.reads[0]]), p.x, np.asarray(values[p.reads[1]]),
                            p.states, p.optimizer):
            raise TrainingOpError("RMSProp fast path: the fused kernel does not apply to the state "
                                  "arrays (dtype or layout changed?)")
