"""Momentum (ai.onnx.preview.training, version 1), standard and Nesterov, and torch's SGD.

The forms, as :mod:`.adam` lays them out: the reference kernel (:func:`momentum`), the scalars
(:class:`MomentumScalars`), the elements (:func:`momentum_element`, :func:`nesterov_element`),
the description with torch's names (:class:`Momentum`: ``torch.optim.SGD``) and the lowering
to standard ops (:func:`lower`).

torch ``SGD(lr, momentum, dampening, nesterov, weight_decay)`` is ``Momentum(alpha=momentum,
beta=1-dampening, mode="nesterov"|"standard", norm_coefficient=weight_decay)`` with V starting
at 0 and the op receiving T = step-1 (0 on the first step: torch's "buf = grad" first step is
ONNX's ``beta_adjusted = 1`` at T = 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from ..errors import TrainingOpError
from ._checks import check_bool, check_finite, check_nonnegative
from ._common import interleave, scalar_count, scalar_rate, split_groups
from ._lowering import LoweredTensor, NodeScalars
from ._numba import element, scalar
from .base import Defaults

NAMES = ("X", "G", "V")
MODES = ("standard", "nesterov")


# ---- the reference kernel ----


@scalar
def momentum_beta(t: int, beta: float) -> float:
    """The gradient's coefficient: 1 on the first step (T == 0), beta after."""
    return beta if t > 0 else 1.0


def momentum_update(x, g, v, rate, alpha, beta_adjusted, norm_coefficient, nesterov: bool):
    """One tensor's momentum step; returns (X_new, V_new)."""
    g_regularized = norm_coefficient * x + g
    v_new = alpha * v + beta_adjusted * g_regularized
    if nesterov:
        x_new = x - rate * (g_regularized + alpha * v_new)
    else:
        x_new = x - rate * v_new
    return np.asarray(x_new, x.dtype), np.asarray(v_new, x.dtype)


def check_mode(mode) -> bool:
    """True for Nesterov; raises TrainingOpError for anything but 'standard'/'nesterov'."""
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode not in MODES:
        raise TrainingOpError(f"Momentum: attribute 'mode' must be 'standard' or 'nesterov', found {mode!r}")
    return mode == "nesterov"


def momentum(
    r, t, *tensors, alpha: float, beta: float, mode: str, norm_coefficient: float
) -> tuple[np.ndarray, ...]:
    """Momentum over ``X1..Xn, G1..Gn, V1..Vn``, in the ONNX pseudo code's operation order.

    The schema makes all four attributes required, so they have no defaults here.

    Args:
        r: the learning rate R, a float scalar.
        t: the update count T, an int64 scalar (the gradient's coefficient is 1 when 0).
        *tensors: ``X1..Xn, G1..Gn, V1..Vn``; G/V may broadcast to their X's shape.
        alpha: the momentum's decay.
        beta: the gradient's coefficient from T = 1 on.
        mode: ``"standard"`` or ``"nesterov"``.
        norm_coefficient: L2 penalty added to the gradient.

    Returns:
        ``X_new1..n, V_new1..n``, each in its X's dtype; the inputs are not modified.

    Raises:
        TrainingOpError: R not a float scalar, T not an int64 scalar, a tensor count that does
            not fit, shapes that do not broadcast to X's,
            or another mode.
    """
    nesterov = check_mode(mode)
    rate = scalar_rate(r, "Momentum")
    beta_adjusted = momentum_beta(scalar_count(t, "Momentum"), beta)
    return interleave(
        [
            momentum_update(x, g, v, rate, alpha, beta_adjusted, norm_coefficient, nesterov)
            for x, g, v in split_groups(tensors, NAMES, "Momentum")
        ]
    )


# ---- the scalars and the elements the fused and native loops compile ----


class MomentumScalars(NamedTuple):
    """What one element's update reads, in this order in the loops' scalar array."""

    rate: float  # R
    alpha: float
    beta_adjusted: float  # momentum_beta
    norm_coefficient: float


RATE = MomentumScalars._fields.index("rate")
BETA_ADJUSTED = MomentumScalars._fields.index("beta_adjusted")


