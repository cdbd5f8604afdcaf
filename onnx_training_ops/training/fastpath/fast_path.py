"""The fast path: optimizer nodes applied in place by the fused kernels instead of onnxruntime.

An optimizer node whose outputs feed only the ``update_binding`` of the very state variables
it reads (X <- X_new, V <- V_new, H <- H_new) is cut out of the graph onnxruntime runs.
onnxruntime computes the rest (forward, loss, gradients — the optimizer's other inputs become
extra outputs written into preallocated buffers) and then the update runs in place on the
state arrays with the fused kernels (:data:`onnx_training_ops.kernels.apply.STEPS`); the X,
V, H and G of a multi-tensor node are views into one flat buffer per role, so one kernel call
updates the whole node. Without the fast path the optimizer nodes run in onnxruntime through
the PyOp plugin; both run the same kernel code on the same values, so they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import onnx

from ...errors import TrainingOpError, node_label
from ...kernels.apply import STEPS, prepare
from ...passes.encode_exact_attributes import node_attributes
from ...passes.fill_defaults import fill_default_attributes
from ...schema import DOMAIN, OPTIMIZERS
from ...storage.tensors import tensor_value
from ...walk import all_graphs, remove_nodes, subgraphs
from ..arrays import owned
from .sources import FromFeed, FromOutput, FromState, Source


@dataclass
class CutStep:
    """One tensor's optimizer update applied by the fast path, in place."""

    op_type: str
    label: str
    attributes: dict
    r: np.ndarray | FromFeed
    t: np.ndarray | FromFeed
    tensors: list[np.ndarray | FromFeed]  # per input role (X, G, V[, H])
    targets: list[np.ndarray]  # per output role: the state array it must end up in
    prescale: np.ndarray | FromFeed | None = None  # AdamW's decay factor: X *= prescale before the update
    run: Any = None  # the update checked once (kernels.apply.prepare), when every input is a buffer
    run_decays: bool = False  # ``run`` applies the prescale itself (the fused Adam kernel)


@dataclass
class FlatNode:
    """A cut node whose tensors are views into one flat buffer per role: one kernel call each step."""

    buffers: dict[str, np.ndarray]  # role (X, V[, H], and G once made) -> its flat buffer
    shapes: list[tuple[int, ...]]  # each tensor's shape, in the node's order
    offsets: np.ndarray  # where each tensor starts in a buffer (and the total size, last)
    gradients: list[str]  # the G input of each tensor
    dtype: np.dtype


def _decayed_inputs(graph: onnx.GraphProto, state: set[str], consumed: dict[str, int]) -> dict:
    """``Mul(X, factor)`` of a state variable X read once (AdamW's ``X * (1 - lr*wd)`` in front
    of its Adam node): product name -> (the Mul node, X, factor)."""
    found = {}
    for node in graph.node:
        if node.op_type == "Mul" and node.domain in ("", "ai.onnx") and len(node.input) == 2 \
                and node.input[0] in state and node.input[1] not in state \
                and consumed.get(node.output[0], 0) == 1:
            found[node.output[0]] = (node, node.input[0], node.input[1])
    return found


def cuttable_nodes(graph: onnx.GraphProto, binding: dict[str, str],
                   state_inputs: list[str]) -> tuple[list, dict[str, str]]:
    """The optimizer nodes the fast path applies in place instead of onnxruntime, and the
    decay factors folded into them (state X -> factor name): a cut node whose X input is a
    ``Mul(X, factor)`` of its own state reads X, and the fast path scales X first. The folded
    Mul nodes leave ``graph``."""
    consumed = _consumers(graph)
    reverse: dict[str, list[str]] = {}
    for key, value in binding.items():
        reverse.setdefault(value, []).append(key)
    state = set(state_inputs)
    decayed = _decayed_inputs(graph, state, consumed)
    written: set[str] = set()
    read: set[str] = set()
    cut = []
    folded: dict[str, tuple] = {}  # product name -> (Mul node, X, factor) of the cut nodes
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type not in OPTIMIZERS:
            continue
        spec = OPTIMIZERS[node.op_type]
        n = spec.n_tensors(len(node.input))
        if n is None or len(node.output) != n * spec.n_groups_out:
            continue  # invalid: prepare() reports it
        ok, node_written, node_read, node_folds = _node_state(node, spec, n, state, binding, reverse, consumed,
                                                              decayed)
        node_read.update(node.input[:2])
        node_read |= {factor for _, _, factor in node_folds.values()}
        if not ok or node_written & (written | read) or node_read & (written | node_written):
            continue
        written |= node_written
        read |= node_read
        cut.append(node)
        folded.update(node_folds)
    prescale = {}
    for node in cut:
        for k, name in enumerate(node.input):
            if name in folded:
                _, x, factor = folded[name]
                node.input[k] = x
                prescale[x] = factor
    remove_nodes(graph, [m for m, _, _ in folded.values()])  # in place: ``cut`` stays the graph's nodes
    return cut, prescale

