"""Before differentiating: which parameters reach the loss, and which ops on the way lack a
derivative rule (all of them at once, with hints), so the builder can say so up front.

The walk is :mod:`.graph`'s (activity forward from the trainables, the gradient path back
from the loss) and the rules are the registry's; what this module adds is what holds
*before* the prepare passes run: values the builder just added have no inferred type yet,
the recurrent/sequence ops are rewritten into ops with rules later, and torch's training-
mode ops are refused by their rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from .emitter import FLOAT_TYPES
from .graph import active_values, gradient_path, node_reads
from .registry import Missing, frozen_inputs, has_rule, missing_rules_of

# unrolled or rewritten into ops with rules by the prepare passes before differentiation
LOWERED_BY_PASSES = frozenset({"LSTM", "GRU", "RNN", "SplitToSequence", "SequenceAt"})


def _is_float(elem_types: Mapping[str, int], name: str) -> bool:
    t = elem_types.get(name)
    return t is None or t in FLOAT_TYPES


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = node.attribute[0].t
    return values


def _training_mode(node: onnx.NodeProto, constants: Mapping) -> bool:
    """torch's training-mode BatchNormalization / Dropout, which the rules refuse."""
    if node.op_type == "BatchNormalization":
        return any(a.name == "training_mode" and a.i for a in node.attribute)
    if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
        flag = constants.get(node.input[2])
        return flag is None or bool(numpy_helper.to_array(flag).reshape(-1)[0])
    return False


def _path(nodes: Sequence[onnx.NodeProto], y: str, leaves: Iterable[str],
          elem_types: Mapping[str, int]) -> tuple[list[int], set[str]]:
    order = range(len(nodes))  # graph order is topological
    active = active_values(nodes, order, leaves, lambda n: _is_float(elem_types, n))
    return gradient_path(nodes, order, y, active)


def trainable_names(nodes: Sequence[onnx.NodeProto], y: str, candidates: Iterable[str],
                    elem_types: Mapping[str, int]) -> set[str]:
    """The ``candidates`` from which ``y`` depends through float values and differentiable
    ops, not read only as inputs that never train (BatchNormalization's running statistics,
    a quantized weight's scales: :func:`.registry.frozen_inputs`)."""
    candidates = set(candidates)
    _, reached = _path(nodes, y, candidates, elem_types)
    frozen, trained = frozen_reads(nodes)
    return {c for c in candidates & reached if c not in frozen or c in trained}


def frozen_reads(nodes: Sequence[onnx.NodeProto]
                 ) -> tuple[dict[str, tuple[onnx.NodeProto, int]], set[str]]:
    """({name: (a node reading it as an input that never trains, the input's position)},
    {names read as other inputs})."""
    frozen: dict[str, tuple[onnx.NodeProto, int]] = {}
    trained: set[str] = set()
    for node in nodes:
        positions = frozen_inputs(node)
        for i, name in enumerate(node.input):  # by position: optional inputs may be left empty
            if i in positions:
                frozen.setdefault(name, (node, i))
            elif name:
                trained.add(name)
        trained.update(node_reads(node)[len([i for i in node.input if i]):])  # control-flow bodies' reads
    return frozen, trained


def missing_rules(graph: onnx.GraphProto, nodes: Sequence[onnx.NodeProto], y: str,
                  leaves: Iterable[str], elem_types: Mapping[str, int]) -> list[Missing]:
    """Ops between ``leaves`` and ``y`` that no rule (nor a lowering pass) differentiates;
    ``graph`` gives the constants (Dropout's training_mode input)."""
    path, reached = _path(nodes, y, leaves, elem_types)
    constants = _constants(graph)

    def covered(node: onnx.NodeProto) -> bool:
        if node.domain in ("", "ai.onnx") and node.op_type in LOWERED_BY_PASSES:
            return True
        bodies_read_active = any(i in reached for i in node_reads(node)[len(node.input):])
        return has_rule(node) and not bodies_read_active and not _training_mode(node, constants)

    return missing_rules_of(nodes[i] for i in path if not covered(nodes[i]))
