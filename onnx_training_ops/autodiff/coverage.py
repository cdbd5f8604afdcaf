"""Before differentiating: which parameters reach the loss, and which ops on the way lack a
derivative rule (all of them at once, with hints), so the builder can say so up front.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import onnx

from .emitter import FLOAT_TYPES
from .graph import NON_DIFFERENTIABLE, node_reads, producer_map
from .registry import RULES

# unrolled or rewritten into ops with rules by the prepare passes before differentiation
LOWERED_BY_PASSES = frozenset({"LSTM", "GRU", "RNN", "SplitToSequence", "SequenceAt"})

# inputs that never carry a gradient to a parameter even when float
NOT_TRAINED_INPUTS = {"BatchNormalization": (3, 4)}  # running mean / variance: statistics

# outputs are bool or int whatever the inputs: never on a gradient path (the types of values
# the builder itself adds are not known to shape inference yet)
NON_FLOAT_OUTPUTS = frozenset({"Less", "Greater", "Equal", "LessOrEqual", "GreaterOrEqual",
                               "Not", "And", "Or", "Xor", "IsNaN", "IsInf"})

HINTS = {
    "Dropout": "export after model.eval() (inference-mode Dropout is the identity)",
    "BatchNormalization": "export after model.eval()",
    "Loop": "control flow is not differentiated; export with static shapes so the exporter "
            "unrolls it",
    "If": "control flow is not differentiated; export in eval mode with static shapes",
    "Scan": "control flow is not differentiated",
}


@dataclass(frozen=True)
class Missing:
    """One op type without a rule on the path: how many nodes, the first one's name."""

    op_type: str
    count: int
    first: str

    def describe(self) -> str:
        hint = HINTS.get(self.op_type)
        return (f"{self.op_type} x{self.count} (first: {self.first!r})"
                + (f" — hint: {hint}" if hint else ""))


def _is_float(elem_types: Mapping[str, int], name: str) -> bool:
    t = elem_types.get(name)
    return t is None or t in FLOAT_TYPES


def reaching(nodes: Sequence[onnx.NodeProto], y: str, elem_types: Mapping[str, int]) -> set[str]:
    """Names from which ``y`` depends through float values and differentiable ops."""
    producers = producer_map(nodes)
    seen: set[str] = set()
    stack = [y]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        idx = producers.get(name)
        if idx is None:
            continue
        node = nodes[idx]
        if node.op_type in NON_DIFFERENTIABLE or node.op_type in NON_FLOAT_OUTPUTS:
            continue
        skip = NOT_TRAINED_INPUTS.get(node.op_type, ())
        for i, inp in enumerate(node.input):
            if inp and i not in skip and _is_float(elem_types, inp):
                stack.append(inp)
        stack.extend(r for r in node_reads(node)[len(node.input):] if _is_float(elem_types, r))
    return seen


def missing_rules(nodes: Sequence[onnx.NodeProto], y: str, leaves: Iterable[str],
                  elem_types: Mapping[str, int]) -> list[Missing]:
    """Ops between ``leaves`` and ``y`` that no rule (nor a lowering pass) differentiates."""
    backward = reaching(nodes, y, elem_types)
    active = set(leaves)
    counts: Counter = Counter()
    first: dict[str, str] = {}
    for node in nodes:  # graph order is topological
        if not any(i in active for i in node_reads(node)):
            continue
        outs = [o for o in node.output if o and _is_float(elem_types, o)]
        if node.op_type in NON_DIFFERENTIABLE or node.op_type in NON_FLOAT_OUTPUTS or not outs:
            continue
        active.update(outs)
        if not any(o in backward for o in outs):
            continue
        known = node.domain in ("", "ai.onnx") and (node.op_type in RULES or
                                                   node.op_type in LOWERED_BY_PASSES)
        if not known:
            key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") \
                else node.op_type
            counts[key] += 1
            first.setdefault(key, node.name or node.output[0])
    return [Missing(op, n, first[op]) for op, n in counts.most_common()]
