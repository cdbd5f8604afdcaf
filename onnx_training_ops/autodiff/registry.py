"""The derivative-rule registry and the context a rule receives.

A rule maps the gradients of a node's outputs to the gradients of its inputs:

    @register("Exp")
    def _exp(ctx: RuleContext) -> list[str | None]:
        return [ctx.em.op("Mul", [ctx.grad(0), ctx.output(0)])]

It returns one entry per node input (``None`` where no gradient is needed or exists) and
emits its nodes through ``ctx.em``. ``register(..., frozen=(i, ...))`` names inputs that never
train (a quantized weight, running statistics, rotary tables): the builder leaves them out of
the default trainables and refuses them when named. Rules raise :class:`RuleError` for a configuration they
do not handle; the walk turns it into a :class:`~onnx_training_ops.errors.TrainingOpError`
naming the Gradient node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache

import numpy as np
import onnx
from onnx import helper

from .emitter import Emitter, Shape

Rule = Callable[["RuleContext"], list]
RULES: dict[str, Rule] = {}
FROZEN: dict[str, frozenset[int]] = {}  # rule key -> inputs that never train


class RuleError(Exception):
    """A rule cannot differentiate this node (unsupported attribute, opset, unknown rank...)."""


def register(*op_types: str, frozen: Iterable[int] = ()) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the derivative rule of ``op_types``: default-domain op names, or
    ``"domain::Op"`` for another domain's op (:func:`rule_key`). ``frozen``: the positions of
    the inputs that never train (:func:`frozen_inputs`)."""

    def deco(fn: Rule) -> Rule:
        for op in op_types:
            RULES[op] = fn
            FROZEN[op] = frozenset(frozen)
        return fn

    return deco


def supported_ops() -> list[str]:
    return sorted(RULES)


def rule_key(node: onnx.NodeProto) -> str:
    """The key of ``node``'s rule in :data:`RULES`: its op type, ``domain::op`` outside ai.onnx."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def has_rule(node: onnx.NodeProto) -> bool:
    """A rule is registered for the op of ``node``."""
    return rule_key(node) in RULES


def frozen_inputs(node: onnx.NodeProto) -> frozenset[int]:
    """Positions of the inputs of ``node`` that never train (its rule's ``frozen``)."""
    return FROZEN.get(rule_key(node), frozenset())


# ------------------------------------------------------------------ ops without a rule
HINTS = {
    "Dropout": "export after model.eval() (inference-mode Dropout is the identity) or build "
               "with mode='train'",
    "BatchNormalization": "export after model.eval() or build with mode='train'",
    "Loop": "control flow is not differentiated; export with static shapes so the exporter "
            "unrolls it",
    "If": "control flow is not differentiated; export in eval mode with static shapes",
    "Scan": "control flow is not differentiated",
}
RECENT_OPSET = 17  # ops added from here on are decomposed by exporters at lower opsets


@cache
def _introduced(op_type: str) -> int | None:
    """The ai.onnx opset that added ``op_type`` (None: not a standard op)."""
    versions = [s.since_version for s in onnx.defs.get_all_schemas_with_history()
                if s.name == op_type and s.domain == ""]
    return min(versions) if versions else None


def hint(op_type: str) -> str | None:
    """What avoids an op without a rule: a mode, or an opset before the op existed."""
    if op_type in HINTS:
        return HINTS[op_type]
    since = _introduced(op_type)
    if since is not None and since >= RECENT_OPSET:
        return (f"ai.onnx added {op_type} in opset {since}; an export with opset_version "
                f"<= {since - 1} avoids it where the exporter decomposes it into older ops")
    return None


@dataclass(frozen=True)
class Missing:
    """One op type without a rule on a gradient path: how many nodes, the first one's name."""

    op_type: str
    count: int
    first: str

    def describe(self) -> str:
        tip = hint(self.op_type)
        return f"{self.op_type} x{self.count} (first: {self.first!r})" + (
            f" — hint: {tip}" if tip else "")


def missing_rules_of(nodes: Iterable[onnx.NodeProto]) -> list[Missing]:
    """``nodes`` grouped by op type (``domain::op`` outside ai.onnx), most frequent first."""
    counts: Counter = Counter()
    first: dict[str, str] = {}
    for node in nodes:
        key = rule_key(node)
        counts[key] += 1
        first.setdefault(key, node.name or node.output[0])
    return [Missing(op, n, first[op]) for op, n in counts.most_common()]


def describe_missing(missing: list[Missing], where: str) -> str:
    """One message for all of ``missing`` (``where``: the path, e.g. "from xs to y")."""
    return (f"{sum(m.count for m in missing)} node(s) on the path {where} have no derivative "
            f"rule: " + "; ".join(m.describe() for m in missing)
            + f" (onnx_training_ops.autodiff.supported_ops() lists the {len(RULES)} ops with "
              "rules)")


@dataclass
class RuleContext:
    """Everything a rule may look at: the node, its output gradients, what is needed."""

    node: onnx.NodeProto
    grads: list[str | None]  # per output: gradient name or None
    needs: list[bool]  # per input: True when its gradient is wanted
    em: Emitter
    constants: Mapping[str, np.ndarray]

    @property
    def opset(self) -> int:
        return self.em.opset

    def input(self, i: int) -> str | None:
        return self.node.input[i] if i < len(self.node.input) and self.node.input[i] else None

    def output(self, i: int) -> str | None:
        return self.node.output[i] if i < len(self.node.output) and self.node.output[i] else None

    def name_output(self, i: int, hint: str) -> str:
        """Output ``i`` of the forward node, given a fresh name if the node leaves it out
        (an optional output the op computes anyway, e.g. LayerNormalization's Mean): the
        rule reads it instead of recomputing it."""
        if self.output(i) is None:
            while len(self.node.output) <= i:
                self.node.output.append("")
            self.node.output[i] = self.em.fresh(hint)
        return self.node.output[i]

    def grad(self, i: int = 0) -> str | None:
        """The gradient of output ``i``, None where it has none (a walk reaches every output apart)."""
        return self.grads[i] if i < len(self.grads) else None

    @property
    def dy(self) -> str:
        """The gradient of output 0, which a rule reads (a RuleError, not a node with a missing
        input, where only another output has a gradient)."""
        g = self.grad(0)
        if g is None:
            raise RuleError(f"output 0 ({self.output(0)!r}) has no gradient; the rule needs it")
        return g

    @property
    def y(self) -> str:
        """Output 0's name (a RuleError where the node leaves it out)."""
        y = self.output(0)
        if y is None:
            raise RuleError("output 0 is left out; the rule reads it")
        return y

    def need(self, i: int) -> bool:
        return i < len(self.needs) and bool(self.needs[i])

    def attr(self, name: str, default=None):
        for a in self.node.attribute:
            if a.name == name:
                v = helper.get_attribute_value(a)
                return v.decode() if isinstance(v, bytes) else v
        return default

    def const_value(self, name: str | None) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer or Constant output, else None."""
        return None if name is None else self.constants.get(name)

    def shape(self, name: str) -> Shape:
        return self.em.shape(name)

    def rank(self, name: str) -> int:
        r = self.em.rank(name)
        if r is None:
            raise RuleError(f"the rank of {name!r} is unknown (shape inference found none)")
        return r

    def unbroadcast(self, g: str, target: str) -> str:
        """Reduce ``g`` (shaped like output 0) to the shape of input ``target``."""
        return self.em.unbroadcast(g, self.em.shape(self.node.output[0]), target)

    def empty(self) -> list[str | None]:
        return [None] * len(self.node.input)