def _consumers(graph: onnx.GraphProto) -> dict[str, int]:
    """How many node inputs read each value (in subgraphs too)."""
    consumed: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumed[name] = consumed.get(name, 0) + 1
        for sub in subgraphs(node):
            for g in all_graphs(sub):
                for n in g.node:
                    for name in n.input:
                        consumed[name] = consumed.get(name, 0) + 1
    return consumed


def _node_state(node: onnx.NodeProto, spec, n: int, state: set[str], binding: dict[str, str],
                reverse: dict[str, list[str]], consumed: dict[str, int], decayed: dict[str, tuple]
                ) -> tuple[bool, set[str], set[str], dict[str, tuple]]:
    """Whether every state a node updates is its own (bound back from the node's output, read by
    nothing else, each once), the states it writes, the gradients it reads, its folded decays."""
    ok = True
    node_written: set[str] = set()
    node_read: set[str] = set()
    node_folds = {}
    for i in range(n):
        for j, role in enumerate(spec.tensor_inputs):
            name = node.input[2 + j * n + i]
            if role == "G":
                node_read.add(name)
                continue
            if role == "X" and name in decayed:
                node_folds[name] = decayed[name]
                name = decayed[name][1]
            out = node.output[spec.updated_inputs.index(role) * n + i]
            if (
                name not in state
                or binding.get(name) != out
                or reverse.get(out) != [name]
                or consumed.get(out, 0)
                or name in node_written
            ):
                ok = False
            node_written.add(name)
    return ok, node_written, node_read, node_folds



def cut_sources(
    cut_nodes: list[onnx.NodeProto],
    graph: onnx.GraphProto,
    state: Mapping[str, np.ndarray],
    rate_inputs: Mapping[str, np.ndarray],
    init_values: Mapping[str, onnx.TensorProto],
    input_types: Mapping[str, onnx.ValueInfoProto],
    prescale: Mapping[str, str] | None = None,
    arrays: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, Source], list[str]]:
    """Where each input of the cut nodes (and each folded decay factor) comes from
    (:mod:`.sources`), and the ones ``graph`` must output for them (``arrays``: the values of
    detached initializers)."""
    produced = {o for n in graph.node for o in n.output if o}
    sources: dict[str, Source] = {}
    extra_outputs: list[str] = []
    factors = list(dict.fromkeys((prescale or {}).values()))
    for node in cut_nodes:
        for name in [*node.input, *factors]:
            if name in sources:
                continue
            if name in state:
                sources[name] = FromState(name)
            elif name in rate_inputs:
                sources[name] = rate_inputs[name]
            elif name in produced:
                sources[name] = FromOutput(name)
                extra_outputs.append(name)
            elif name in init_values and name not in input_types:
                sources[name] = owned(tensor_value(init_values[name], arrays))
            elif name in input_types:
                sources[name] = FromFeed(name)
            else:
                raise TrainingOpError(f"{node_label(node)}: input {name!r} is not defined in the graph")
    return sources, extra_outputs


