"""The contract every optimizer description implements (:mod:`.registry` lists them)."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable


@runtime_checkable
class Optimizer(Protocol):
    """An optimizer as the builder sees it: hyper-parameters with torch's names, plus

    * ``op_type``: the ``ai.onnx.preview.training`` op it becomes, or ``""`` when its update is
      written with standard ops (:data:`.registry.STANDARD_OP_UPDATES`);
    * ``states``: the state tensors each parameter gets (Adam's ``("V", "H")``);
    * ``t_offset``: added to the step count T before the op sees it (1: bias correction
      from the first step, as torch);
    * ``attributes()``: the op's attributes (empty for standard-op optimizers);
    * ``initial_value(state)``: what a state tensor starts at;
    * ``decoupled_weight_decay``: ``w`` of the builder's ``X * (1 - R*w)`` before the op (AdamW).
    """

    op_type: ClassVar[str]
    t_offset: ClassVar[int]

    @property
    def lr(self) -> float: ...  # read-only: the descriptions are frozen dataclasses

    @property
    def states(self) -> tuple[str, ...]: ...

    @property
    def decoupled_weight_decay(self) -> float: ...

    def attributes(self) -> dict[str, float | str]: ...

    def initial_value(self, state: str) -> float: ...


class Defaults:
    """What most descriptions share (a base class, not required by :class:`Optimizer`): no
    decoupled decay, states starting at 0, and for standard-op updates no domain op."""

    op_type: ClassVar[str] = ""
    t_offset: ClassVar[int] = 0

    @property
    def decoupled_weight_decay(self) -> float:
        """The weight decay applied before the op as ``X * (1 - R*w)`` (AdamW); 0 here."""
        return 0.0

    def attributes(self) -> dict[str, float | str]:
        """The domain op's attributes; empty when the update is written with standard ops."""
        return {}

    def initial_value(self, state: str) -> float:
        """What the state tensor ``state`` starts at."""
        return 0.0


class Ops(Protocol):
    """Where a standard-op update writes (the builder's ``build.ops.Ops``)."""

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str: ...

    def const(self, value) -> str: ...
