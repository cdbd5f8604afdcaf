"""RMSProp as ``torch.optim.RMSprop`` spells it, built from standard ONNX ops.

The training domain has no RMSProp op, so the builder emits the update into the algorithm
graph with ordinary ops (:func:`emit_rmsprop`); its state tensors (``square_avg``, plus
``momentum_buffer`` with ``momentum > 0`` and ``grad_avg`` with ``centered``) are training
state like Adam's V and H: initializers of the algorithm graph, set by the initialization
graph, bound by ``update_binding``, saved in checkpoints. Per tensor, as torch computes it::

    g = G + weight_decay * X
    square_avg = alpha * square_avg + (1 - alpha) * g * g
    grad_avg = grad_avg + (1 - alpha) * (g - grad_avg)             # centered
    avg = sqrt(square_avg - grad_avg * grad_avg) + eps             # centered, else sqrt(square_avg) + eps
    momentum_buffer = momentum * momentum_buffer + g / avg         # momentum > 0
    X = X - lr * momentum_buffer                                   # else X - lr * (g / avg)

TensorFlow's ``RMSPropOptimizer`` (seed 004) is the same recurrence with eps *inside* the
square root and ``decay`` for alpha; torch's form is the one implemented. TrainingSession's
fast path recognises these ops and runs them as one fused loop
(:mod:`.training.rmsprop_fast_path`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import TrainingOpError
from .optimizers import OPTIMIZER_CLASSES, _check_nonnegative

if TYPE_CHECKING:
    from .ops import Ops


@dataclass(frozen=True)
class RMSProp:
    """``torch.optim.RMSprop``, emitted as standard ONNX ops (the domain has no RMSProp op); defaults from torch.

    Args:
        lr: learning rate.
        alpha: smoothing constant of the squared-gradient average (state ``square_avg``).
        eps: added to the root of the average.
        weight_decay: L2 penalty added to the gradient.
        momentum: momentum factor; > 0 adds the state ``momentum_buffer``.
        centered: subtract the squared mean gradient (state ``grad_avg``).

    Raises:
        TrainingOpError: a value out of range.
    """

    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    op_type: ClassVar[str] = ""  # no op of the training domain: standard ops (emit_rmsprop)
    t_offset: ClassVar[int] = 0

    def __post_init__(self):
        _check_nonnegative("RMSProp", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
                           momentum=self.momentum)
        if not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
                and 0.0 <= self.alpha <= 1.0):
            raise TrainingOpError(f"RMSProp: alpha must be a number in [0, 1], found {self.alpha!r}")
        if not isinstance(self.centered, (bool, np.bool_)):
            raise TrainingOpError(f"RMSProp: centered must be True or False, found {self.centered!r}")

    @property
    def states(self) -> tuple[str, ...]:
        return (("square_avg",) + (("momentum_buffer",) if self.momentum > 0 else ())
                + (("grad_avg",) if self.centered else ()))

    def initial_value(self, state: str) -> float:
        return 0.0


def emit_rmsprop(ops: "Ops", opt: RMSProp, r: str, x: str, g: str, states: dict[str, str],
                 x_out: str, state_outs: dict[str, str], dtype: np.dtype) -> None:
    """One tensor's RMSProp step as standard ops: reads ``x``, ``g``, ``states`` (state name ->
    value), writes ``x_out`` and ``state_outs``. ``r`` is the learning rate in ``dtype``."""
    def c(value: float) -> str:
        return ops.const(np.array(value, dtype))

    if opt.weight_decay:
        g = ops.op("Add", [g, ops.op("Mul", [c(opt.weight_decay), x])])
    g2 = ops.op("Mul", [g, g])
    ops.op("Add", [ops.op("Mul", [c(opt.alpha), states["square_avg"]]),
                   ops.op("Mul", [c(1.0 - opt.alpha), g2])], out=state_outs["square_avg"])
    square_avg = state_outs["square_avg"]
    if opt.centered:
        grad_avg = states["grad_avg"]
        ops.op("Add", [grad_avg, ops.op("Mul", [c(1.0 - opt.alpha), ops.op("Sub", [g, grad_avg])])],
               out=state_outs["grad_avg"])
        new_avg = state_outs["grad_avg"]
        square_avg = ops.op("Sub", [square_avg, ops.op("Mul", [new_avg, new_avg])])
    avg = ops.op("Add", [ops.op("Sqrt", [square_avg]), c(opt.eps)])
    step = ops.op("Div", [g, avg])
    if opt.momentum > 0:
        ops.op("Add", [ops.op("Mul", [c(opt.momentum), states["momentum_buffer"]]), step],
               out=state_outs["momentum_buffer"])
        step = state_outs["momentum_buffer"]
    ops.op("Sub", [x, ops.op("Mul", [r, step])], out=x_out)


OPTIMIZER_CLASSES.setdefault("RMSProp", RMSProp)  # from_json reads it back
