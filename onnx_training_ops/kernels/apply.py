"""One optimizer step for one tensor: the fused in-place kernel when it applies, else the reference.

This is the single entry point the onnxruntime plugin and TrainingSession use, so both
run the same math. ``attributes`` are the node's attributes (defaults filled in).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ._common import check_group, scalar_count, scalar_rate
from .adagrad import NAMES as ADAGRAD_NAMES
from .adagrad import adagrad_rate, adagrad_update
from .adam import NAMES as ADAM_NAMES
from .adam import adam_rate, adam_update
from .momentum import NAMES as MOMENTUM_NAMES
from .momentum import check_mode, momentum_beta, momentum_update

try:  # the fused kernels are an optional accelerator; the reference is always there
    from . import fused as _fused
except ImportError:  # pragma: no cover - exercised only without numba
    _fused = None


def _fusable(*arrays: np.ndarray) -> bool:
    return _fused is not None and _fused.supports(*arrays)


def adam_step(r, t, x, g, v, h, attributes, inplace: bool = False):
    """Adam on one tensor; with ``inplace`` the fused kernel may overwrite x, v, h and return them."""
    check_group((x, g, v, h), ADAM_NAMES, "Adam")
    a = attributes
    rate = adam_rate(scalar_rate(r, "Adam"), scalar_count(t, "Adam"), a["alpha"], a["beta"])
    if inplace and _fusable(x, g, v, h):
        _fused.adam_(x, g, v, h, rate, a["alpha"], a["beta"], a["epsilon"], a["norm_coefficient"], a["norm_coefficient_post"])
        return x, v, h
    return adam_update(
        x, g, v, h, rate, a["alpha"], a["beta"], a["epsilon"], a["norm_coefficient"], a["norm_coefficient_post"]
    )


def momentum_step(r, t, x, g, v, attributes, inplace: bool = False):
    """Momentum (standard or nesterov) on one tensor; returns (X_new, V_new)."""
    check_group((x, g, v), MOMENTUM_NAMES, "Momentum")
    a = attributes
    nesterov = check_mode(a["mode"])
    rate = scalar_rate(r, "Momentum")
    beta_adjusted = momentum_beta(scalar_count(t, "Momentum"), a["beta"])
    if inplace and _fusable(x, g, v):
        _fused.momentum_(x, g, v, rate, a["alpha"], beta_adjusted, a["norm_coefficient"], nesterov)
        return x, v
    return momentum_update(x, g, v, rate, a["alpha"], beta_adjusted, a["norm_coefficient"], nesterov)


def adagrad_step(r, t, x, g, h, attributes, inplace: bool = False):
    """Adagrad on one tensor; returns (X_new, H_new)."""
    check_group((x, g, h), ADAGRAD_NAMES, "Adagrad")
    a = attributes
    rate = adagrad_rate(scalar_rate(r, "Adagrad"), scalar_count(t, "Adagrad"), a["decay_factor"])
    if inplace and _fusable(x, g, h):
        _fused.adagrad_(x, g, h, rate, a["epsilon"], a["norm_coefficient"])
        return x, h
    return adagrad_update(x, g, h, rate, a["epsilon"], a["norm_coefficient"])


STEPS = {"Adam": adam_step, "Momentum": momentum_step, "Adagrad": adagrad_step}


def prepare(op_type: str, r, t, tensors, attributes) -> Callable[[], None] | None:
    """``STEPS[op_type](r, t, *tensors, attributes, inplace=True)`` for arrays that stay the
    same objects from call to call (the fast path's buffers): every check runs once, here,
    and the returned ``run()`` reads R and T and calls the fused kernel. None when the fused
    kernels do not apply (the caller keeps the checked per-call path)."""
    arrays = (r, t, *tensors)
    if _fused is None or not all(type(a) is np.ndarray for a in arrays):
        return None
    names = {"Adam": ADAM_NAMES, "Momentum": MOMENTUM_NAMES, "Adagrad": ADAGRAD_NAMES}[op_type]
    check_group(tensors, names, op_type)
    scalar_rate(r, op_type), scalar_count(t, op_type)  # dtype and shape: fixed from now on
    if not _fused.supports(*tensors):
        return None
    r0, t0, a = r.reshape(()), t.reshape(()), attributes
    if op_type == "Adam":
        alpha, beta = a["alpha"], a["beta"]
        adam = _fused.adam_prepared(*tensors, alpha, beta, a["epsilon"], a["norm_coefficient"],
                                    a["norm_coefficient_post"])
        return lambda: adam(adam_rate(float(r0), int(t0), alpha, beta))
    if op_type == "Momentum":
        beta = a["beta"]
        momentum = _fused.momentum_prepared(*tensors, a["alpha"], a["norm_coefficient"], check_mode(a["mode"]))
        return lambda: momentum(float(r0), momentum_beta(int(t0), beta))
    decay = a["decay_factor"]
    adagrad = _fused.adagrad_prepared(*tensors, a["epsilon"], a["norm_coefficient"])
    return lambda: adagrad(adagrad_rate(float(r0), int(t0), decay))
