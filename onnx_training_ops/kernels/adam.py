"""Adam (ai.onnx.preview.training, version 1): the reference kernel, as the ONNX pseudo code.

Scalars (R, the bias correction, attributes) are Python floats (float64); tensor math
runs in the tensors' own dtype, so float32 in -> float32 out.
"""

from __future__ import annotations

import math

import numpy as np

from ..schema import OPTIMIZERS
from ._common import interleave, scalar_count, scalar_rate, split_groups

DEFAULTS = OPTIMIZERS["Adam"].defaults  # float32-exact, as a model holds them
NAMES = ("X", "G", "V", "H")


def adam_rate(r: float, t: int, alpha: float, beta: float) -> float:
    """R_adjusted: the learning rate with Adam's bias correction (none when T == 0)."""
    if t > 0:
        return r * math.sqrt(1.0 - beta**t) / (1.0 - alpha**t)
    return r


def adam_update(x, g, v, h, rate, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post):
    """One tensor's Adam step with the adjusted rate; returns (X_new, V_new, H_new)."""
    g_regularized = norm_coefficient * x + g
    v_new = alpha * v + (1.0 - alpha) * g_regularized
    h_new = beta * h + (1.0 - beta) * (g_regularized * g_regularized)
    h_sqrt = np.sqrt(h_new) + epsilon
    x_new = x - rate * (v_new / h_sqrt)
    x_final = (1.0 - norm_coefficient_post) * x_new
    return np.asarray(x_final, x.dtype), np.asarray(v_new, x.dtype), np.asarray(h_new, x.dtype)


def adam(
    r,
    t,
    *tensors,
    alpha: float = DEFAULTS["alpha"],
    beta: float = DEFAULTS["beta"],
    epsilon: float = DEFAULTS["epsilon"],
    norm_coefficient: float = DEFAULTS["norm_coefficient"],
    norm_coefficient_post: float = DEFAULTS["norm_coefficient_post"],
) -> tuple[np.ndarray, ...]:
    """Adam over ``X1..Xn, G1..Gn, V1..Vn, H1..Hn``, in the ONNX pseudo code's operation order.

    Args:
        r: the learning rate R, a float scalar.
        t: the update count T, an int64 scalar (no bias correction when 0).
        *tensors: ``X1..Xn, G1..Gn, V1..Vn, H1..Hn``; G/V/H may broadcast to their X's shape.
        alpha: the first moment's decay.
        beta: the second moment's decay.
        epsilon: added to ``sqrt(H)``.
        norm_coefficient: L2 penalty added to the gradient.
        norm_coefficient_post: ``X <- (1 - c) * X_new`` after the update.

    Returns:
        ``X_new1..n, V_new1..n, H_new1..n``, each in its X's dtype; the inputs are not modified.

    Raises:
        TrainingOpError: R not a float scalar, T not an int64 scalar, a tensor count that does
            not fit, or shapes that do not broadcast to X's.
    """
    rate = adam_rate(scalar_rate(r, "Adam"), scalar_count(t, "Adam"), alpha, beta)
    return interleave(
        [
            adam_update(x, g, v, h, rate, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post)
            for x, g, v, h in split_groups(tensors, NAMES, "Adam")
        ]
    )