def _already_flat(arrays: list[np.ndarray], offsets) -> np.ndarray | None:
    """The one buffer ``arrays`` are consecutive views of (at ``offsets``), or None."""
    base = arrays[0].base
    if base is None or base.ndim != 1 or base.size != offsets[-1] or not base.flags.c_contiguous:
        return None
    start = base.__array_interface__["data"][0]
    for a, offset in zip(arrays, offsets[:-1]):
        if a.base is not base or a.__array_interface__["data"][0] != start + int(offset) * base.itemsize:
            return None
    return base


def flatten_cut_state(
    cut_nodes: list[onnx.NodeProto], sources: Mapping[str, Any], state: dict[str, np.ndarray],
    rehome: bool = True, prescale: Mapping[str, str] | None = None, zeros: frozenset = frozenset(),
) -> dict[int, FlatNode]:
    """Re-home the X, V, H state of each cut node as views into one flat buffer per role,
    so the fast path updates all of a node's tensors with one fused kernel call.

    Replaces the arrays in ``state``; returns the position of each node laid out flat in
    ``cut_nodes`` -> its :class:`FlatNode`. With ``rehome=False`` (a program
    opened after others bound the state) the arrays stay where they are: a node is laid out
    flat only if its state already is. ``zeros``: state known to be all zeros (not copied).
    """
    flat_nodes = {}
    for k, node in enumerate(cut_nodes):
        spec = OPTIMIZERS[node.op_type]
        n = spec.tensor_count(node)
        roles = {role: [node.input[2 + j * n + i] for i in range(n)] for j, role in enumerate(spec.tensor_inputs)}
        xs = [state[name] for name in roles["X"]]
        dtype = xs[0].dtype
        if n < 2 or any(x.dtype != dtype for x in xs):
            continue
        if any(state[name].shape != x.shape or state[name].dtype != dtype
               for role, names in roles.items() if role != "G" for name, x in zip(names, xs)):
            continue
        if any(not isinstance(sources[g], FromOutput) for g in roles["G"]) or len(set(roles["G"])) != n:
            continue
        if len({(prescale or {}).get(x) for x in roles["X"]}) != 1:
            continue  # tensors with different decay factors: per-tensor updates
        sizes = [x.size for x in xs]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        flat = {}
        if not rehome:
            found = {role: _already_flat([state[name] for name in names], offsets)
                     for role, names in roles.items() if role != "G"}
            buffers = {role: buf for role, buf in found.items() if buf is not None}
            if len(buffers) == len(found):
                flat_nodes[k] = FlatNode(buffers, [x.shape for x in xs], offsets, roles["G"], dtype)
            continue
        for role, names in roles.items():
            if role == "G":
                continue
            buf = np.zeros(int(offsets[-1]), dtype)  # pages the OS gives on first write
            for name, x, a, b in zip(names, xs, offsets[:-1], offsets[1:]):
                view = buf[a:b].reshape(x.shape)
                if name not in zeros:  # a zero state (fresh V, H) is not copied: its pages stay untouched
                    view[...] = state[name]
                state[name] = view
            flat[role] = buf
        flat_nodes[k] = FlatNode(flat, [x.shape for x in xs], offsets, roles["G"], dtype)
    return flat_nodes


