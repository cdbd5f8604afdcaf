"""Adagrad (ai.onnx.preview.training, version 1): the reference kernel."""

from __future__ import annotations

import numpy as np

from ..schema import OPTIMIZERS
from ._common import interleave, scalar_count, scalar_rate, split_groups

DEFAULTS = OPTIMIZERS["Adagrad"].defaults  # float32-exact, as a model holds them
NAMES = ("X", "G", "H")


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
