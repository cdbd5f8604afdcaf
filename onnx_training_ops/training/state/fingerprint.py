"""A training model's fingerprint: what must be equal on every rank of a data-parallel job.

Ranks may start from different state values (rank 0's are broadcast), but their graphs must
be one: the same inference graph, loss, optimizer and attributes, and state variables of the
same names, types and shapes. A rank opened on another model (another hidden size, another
optimizer, another activation) otherwise ends inside gloo (``EnforceNotMet``, SIGABRT) or,
worse, trains on, since the parameters' digest cannot tell two activations apart.
"""

from __future__ import annotations

import hashlib

import onnx

__all__ = ["fingerprint", "differences"]


def _state_names(model: onnx.ModelProto) -> set[str]:
    return {e.key for info in model.training_info for e in (*info.update_binding, *info.initialization_binding)}


def _graph_digest(graph: onnx.GraphProto, state: set[str]) -> str:
    """SHA-256 of ``graph``: nodes, inputs, outputs, initializers (state ones by name, type
    and shape only: their values may differ before the broadcast)."""
    digest = hashlib.sha256()
    for node in graph.node:
        digest.update(node.SerializeToString(deterministic=True))
    for value in (*graph.input, *graph.output):
        digest.update(value.SerializeToString(deterministic=True))
    for tensor in graph.initializer:
        if tensor.name in state:
            header = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
            digest.update(header.SerializeToString(deterministic=True))
        else:
            digest.update(tensor.SerializeToString(deterministic=True))
    return digest.hexdigest()


def fingerprint(model: onnx.ModelProto) -> dict[str, str]:
    """Per part of ``model`` (``graph``: the inference graph; ``training_info[i].algorithm``:
    loss, Gradient, optimizer; ``...initialization``; ``...bindings``; ``opsets``) a digest,
    plus ``optimizer``: the algorithm's optimizer op types, to name in a message."""
    state = _state_names(model)
    parts = {"graph": _graph_digest(model.graph, state),
             "opsets": ",".join(sorted(f"{o.domain}:{o.version}" for o in model.opset_import))}
    optimizers = []
    for i, info in enumerate(model.training_info):
        parts[f"training_info[{i}].algorithm"] = _graph_digest(info.algorithm, state)
        parts[f"training_info[{i}].initialization"] = _graph_digest(info.initialization, state)
        bindings = sorted(f"{e.key}={e.value}" for e in (*info.update_binding, *info.initialization_binding))
        parts[f"training_info[{i}].bindings"] = hashlib.sha256("\n".join(bindings).encode()).hexdigest()
        optimizers += [n.op_type for n in info.algorithm.node if n.domain == "ai.onnx.preview.training"
                       and n.op_type != "Gradient"]
    parts["optimizer"] = "+".join(optimizers) or "standard ops"
    return parts


def differences(mine: dict[str, str], reference: dict[str, str]) -> list[str]:
    """The parts where ``mine`` differs from ``reference``, in words."""
    out = []
    for part in sorted(set(mine) | set(reference)):
        if part == "optimizer" or mine.get(part) == reference.get(part):
            continue
        out.append(part)
    if mine.get("optimizer") != reference.get("optimizer"):
        out.append(f"optimizer ({mine.get('optimizer')} vs {reference.get('optimizer')})")
    return out
