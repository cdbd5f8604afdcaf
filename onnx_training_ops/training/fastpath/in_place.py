"""In-place optimizer outputs for ``fast=False``: the native kernels write the new state
straight into the state arrays.

The native optimizer kernels (:mod:`onnx_training_ops.runtime.native`) read every element before
writing it, so an output bound onto its own input buffer updates that tensor in place.
:func:`in_place_outputs` finds the optimizer outputs of a prepared graph that can be bound
so (``X_new`` onto the state ``X``, ``V_new`` onto ``V``, ``H_new`` onto ``H``): the state
must be read by no node that may run after the optimizer node, i.e. every other reader is
an ancestor of it (onnxruntime runs a node only after its inputs are computed).

The state then changes *during* the onnxruntime run, before the loss is checked. Where a
check may undo the step (``on_nonfinite="raise"`` or ``"skip"``), :func:`add_finite_guard`
makes the run fail before the first optimizer node on a non-finite loss, and the step is
redone without in-place writes (:mod:`..graphs.step`); with ``"ignore"``, and in the apply stage of
:meth:`~onnx_training_ops.TrainingSession.optimizer_step`, no guard is needed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from ...passes.target_native import NATIVE_DOMAIN, NATIVE_OP_TYPES
from ...schema import OPTIMIZERS
from ..graphs.pruning import node_reads

_NATIVE_TO_SPEC = {native: OPTIMIZERS[op] for op, native in NATIVE_OP_TYPES.items()}


def _ancestors(nodes: list[onnx.NodeProto], index: int, producer: Mapping[str, int]) -> set[int]:
    """Indices of the nodes ``nodes[index]`` depends on, directly or not."""
    seen: set[int] = set()
    pending = list(node_reads(nodes[index]))
    while pending:
        i = producer.get(pending.pop())
        if i is not None and i not in seen:
            seen.add(i)
            pending += node_reads(nodes[i])
    return seen


def _pairs(node: onnx.NodeProto) -> list[tuple[str, str, str]]:
    """(input, output, X) of a native optimizer node: the input and output holding the same
    tensor (X/X_new, V/V_new, H/H_new) and the X they belong to."""
    spec = _NATIVE_TO_SPEC[node.op_type]
    n = spec.n_tensors(len(node.input))
    if not n or len(node.output) != n * spec.n_groups_out:
        return []
    pairs = []
    for j, role in enumerate(spec.updated_inputs):
        group = spec.tensor_inputs.index(role)
        pairs += [(node.input[2 + group * n + i], node.output[j * n + i], node.input[2 + i])
                  for i in range(n)]
    return pairs


def in_place_outputs(
    graph: onnx.GraphProto, binding: Mapping[str, str], state: Mapping[str, np.ndarray]
) -> dict[str, str]:
    """Output name -> state name, for the native optimizer outputs of ``graph`` (a prepared
    graph) that may be written into their state array during the run.

    ``binding`` maps state names to the outputs that update them (``update_binding``).
    An output qualifies when it updates the very state its node reads at its position, the
    node reads that state nowhere else, and every other node reading it is an ancestor of
    the node."""
    nodes = list(graph.node)
    producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in set(node_reads(node)):
            readers.setdefault(name, []).append(i)
    updated_by = {value: key for key, value in binding.items()}
    if len(updated_by) != len(binding):  # one output updating two states: leave it to the copies
        return {}
    graph_outputs = {o.name for o in graph.output}
    found: dict[str, str] = {}
    for index, node in enumerate(nodes):
        if node.domain != NATIVE_DOMAIN or node.op_type not in _NATIVE_TO_SPEC:
            continue
        ancestors = None
        for name, output, x in _pairs(node):
            if updated_by.get(output) != name or output not in graph_outputs or name not in state:
                continue
            if list(node.input).count(name) != 1 or x not in state or state[name].shape != state[x].shape:
                continue  # read twice (as X and G?) or broadcast (a state smaller than X)
            if ancestors is None:
                ancestors = _ancestors(nodes, index, producer)
            if all(i == index or i in ancestors for i in readers.get(name, ())):
                found[output] = name
    return found


GUARD = "onnx_training_ops.finite_guard"
GUARD_FAILURE = f"{GUARD}/reshape"  # in onnxruntime's message when the guard stopped a run


def add_finite_guard(model: onnx.ModelProto, losses: list[str]) -> bool:
    """Make every native optimizer node of ``model`` (prepared) wait for the ``losses`` and
    fail before writing anything when one is NaN or infinite; True if a node was guarded.

    Each optimizer reads its ``T`` through ``Reshape(T, shape)``, ``shape`` being ``[1]``
    when ``sum(loss - loss) == 0`` (every loss finite) and ``[2]`` otherwise: that Reshape
    then fails (its node is named :data:`GUARD`), the run stops and no optimizer node has
    run. The step is then redone without in-place writes (:mod:`..graphs.step`), which applies the
    non-finite policy as usual."""
    graph = model.graph
    optimizers = [i for i, n in enumerate(graph.node)
                  if n.domain == NATIVE_DOMAIN and n.op_type in _NATIVE_TO_SPEC]
    if not optimizers or not losses:
        return False
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    if any(producer.get(loss, -1) > optimizers[0] for loss in losses):
        return False  # a loss listed after an optimizer: the guard could not precede them all
    make = onnx.helper.make_node
    name = lambda part: f"{GUARD}/{part}"  # noqa: E731
    declared = {o.name: o.type.tensor_type for o in graph.output}
    nodes, terms = [], []
    for k, loss in enumerate(losses):  # loss - loss: 0 if finite, NaN if not
        nodes.append(make("Sub", [loss, loss], [name(f"diff{k}")], name=name(f"sub{k}")))
        term = nodes[-1].output[0]
        tt = declared.get(loss)
        if tt is None or tt.elem_type != onnx.TensorProto.FLOAT:
            nodes.append(make("Cast", [term], [name(f"diff{k}_f32")], name=name(f"cast{k}"),
                              to=onnx.TensorProto.FLOAT))
            term = nodes[-1].output[0]
        if tt is None or not tt.HasField("shape") or len(tt.shape.dim) > 1 or \
                any(d.dim_value != 1 for d in tt.shape.dim):  # not known to be one element
            nodes.append(make("ReduceSum", [term], [name(f"total{k}")], name=name(f"reduce{k}"), keepdims=0))
            term = nodes[-1].output[0]
        terms.append(term)
    total = terms[0]
    for k, term in enumerate(terms[1:]):
        nodes.append(make("Add", [total, term], [name(f"sum{k}")], name=name(f"add{k}")))
        total = nodes[-1].output[0]
    graph.initializer.extend([
        onnx.numpy_helper.from_array(np.zeros((), np.float32), name("zero")),
        onnx.numpy_helper.from_array(np.array([1], np.int64), name("shape_ok")),
        onnx.numpy_helper.from_array(np.array([2], np.int64), name("shape_bad")),
    ])
    nodes += [
        make("Equal", [total, name("zero")], [name("finite")], name=name("equal")),
        make("Where", [name("finite"), name("shape_ok"), name("shape_bad")], [name("shape")], name=name("where")),
    ]
    guarded: dict[str, str] = {}
    for i in optimizers:
        node = graph.node[i]
        t = node.input[1]
        if t not in guarded:
            guarded[t] = name(f"T{len(guarded)}")
            nodes.append(make("Reshape", [t, name("shape")], [guarded[t]], name=name(f"reshape{len(guarded)}")))
        node.input[1] = guarded[t]
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend(kept[:optimizers[0]] + nodes + kept[optimizers[0]:])
    return True
