"""Adam (ai.onnx.preview.training, version 1) and torch's Adam/AdamW, in every form.

* the reference kernel (:func:`adam`, :func:`adam_update`): the ONNX pseudo code in numpy, the
  oracle every other form is tested against. Scalars (R, the bias correction, attributes) are
  Python floats (float64); tensor math runs in the tensors' own dtype (float32 in, float32 out);
* the scalar preparation (:class:`AdamScalars`, :func:`adam_scalars`, :func:`step_scalars`):
  what the fused and native loops receive, rounded to the arrays' dtype by their caller;
* the element (:func:`adam_element`): one element's update, inlined into the fused (numba) and
  native (cfunc) loops of :mod:`onnx_training_ops.kernels`;
* the descriptions with torch's names (:class:`Adam`, :class:`AdamW`);
* the lowering to standard ONNX ops (:func:`lower`).

Adam's ``eps`` is not torch's: ONNX (like TensorFlow's ``ApplyAdam`` kernel, whose docs give
the "epsilon hat" form) adds epsilon to ``sqrt(H)`` *before* the bias correction,
``X -= R*sqrt(1-beta^T)/(1-alpha^T) * V/(sqrt(H)+eps)``, while torch adds it after,
``X -= R/(1-alpha^T) * V/(sqrt(H)/sqrt(1-beta^T)+eps)``. The two agree exactly when
``eps == 0``. The ONNX op skips the bias correction when T == 0, so the training graph feeds it
T + 1 (``t_offset``) to match torch and TF from the first step on.

``post_weight_decay`` is ONNX's ``norm_coefficient_post``: ``X_final = (1 - c) * X_new`` after
the update, not scaled by the learning rate. torch's ``AdamW(weight_decay=w)`` multiplies by
``1 - lr*w`` *before* the update: :class:`AdamW` does exactly that, with standard ONNX ops in
front of the Adam node (``X * (1 - R*w)``, R the learning-rate input, so schedules scale the
decay as torch does); ``post_weight_decay = lr*w`` only approximates it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from ._checks import check_betas, check_nonnegative
from ._common import float_defaults, interleave, scalar_count, scalar_rate, split_groups
from ._lowering import LoweredTensor, NodeScalars
from ._numba import element, scalar
from .base import Defaults

DEFAULTS = float_defaults("Adam")  # float32-exact, as a model holds them
NAMES = ("X", "G", "V", "H")


# ---- the reference kernel ----


@scalar
def adam_rate(r: float, t: int, alpha: float, beta: float) -> float:
    """R_adjusted: the learning rate with Adam's bias correction (none when T == 0)."""
    if t > 0:
        return r * math.sqrt(1.0 - math.pow(beta, float(t))) / (1.0 - math.pow(alpha, float(t)))
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


# ---- the scalars and the element the fused and native loops compile ----


class AdamScalars(NamedTuple):
    """What one element's update reads, in this order in the loops' scalar array."""

    rate: float  # R_adjusted (adam_rate)
    alpha: float
    one_minus_alpha: float
    beta: float
    one_minus_beta: float
    epsilon: float
    norm_coefficient: float
    one_minus_norm_coefficient_post: float
    decay: float  # AdamW's decoupled decay: X * decay before the update (the *_decay loops only)


RATE = AdamScalars._fields.index("rate")
DECAY = AdamScalars._fields.index("decay")


@scalar
def adam_scalars(rate, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post, decay=1.0) -> AdamScalars:
    """The element's scalars from the adjusted rate and the node's attributes (float64)."""
    return AdamScalars(rate, alpha, 1.0 - alpha, beta, 1.0 - beta, epsilon, norm_coefficient,
                       1.0 - norm_coefficient_post, decay)


@scalar
def step_scalars(r, t, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post) -> AdamScalars:
    """The element's scalars of one step: R, T and the node's attributes, as the reference."""
    return adam_scalars(adam_rate(r, t, alpha, beta), alpha, beta, epsilon, norm_coefficient,
                        norm_coefficient_post)


@element
def load_scalars(s):
    """:class:`AdamScalars` from the loops' scalar array (already in the arrays' dtype)."""
    return AdamScalars(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8])


@element
def adam_element(xi, gi, vi, hi, c):
    """(X_new, V_new, H_new) of one element: the reference kernel's operations in order."""
    g_regularized = c.norm_coefficient * xi + gi
    v_new = c.alpha * vi + c.one_minus_alpha * g_regularized
    h_new = c.beta * hi + c.one_minus_beta * (g_regularized * g_regularized)
    h_sqrt = np.sqrt(h_new) + c.epsilon
    return c.one_minus_norm_coefficient_post * (xi - c.rate * (v_new / h_sqrt)), v_new, h_new


# ---- the descriptions, with torch's names ----


