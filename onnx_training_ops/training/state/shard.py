"""One rank's share of a training model's optimizer (ZeRO stage 1): the pure-ONNX part.

:func:`partition` assigns each trainable to a rank, balancing the element counts;
:func:`shard_model` rewrites the training model for one rank:

* the optimizer updates only the rank's own trainables: a multi-tensor optimizer node keeps
  the tensors whose results are still needed, and dead nodes go;
* the optimizer state (V, H, ...) of the other ranks' trainables is dropped: initializers
  and bindings, so V/H memory per rank is about 1 / world of the whole;
* the other ranks' parameters stay state variables (``X <- Identity(X)``: the session skips
  such pass-through bindings), so the forward pass reads them and an all-gather after each
  optimizer step writes them.

It needs the builder's ``optimizer_state`` metadata (which state variables belong to which
trainable). The collectives live in :mod:`onnx_training_ops.distributed`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import onnx
from onnx import helper

from ...builder.metadata import TrainingMetadata
from ...builder.model_metadata import META_PREFIX
from ...errors import TrainingOpError
from ...schema import DOMAIN, OPTIMIZERS
from ...storage import checkpoint
from ..graphs.pruning import node_reads, prune_dead_nodes

SHARD_KEY = "shard"  # metadata: {"rank": r, "world": w, "owned": [...]}


def optimizer_state(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Trainable -> its optimizer state variables, from the builder's metadata."""
    state = TrainingMetadata.from_model(model).optimizer_state
    if not state:
        raise TrainingOpError(
            "sharding the optimizer state needs a model from build_training_model (metadata "
            f"'{META_PREFIX}optimizer_state' says which state belongs to which trainable); this model has none")
    return {name: list(names) for name, names in state.items()}


def _sizes(model: onnx.ModelProto, names: Sequence[str]) -> list[int]:
    dims = {t.name: t.dims for g in (model.graph, *(i.algorithm for i in model.training_info))
            for t in g.initializer}
    return [math.prod(dims[name]) for name in names]


def partition(model: onnx.ModelProto, world: int) -> dict[str, int]:
    """Trainable -> owning rank, balanced by element count as torch's
    ``ZeroRedundancyOptimizer`` does: largest first, each to the least-loaded rank (a rank may
    own nothing when there are fewer trainables than ranks)."""
    names = list(optimizer_state(model))
    loads = [0] * world
    owners = {}
    for size, name in sorted(zip(_sizes(model, names), names), key=lambda pair: -pair[0]):
        rank = loads.index(min(loads))
        owners[name] = rank
        loads[rank] += size
    return {name: owners[name] for name in names}


def _live_subset(node: onnx.NodeProto, live: set[str]) -> list[int]:
    """The tensor indices of a multi-tensor optimizer node some of whose outputs are live."""
    spec = OPTIMIZERS[node.op_type]
    n = spec.n_tensors(len(node.input)) or 0
    return [i for i in range(n) if any(node.output[k * n + i] in live for k in range(spec.n_groups_out))]


def _keep_tensors(node: onnx.NodeProto, keep: list[int]) -> None:
    spec = OPTIMIZERS[node.op_type]
    n = spec.tensor_count(node)
    inputs = list(node.input[:2]) + [node.input[2 + k * n + i] for k in range(spec.n_groups_in) for i in keep]
    outputs = [node.output[k * n + i] for k in range(spec.n_groups_out) for i in keep]
    del node.input[:], node.output[:]
    node.input.extend(inputs)
    node.output.extend(outputs)


def _prune_algorithm(graph: onnx.GraphProto, live: set[str]) -> None:
    """Drop the algorithm's nodes no live value depends on; shrink multi-tensor optimizer
    nodes to their live tensors (one backward sweep: the graph is topologically sorted)."""
    kept = []
    for node in reversed(graph.node):
        if node.domain == DOMAIN and node.op_type in OPTIMIZERS:
            indices = _live_subset(node, live)
            if not indices:
                continue
            _keep_tensors(node, indices)
        elif not any(o in live for o in node.output if o):
            continue
        kept.append(node)
        live.update(node_reads(node))
    del graph.node[:]
    graph.node.extend(reversed(kept))


def _drop_initialization(info: onnx.TrainingInfoProto, dropped: set[str]) -> None:
    """Forget the initialization bindings of dropped state and what only they needed."""
    entries = [(e.key, e.value) for e in info.initialization_binding if e.key not in dropped]
    del info.initialization_binding[:]
    for key, value in entries:
        info.initialization_binding.add(key=key, value=value)
    graph = info.initialization
    bound = {value for _, value in entries}
    outputs = [o for o in graph.output if o.name in bound]
    del graph.output[:]
    graph.output.extend(outputs)
    prune_dead_nodes(graph)


def shard_model(model: onnx.ModelProto, owners: Mapping[str, int], rank: int, world: int) -> onnx.ModelProto:
    """A copy of ``model`` whose optimizer updates and state cover only the trainables
    ``owners`` gives to ``rank`` of ``world`` (see the module docstring)."""
    if len(model.training_info) != 1:
        raise TrainingOpError(f"sharding the optimizer state needs one training_info, found {len(model.training_info)}")
    per_param = optimizer_state(model)
    missing = sorted(set(per_param) - set(owners))
    if missing:
        raise TrainingOpError(f"shard_model: no owner given for trainable(s) {missing}")
    foreign = {p for p, r in owners.items() if r != rank}
    dropped = {s for p in foreign for s in per_param[p]}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    info = out.training_info[0]
    algo = info.algorithm
    bindings = [(e.key, e.value) for e in info.update_binding]
    unbound = {value for key, value in bindings if key in foreign or key in dropped}
    del info.update_binding[:]
    for key, value in bindings:
        if key in dropped:
            continue
        if key in foreign:  # still state (read by the forward pass, written by the all-gather)
            value = f"{key}.{SHARD_KEY}.kept"
            algo.node.append(helper.make_node("Identity", [key], [value], name=value))
            algo.output.append(onnx.ValueInfoProto(name=value))
        info.update_binding.add(key=key, value=value)
    kept_outputs = [o for o in algo.output if o.name not in unbound]
    del algo.output[:]
    algo.output.extend(kept_outputs)
    _prune_algorithm(algo, {o.name for o in algo.output} | {e.value for e in info.update_binding})
    _drop_initialization(info, dropped)
    read = {name for node in algo.node for name in node_reads(node)}
    kept_inits = [t for t in algo.initializer if t.name not in dropped or t.name in read]
    del algo.initializer[:]
    algo.initializer.extend(kept_inits)
    owned = sorted(p for p, r in owners.items() if r == rank)
    out.metadata_props.add(key=META_PREFIX + SHARD_KEY, value=json.dumps(
        {"rank": rank, "world": world, "owned": owned}))
    return checkpoint.add_checksums(out)


def skeleton(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """``model`` without its state values (rank 0 keeps it to write whole checkpoints from
    gathered state, :func:`~onnx_training_ops.storage.snapshot.write_state`), and each state
    variable's (shape, numpy dtype)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    state = {e.key for info in out.training_info for e in (*info.update_binding, *info.initialization_binding)}
    specs = {}
    for graph in (out.graph, *(info.algorithm for info in out.training_info)):
        for tensor in graph.initializer:
            if tensor.name in state:
                specs[tensor.name] = (tuple(tensor.dims), helper.tensor_dtype_to_np_dtype(tensor.data_type))
                tensor.CopyFrom(onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims))
    return out, specs
