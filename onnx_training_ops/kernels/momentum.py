"""Momentum (ai.onnx.preview.training, version 1), standard and Nesterov: the reference kernel."""

from __future__ import annotations

import numpy as np

from ..errors import TrainingOpError
from ._common import interleave, scalar_count, scalar_rate, split_groups

NAMES = ("X", "G", "V")
MODES = ("standard", "nesterov")


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
