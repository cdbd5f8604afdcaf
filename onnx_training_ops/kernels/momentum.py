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
    """Momentum over ``X1..Xn, G1..Gn, V1..Vn``; returns ``X_new.., V_new..``.

    The schema makes all four attributes required, so they have no defaults here.
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
