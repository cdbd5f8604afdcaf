"""The derivative-rule registry and the context a rule receives.

A rule maps the gradients of a node's outputs to the gradients of its inputs:

    @register("Exp")
    def _exp(ctx: RuleContext) -> list[str | None]:
        return [ctx.em.op("Mul", [ctx.grad(0), ctx.output(0)])]

It returns one entry per node input (``None`` where no gradient is needed or exists) and
emits its nodes through ``ctx.em``. Rules raise :class:`RuleError` for a configuration they
do not handle; the walk turns it into a :class:`~onnx_training_ops.errors.TrainingOpError`
naming the Gradient node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import onnx
from onnx import helper

from .emitter import Emitter, Shape

Rule = Callable[["RuleContext"], list]
RULES: dict[str, Rule] = {}


class RuleError(Exception):
    """A rule cannot differentiate this node (unsupported attribute, opset, unknown rank...)."""


def register(*op_types: str) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the derivative rule of default-domain ``op_types``."""

    def deco(fn: Rule) -> Rule:
        for op in op_types:
            RULES[op] = fn
        return fn

    return deco


def supported_ops() -> list[str]:
    return sorted(RULES)


@dataclass
class RuleContext:
    """Everything a rule may look at: the node, its output gradients, what is needed."""

    node: onnx.NodeProto
    grads: list  # per output: gradient name or None
    needs: list  # per input: True when its gradient is wanted
    em: Emitter
    constants: Mapping[str, np.ndarray]

    @property
    def opset(self) -> int:
        return self.em.opset

    def input(self, i: int) -> str | None:
        return self.node.input[i] if i < len(self.node.input) and self.node.input[i] else None

    def output(self, i: int) -> str | None:
        return self.node.output[i] if i < len(self.node.output) and self.node.output[i] else None

    def grad(self, i: int = 0) -> str | None:
        return self.grads[i] if i < len(self.grads) else None

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

    def empty(self) -> list:
        return [None] * len(self.node.input)