@dataclass(frozen=True)
class Adam(Defaults):
    """Adam as ``torch.optim.Adam`` spells it (defaults from torch); ONNX op ``Adam``.

    ``eps`` is added to ``sqrt(H)`` before the bias correction (TensorFlow's form), see the
    module doc; torch and this op agree exactly when ``eps == 0``.

    Args:
        lr: learning rate (the base rate of the model's learning-rate input).
        betas: ``(beta1, beta2)``, ONNX's ``alpha`` and ``beta``, each in [0, 1).
        eps: ONNX's ``epsilon``, added to ``sqrt(H)``.
        weight_decay: L2 penalty added to the gradient (ONNX's ``norm_coefficient``).
        post_weight_decay: ONNX's ``norm_coefficient_post``, ``X <- (1 - c) * X_new`` after the
            update, not scaled by the learning rate.

    Raises:
        TrainingOpError: a value out of range (negative, not finite, betas not in [0, 1)).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    post_weight_decay: float = 0.0

    op_type: ClassVar[str] = "Adam"
    states: ClassVar[tuple[str, ...]] = ("V", "H")
    t_offset: ClassVar[int] = 1  # the op receives T + 1: bias correction from the first step

    def __post_init__(self):
        betas = check_betas("Adam", self.betas, " (as torch's (0.9, 0.999))")
        check_nonnegative("Adam", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
                          post_weight_decay=self.post_weight_decay)
        object.__setattr__(self, "betas", betas)

    def attributes(self) -> dict[str, float | str]:
        return {
            "alpha": float(self.betas[0]),
            "beta": float(self.betas[1]),
            "epsilon": float(self.eps),
            "norm_coefficient": float(self.weight_decay),
            "norm_coefficient_post": float(self.post_weight_decay),
        }


@dataclass(frozen=True)
class AdamW(Adam):
    """``torch.optim.AdamW``: decoupled weight decay ``X <- X * (1 - lr*weight_decay)`` before the Adam update.

    The decay is emitted as standard ONNX ops before the ``Adam`` node, whose own
    ``norm_coefficient`` stays 0; the learning rate scales it, so schedules do too.

    Args:
        lr: learning rate.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: ONNX's ``epsilon``, added to ``sqrt(H)``.
        weight_decay: decoupled weight decay (default 1e-2, as torch's).
        post_weight_decay: ONNX's ``norm_coefficient_post`` (see :class:`Adam`).

    Raises:
        TrainingOpError: a value out of range.
    """

    weight_decay: float = 1e-2

    @property
    def decoupled_weight_decay(self) -> float:
        return float(self.weight_decay)

    def attributes(self) -> dict[str, float | str]:
        return {**super().attributes(), "norm_coefficient": 0.0}


# ---- the lowering to standard ops ----


def _lower_rate(s: NodeScalars, a: dict) -> str:
    """The float64 rate the tensors share: R, bias-corrected when T > 0 (:func:`adam_rate`)."""
    e = s.e
    t1 = e.op("Max", [s.t, s.f64(1.0, "one")], f"{s.base}/T_at_least_1")  # no 0/0 on the T = 0 branch
    beta_t = e.op("Pow", [s.f64(a["beta"], "beta"), t1], f"{s.base}/beta_pow_T")
    alpha_t = e.op("Pow", [s.f64(a["alpha"], "alpha"), t1], f"{s.base}/alpha_pow_T")
    root = e.op("Sqrt", [e.op("Sub", [s.f64(1.0, "one"), beta_t], f"{s.base}/one_minus_beta_pow_T")],
                f"{s.base}/sqrt_one_minus_beta_pow_T")
    scaled = e.op("Mul", [s.r, root], f"{s.base}/R_sqrt")
    adjusted = e.op("Div", [scaled, e.op("Sub", [s.f64(1.0, "one"), alpha_t], f"{s.base}/one_minus_alpha_pow_T")],
                    f"{s.base}/R_adjusted")
    return e.op("Where", [s.positive(), adjusted, s.r], f"{s.base}/rate")


def lower(s: NodeScalars, a: dict, label: str) -> Callable[[LoweredTensor], list[str]]:
    """Adam's node scalars as standard ops; returns the function writing one tensor's update
    (X_new, V_new, H_new), the reference kernel's operations in order."""
    rate = _lower_rate(s, a)

    def tensor(t: LoweredTensor) -> list[str]:
        g_reg = t.regularized(a["norm_coefficient"])
        rate_x = t.in_dtype(rate, "rate")
        v, h = t.state
        alpha_v = t.op("Mul", [v, t.k(a["alpha"], "alpha")], "alpha_V")
        v_new = t.op("Add", [alpha_v, t.scaled(g_reg, 1.0 - a["alpha"], "one_minus_alpha", "G_scaled")], "V_new")
        g_sq = t.op("Mul", [g_reg, g_reg], "G_squared")
        beta_h = t.op("Mul", [h, t.k(a["beta"], "beta")], "beta_H")
        h_new = t.op("Add", [beta_h, t.scaled(g_sq, 1.0 - a["beta"], "one_minus_beta", "G_squared_scaled")], "H_new")
        h_sqrt = t.op("Add", [t.op("Sqrt", [h_new], "H_sqrt0"), t.k(a["epsilon"], "epsilon")], "H_sqrt")
        step = t.op("Mul", [rate_x, t.op("Div", [v_new, h_sqrt], "V_over_H")], "step")
        x_new = t.op("Sub", [t.x, step], "X_new")
        if a["norm_coefficient_post"] != 0.0:
            x_new = t.scaled(x_new, 1.0 - a["norm_coefficient_post"], "one_minus_norm_coefficient_post", "X_final")
        return [x_new, v_new, h_new]

    return tensor