@scalar
def step_scalars(r, t, alpha, beta, norm_coefficient) -> MomentumScalars:
    """The element's scalars of one step: R, T and the node's attributes, as the reference."""
    return MomentumScalars(r, alpha, momentum_beta(t, beta), norm_coefficient)


@element
def load_scalars(s):
    """:class:`MomentumScalars` from the loops' scalar array (already in the arrays' dtype)."""
    return MomentumScalars(s[0], s[1], s[2], s[3])


@element
def momentum_element(xi, gi, vi, c):
    """(X_new, V_new) of one element, standard mode."""
    g_regularized = c.norm_coefficient * xi + gi
    v_new = c.alpha * vi + c.beta_adjusted * g_regularized
    return xi - c.rate * v_new, v_new


@element
def nesterov_element(xi, gi, vi, c):
    """(X_new, V_new) of one element, Nesterov mode."""
    g_regularized = c.norm_coefficient * xi + gi
    v_new = c.alpha * vi + c.beta_adjusted * g_regularized
    return xi - c.rate * (g_regularized + c.alpha * v_new), v_new


# ---- the description, with torch's names ----


@dataclass(frozen=True)
class Momentum(Defaults):
    """SGD with momentum as ``torch.optim.SGD`` spells it; ONNX op ``Momentum``.

    ``momentum=0`` is plain SGD.

    Args:
        lr: learning rate.
        momentum: ONNX's ``alpha``.
        dampening: ``1 - dampening`` is ONNX's ``beta``.
        nesterov: ONNX's ``mode``: ``"nesterov"`` if True, else ``"standard"``.
        weight_decay: L2 penalty added to the gradient (ONNX's ``norm_coefficient``).

    Raises:
        TrainingOpError: a value out of range.
    """

    lr: float = 1e-2
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    op_type: ClassVar[str] = "Momentum"
    states: ClassVar[tuple[str, ...]] = ("V",)
    t_offset: ClassVar[int] = 0

    def __post_init__(self):
        check_nonnegative("Momentum", lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        check_finite("Momentum", dampening=self.dampening)
        check_bool("Momentum", "nesterov", self.nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise TrainingOpError("Momentum: nesterov requires momentum > 0 and dampening == 0 (as in torch)")

    def attributes(self) -> dict[str, float | str]:
        return {
            "alpha": float(self.momentum),
            "beta": float(1.0 - self.dampening),
            "mode": "nesterov" if self.nesterov else "standard",
            "norm_coefficient": float(self.weight_decay),
        }


# ---- the lowering to standard ops ----


def lower(s: NodeScalars, a: dict, label: str) -> Callable[[LoweredTensor], list[str]]:
    """Momentum's node scalars as standard ops; returns the function writing one tensor's
    update (X_new, V_new), the reference kernel's operations in order."""
    try:
        nesterov = check_mode(a["mode"])
    except TrainingOpError as error:
        raise TrainingOpError(f"{label}: {str(error).removeprefix('Momentum: ')}") from None
    one_or_beta = s.e.op("Where", [s.positive(), s.f64(a["beta"], "beta"), s.f64(1.0, "one")],
                         f"{s.base}/beta_adjusted")

    def tensor(t: LoweredTensor) -> list[str]:
        g_reg = t.regularized(a["norm_coefficient"])
        rate_x = t.in_dtype(s.r, "rate")
        (v,) = t.state
        beta_x = t.in_dtype(one_or_beta, "beta")
        alpha_v = t.op("Mul", [v, t.k(a["alpha"], "alpha")], "alpha_V")
        v_new = t.op("Add", [alpha_v, t.op("Mul", [g_reg, beta_x], "beta_G")], "V_new")
        if nesterov:
            alpha_v_new = t.op("Mul", [v_new, t.k(a["alpha"], "alpha")], "alpha_V_new")
            ahead = t.op("Add", [g_reg, alpha_v_new], "G_ahead")
            x_new = t.op("Sub", [t.x, t.op("Mul", [rate_x, ahead], "step")], "X_new")
        else:
            x_new = t.op("Sub", [t.x, t.op("Mul", [rate_x, v_new], "step")], "X_new")
        return [x_new, v_new]

    return tensor
