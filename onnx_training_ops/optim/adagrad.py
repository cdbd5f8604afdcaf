"""Adagrad (ai.onnx.preview.training, version 1) and torch's Adagrad, in every form.

The forms, as :mod:`.adam` lays them out: the reference kernel (:func:`adagrad`), the scalars
(:class:`AdagradScalars`), the element (:func:`adagrad_element`), the description with torch's
names (:class:`Adagrad`) and the lowering to standard ops (:func:`lower`).

torch ``Adagrad(lr, lr_decay, eps, weight_decay, initial_accumulator_value)`` is
``Adagrad(decay_factor=lr_decay, epsilon=eps, norm_coefficient=weight_decay)`` with H starting
at ``initial_accumulator_value`` and the op receiving T = step-1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from ._checks import check_nonnegative
from ._common import float_defaults, interleave, scalar_count, scalar_rate, split_groups
from ._lowering import LoweredTensor, NodeScalars
from ._numba import element, scalar
from .base import Defaults

DEFAULTS = float_defaults("Adagrad")  # float32-exact, as a model holds them
NAMES = ("X", "G", "H")


# ---- the reference kernel ----


@scalar
def adagrad_rate(r: float, t: int, decay_factor: float) -> float:
    """The decayed learning rate R / (1 + T * decay_factor)."""
    return r / (1.0 + t * decay_factor)


def adagrad_update(x, g, h, rate, epsilon, norm_coefficient):
    """One tensor's Adagrad step with the decayed rate; returns (X_new, H_new)."""
    g_regularized = norm_coefficient * x + g
    h_new = h + g_regularized * g_regularized
    h_sqrt = np.sqrt(h_new) + epsilon
    x_new = x - rate * g_regularized / h_sqrt
    return np.asarray(x_new, x.dtype), np.asarray(h_new, x.dtype)


def adagrad(
    r,
    t,
    *tensors,
    decay_factor: float = DEFAULTS["decay_factor"],
    epsilon: float = DEFAULTS["epsilon"],
    norm_coefficient: float = DEFAULTS["norm_coefficient"],
) -> tuple[np.ndarray, ...]:
    """Adagrad over ``X1..Xn, G1..Gn, H1..Hn``, in the ONNX pseudo code's operation order.

    Args:
        r: the learning rate R, a float scalar.
        t: the update count T, an int64 scalar.
        *tensors: ``X1..Xn, G1..Gn, H1..Hn``; G/H may broadcast to their X's shape.
        decay_factor: the rate is ``R / (1 + T * decay_factor)``.
        epsilon: added to ``sqrt(H)``.
        norm_coefficient: L2 penalty added to the gradient.

    Returns:
        ``X_new1..n, H_new1..n``, each in its X's dtype; the inputs are not modified.

    Raises:
        TrainingOpError: R not a float scalar, T not an int64 scalar, a tensor count that does
            not fit, or shapes that do not broadcast to X's.
    """
    rate = adagrad_rate(scalar_rate(r, "Adagrad"), scalar_count(t, "Adagrad"), decay_factor)
    return interleave(
        [
            adagrad_update(x, g, h, rate, epsilon, norm_coefficient)
            for x, g, h in split_groups(tensors, NAMES, "Adagrad")
        ]
    )


# ---- the scalars and the element the fused and native loops compile ----


class AdagradScalars(NamedTuple):
    """What one element's update reads, in this order in the loops' scalar array."""

    rate: float  # the decayed rate (adagrad_rate)
    epsilon: float
    norm_coefficient: float


RATE = AdagradScalars._fields.index("rate")


@scalar
def step_scalars(r, t, decay_factor, epsilon, norm_coefficient) -> AdagradScalars:
    """The element's scalars of one step: R, T and the node's attributes, as the reference."""
    return AdagradScalars(adagrad_rate(r, t, decay_factor), epsilon, norm_coefficient)


@element
def load_scalars(s):
    """:class:`AdagradScalars` from the loops' scalar array (already in the arrays' dtype)."""
    return AdagradScalars(s[0], s[1], s[2])


@element
def adagrad_element(xi, gi, hi, c):
    """(X_new, H_new) of one element: the reference kernel's operations in order."""
    g_regularized = c.norm_coefficient * xi + gi
    h_new = hi + g_regularized * g_regularized
    h_sqrt = np.sqrt(h_new) + c.epsilon
    return xi - c.rate * g_regularized / h_sqrt, h_new


# ---- the description, with torch's names ----


@dataclass(frozen=True)
class Adagrad(Defaults):
    """Adagrad as ``torch.optim.Adagrad`` spells it (defaults from torch); ONNX op ``Adagrad``.

    Args:
        lr: learning rate.
        lr_decay: ONNX's ``decay_factor``.
        eps: ONNX's ``epsilon``.
        weight_decay: L2 penalty added to the gradient (ONNX's ``norm_coefficient``).
        initial_accumulator_value: the initial value of the state H.

    Raises:
        TrainingOpError: a field that is not a finite number >= 0.
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    op_type: ClassVar[str] = "Adagrad"
    states: ClassVar[tuple[str, ...]] = ("H",)
    t_offset: ClassVar[int] = 0

    def __post_init__(self):
        check_nonnegative("Adagrad", lr=self.lr, lr_decay=self.lr_decay, eps=self.eps,
                          weight_decay=self.weight_decay, initial_accumulator_value=self.initial_accumulator_value)

    def attributes(self) -> dict[str, float | str]:
        return {
            "decay_factor": float(self.lr_decay),
            "epsilon": float(self.eps),
            "norm_coefficient": float(self.weight_decay),
        }

    def initial_value(self, state: str) -> float:
        return float(self.initial_accumulator_value)


# ---- the lowering to standard ops ----


def _lower_rate(s: NodeScalars, a: dict) -> str:
    """The float64 rate the tensors share (:func:`adagrad_rate`)."""
    if a["decay_factor"] == 0.0:
        return s.r  # R / (1 + T*0) == R exactly
    e = s.e
    decayed = e.op("Mul", [s.t, s.f64(a["decay_factor"], "decay_factor")], f"{s.base}/T_decay")
    return e.op("Div", [s.r, e.op("Add", [s.f64(1.0, "one"), decayed], f"{s.base}/one_plus_T_decay")],
                f"{s.base}/rate")


def lower(s: NodeScalars, a: dict, label: str) -> Callable[[LoweredTensor], list[str]]:
    """Adagrad's node scalars as standard ops; returns the function writing one tensor's
    update (X_new, H_new), the reference kernel's operations in order."""
    rate = _lower_rate(s, a)

    def tensor(t: LoweredTensor) -> list[str]:
        g_reg = t.regularized(a["norm_coefficient"])
        rate_x = t.in_dtype(rate, "rate")
        (h,) = t.state
        h_new = t.op("Add", [h, t.op("Mul", [g_reg, g_reg], "G_squared")], "H_new")
        h_sqrt = t.op("Add", [t.op("Sqrt", [h_new], "H_sqrt0"), t.k(a["epsilon"], "epsilon")], "H_sqrt")
        scaled = t.op("Mul", [rate_x, g_reg], "R_G")
        x_new = t.op("Sub", [t.x, t.op("Div", [scaled, h_sqrt], "step")], "X_new")
        return [x_new, h_new]

    return tensor
