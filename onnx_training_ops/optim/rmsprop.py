"""RMSProp as ``torch.optim.RMSprop`` spells it: the description, the standard-op update, the
scalars and the element of the fused loops.

The training domain has no RMSProp op, so the builder emits the update into the algorithm
graph with ordinary ops (:func:`emit_rmsprop`; that graph, run by onnxruntime, is the
reference the fused loops are tested against); its state tensors (``square_avg``, plus
``momentum_buffer`` with ``momentum > 0`` and ``grad_avg`` with ``centered``) are training
state like Adam's V and H: initializers of the algorithm graph, set by the initialization
graph, bound by ``update_binding``, saved in checkpoints. Per tensor, as torch computes it::

    g = G + weight_decay * X
    square_avg = alpha * square_avg + (1 - alpha) * g * g
    grad_avg = grad_avg + (1 - alpha) * (g - grad_avg)             # centered
    avg = sqrt(square_avg - grad_avg * grad_avg) + eps             # centered, else sqrt(square_avg) + eps
    momentum_buffer = momentum * momentum_buffer + g / avg         # momentum > 0
    X = X - lr * momentum_buffer                                   # else X - lr * (g / avg)

TensorFlow's ``RMSPropOptimizer`` (its API docs) is the same recurrence with eps *inside* the
square root and ``decay`` for alpha; torch's form is the one implemented. TrainingSession's
fast path recognises these ops and runs them as one fused loop
(:mod:`onnx_training_ops.training.fastpath.rmsprop_fast_path`, :func:`rmsprop_element`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from onnx import helper

from ..errors import TrainingOpError
from ._checks import check_bool, check_nonnegative
from ._numba import element
from .base import Defaults

if TYPE_CHECKING:
    from .base import Ops


@dataclass(frozen=True)
class RMSProp(Defaults):
    """``torch.optim.RMSprop``, emitted as standard ONNX ops (the domain has no RMSProp op); defaults from torch.

    Args:
        lr: learning rate.
        alpha: smoothing constant of the squared-gradient average (state ``square_avg``).
        eps: added to the root of the average.
        weight_decay: L2 penalty added to the gradient.
        momentum: momentum factor; > 0 adds the state ``momentum_buffer``.
        centered: subtract the squared mean gradient (state ``grad_avg``).

    Raises:
        TrainingOpError: lr, eps, weight_decay or momentum not a finite number >= 0, alpha outside [0, 1],
            or centered not a bool.
    """

    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    # op_type "": no op of the training domain, standard ops (emit_rmsprop); t_offset 0

    def __post_init__(self):
        check_nonnegative("RMSProp", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
                          momentum=self.momentum)
        if not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
                and 0.0 <= self.alpha <= 1.0):
            raise TrainingOpError(f"RMSProp: alpha must be a number in [0, 1], found {self.alpha!r}")
        check_bool("RMSProp", "centered", self.centered)

    @property
    def states(self) -> tuple[str, ...]:
        return (("square_avg",) + (("momentum_buffer",) if self.momentum > 0 else ())
                + (("grad_avg",) if self.centered else ()))


# ---- the update as standard ops ----


def emit_rmsprop(ops: Ops, opt: RMSProp, r: str, x: str, g: str, states: dict[str, str],
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


def emit_update(ops: Ops, optimizer: RMSProp, r: str, t: str, xs: Sequence[str], gs: Sequence[str],
                states: dict[str, list[str]], new_xs: Sequence[str],
                new_states: dict[str, list[str]], dtypes: Sequence[np.dtype]) -> None:
    """RMSProp on tensors ``xs`` (the builder's standard-op update, :data:`.registry.STANDARD_OP_UPDATES`):
    R cast once per dtype, then :func:`emit_rmsprop` per tensor."""
    casts: dict[np.dtype, str] = {}
    for i, (x, g, dtype) in enumerate(zip(xs, gs, dtypes)):
        if dtype not in casts:  # R in each tensor's dtype
            casts[dtype] = ops.op("Cast", [r], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        emit_rmsprop(ops, optimizer, casts[dtype], x, g, {s: v[i] for s, v in states.items()},
                     new_xs[i], {s: v[i] for s, v in new_states.items()}, np.dtype(dtype))


# ---- the scalars and the element of the fused loops ----


class RMSPropScalars(NamedTuple):
    """What one element's update reads, in this order in the loops' scalar array."""

    rate: float
    weight_decay: float
    alpha: float
    one_minus_alpha: float
    eps: float
    momentum: float


def rmsprop_scalars(rate, opt: RMSProp) -> RMSPropScalars:
    """The element's scalars: ``rate`` (R in the tensors' dtype, as the graph casts it) and ``opt``."""
    return RMSPropScalars(rate, opt.weight_decay, opt.alpha, 1.0 - opt.alpha, opt.eps, opt.momentum)


@element
def load_scalars(s):
    """:class:`RMSPropScalars` from the loops' scalar array (already in the arrays' dtype)."""
    return RMSPropScalars(s[0], s[1], s[2], s[3], s[4], s[5])


@element
def rmsprop_element(xi, gi, sq, b, ga, c, decay, use_momentum, centered):
    """(X_new, square_avg_new, buf_new, grad_avg_new) of one element, in the graph's order."""
    if decay:
        gi = gi + c.weight_decay * xi
    sq = c.alpha * sq + c.one_minus_alpha * (gi * gi)
    avg = sq
    if centered:
        ga = ga + c.one_minus_alpha * (gi - ga)
        avg = sq - ga * ga
    step = gi / (np.sqrt(avg) + c.eps)
    if use_momentum:
        step = c.momentum * b + step
        b = step
    return xi - c.rate * step, sq, b, ga