def flat_gradient_views(
    flat_nodes: dict[int, FlatNode], values: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Gradients of a flat node: views into one flat buffer, the kernel's G, shaped like X.

    Before the first run (``values`` None) the buffers are made, for onnxruntime to write
    into from the first step on: no step allocates gradients of its own (the first used to,
    and its arena kept that memory). After it, ``values`` are the first run's outputs: the
    buffers are reused (or made) and a node whose gradients do not match its X leaves
    ``flat_nodes`` (per-tensor updates).
    """
    flat_grads = {}
    for k, entry in list(flat_nodes.items()):
        if values is not None and any(values[g].shape != shape or values[g].dtype != entry.dtype
                                      for g, shape in zip(entry.gradients, entry.shapes)):
            del flat_nodes[k]  # gradients do not match X: per-tensor updates
            continue
        offsets = entry.offsets
        if "G" not in entry.buffers:
            entry.buffers["G"] = np.empty(int(offsets[-1]), entry.dtype)
        flat_grads.update({g: entry.buffers["G"][a:b].reshape(shape)
                           for g, shape, a, b in zip(entry.gradients, entry.shapes, offsets[:-1], offsets[1:])})
    return flat_grads


def cut_plan(
    cut_nodes: list[onnx.NodeProto],
    flat_nodes: Mapping[int, FlatNode],
    sources: Mapping[str, Any],
    fixed_buffers: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray],
    prescale: Mapping[str, str] | None = None,
) -> list[CutStep]:
    """The in-place updates of the cut nodes: one step per flat node, else one per tensor."""
    plan = []
    for k, node in enumerate(cut_nodes):
        filled = onnx.ModelProto()
        filled.graph.node.append(node)
        fill_default_attributes(filled)
        attributes = node_attributes(filled.graph.node[0])
        spec = OPTIMIZERS[node.op_type]
        n = spec.tensor_count(node)

        def source(name):
            src = sources[name]
            if isinstance(src, FromOutput):
                return fixed_buffers[name]
            if isinstance(src, FromState):
                return state[src.name]
            return src

        def factor(x):
            name = (prescale or {}).get(x)
            return None if name is None else source(name)

        entry = flat_nodes.get(k)
        if entry is not None:
            flat = entry.buffers
            tensors: list[np.ndarray | FromFeed] = [flat[role] for role in spec.tensor_inputs]
            targets = [flat[role] for role in spec.updated_inputs]
            plan.append(CutStep(node.op_type, node_label(node), attributes, source(node.input[0]),
                                source(node.input[1]), tensors, targets, factor(node.input[2])))
            continue
        for i in range(n):
            tensors = [source(node.input[2 + j * n + i]) for j in range(spec.n_groups_in)]
            targets = []
            for role in spec.updated_inputs:
                j = spec.tensor_inputs.index(role)
                targets.append(state[node.input[2 + j * n + i]])
            plan.append(
                CutStep(node.op_type, node_label(node), attributes, source(node.input[0]),
                        source(node.input[1]), tensors, targets, factor(node.input[2 + i]))
            )
    return plan


def prepare_plan(plan: list[CutStep]) -> None:
    """Check each update once: those whose inputs are all buffers get a prepared ``run``."""
    for s in plan:
        in_place = all(t is x for t, x in zip(s.targets, s.tensors[:1] + s.tensors[2:]))
        s.run, s.run_decays = None, False
        if in_place and s.prescale is not None:
            s.run = prepare(s.op_type, s.r, s.t, s.tensors, s.attributes, decay=s.prescale)
            s.run_decays = s.run is not None
        if in_place and s.run is None:
            s.run = prepare(s.op_type, s.r, s.t, s.tensors, s.attributes)


def apply_plan(plan: list[CutStep]) -> None:
    """Run the cut updates in place (no input of theirs is a feed)."""
    for s in plan:
        if s.run_decays:
            s.run()
            continue
        if s.prescale is not None:  # the folded Mul, as onnxruntime computes it (float multiply)
            x = cast(np.ndarray, s.tensors[0])  # no input of a plan run here is a feed
            np.multiply(x, cast(np.ndarray, s.prescale), out=x)
        if s.run is not None:
            s.run()
            continue
        outs = STEPS[s.op_type](s.r, s.t, *s.tensors, s.attributes, inplace=True)
        for target, out in zip(s.targets, outs):
            if out is not target:
                np.copyto(target, out)


def apply_step_with_feeds(s: CutStep, feeds: Mapping[str, Any]) -> None:
    """Run one cut update in place, taking its :class:`~.sources.FromFeed` inputs from ``feeds``."""

    def value(x):
        return np.asarray(feeds[x.name]) if isinstance(x, FromFeed) else x

    r, t, tensors = value(s.r), value(s.t), [value(x) for x in s.tensors]
    if s.prescale is not None:
        np.multiply(tensors[0], value(s.prescale), out=tensors[0])
    outs = STEPS[s.op_type](r, t, *tensors, s.attributes, inplace=True)
    for target, out in zip(s.targets, outs):
        if out is not target:
            np.copyto(target, out)
