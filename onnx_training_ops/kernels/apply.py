"""One optimizer step for one tensor: the fused in-place kernel when it applies, else the reference.

This is the single entry point the onnxruntime plugin and TrainingSession use, so both
run the same math. ``attributes`` are the node's attributes (defaults filled in).

``rows`` (int64 indices, no repeats): the step on those rows of 2-D tables X, V, H in place,
G holding one row per index (the lazy updates of :mod:`onnx_training_ops.builder.sparse_updates`):
the fused row drivers, else gather -> reference -> scatter. Same values either way as the
step on the gathered rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from ..optim._common import check_group, scalar_count, scalar_rate
from ..optim.adagrad import NAMES as ADAGRAD_NAMES
from ..optim.adagrad import adagrad_rate, adagrad_update
from ..optim.adam import NAMES as ADAM_NAMES
from ..optim.adam import adam_rate, adam_update
from ..optim.momentum import NAMES as MOMENTUM_NAMES
from ..optim.momentum import check_mode, momentum_beta, momentum_update

try:  # the fused kernels are an optional accelerator; the reference is always there
    from . import fused as _fused
except ImportError:  # pragma: no cover - exercised only without numba
    _FUSED = False  # and ``_fused`` unbound: every use below checks _FUSED first
else:
    _FUSED = True


def _fusable(*arrays: np.ndarray) -> bool:
    return _FUSED and _fused.supports(*arrays)


def _on_rows(step, r, t, tables, g, attributes, rows):
    """``step`` on ``tables[k][rows]``: fused in place when possible, else gathered and scattered."""
    if _FUSED and _fused.supports_rows(tables, g, rows):
        return None  # the caller runs the fused row driver
    outs = step(r, t, tables[0][rows], g, *(a[rows] for a in tables[1:]), attributes)
    for table, out in zip(tables, outs):
        table[rows] = out
    return tuple(tables)


def _gathered_or_checked(step, r, t, tables, g, attributes, rows, names, op_type: str):
    """Before a step: with ``rows``, the step's result on the gathered rows when the fused row
    drivers do not apply (None when they do); without, None once the group is checked."""
    if rows is not None:
        return _on_rows(step, r, t, tables, g, attributes, rows)
    check_group((tables[0], g, *tables[1:]), names, op_type)
    return None


def adam_step(r, t, x, g, v, h, attributes, inplace: bool = False, rows=None):
    """Adam on one tensor; with ``inplace`` the fused kernel may overwrite x, v, h and return them."""
    done = _gathered_or_checked(adam_step, r, t, (x, v, h), g, attributes, rows, ADAM_NAMES, "Adam")
    if done is not None:
        return done
    a = attributes
    rate = adam_rate(scalar_rate(r, "Adam"), scalar_count(t, "Adam"), a["alpha"], a["beta"])
    if rows is not None:
        _fused.adam_(x, g, v, h, rate, a["alpha"], a["beta"], a["epsilon"], a["norm_coefficient"],
                     a["norm_coefficient_post"], rows=rows)
        return x, v, h
    if inplace and _fusable(x, g, v, h):
        _fused.adam_(x, g, v, h, rate, a["alpha"], a["beta"], a["epsilon"], a["norm_coefficient"],
                     a["norm_coefficient_post"])
        return x, v, h
    return adam_update(
        x, g, v, h, rate, a["alpha"], a["beta"], a["epsilon"], a["norm_coefficient"], a["norm_coefficient_post"]
    )


def momentum_step(r, t, x, g, v, attributes, inplace: bool = False, rows=None):
    """Momentum (standard or nesterov) on one tensor; returns (X_new, V_new)."""
    done = _gathered_or_checked(momentum_step, r, t, (x, v), g, attributes, rows, MOMENTUM_NAMES, "Momentum")
    if done is not None:
        return done
    a = attributes
    nesterov = check_mode(a["mode"])
    rate = scalar_rate(r, "Momentum")
    beta_adjusted = momentum_beta(scalar_count(t, "Momentum"), a["beta"])
    if rows is not None:
        _fused.momentum_(x, g, v, rate, a["alpha"], beta_adjusted, a["norm_coefficient"], nesterov, rows=rows)
        return x, v
    if inplace and _fusable(x, g, v):
        _fused.momentum_(x, g, v, rate, a["alpha"], beta_adjusted, a["norm_coefficient"], nesterov)
        return x, v
    return momentum_update(x, g, v, rate, a["alpha"], beta_adjusted, a["norm_coefficient"], nesterov)


def adagrad_step(r, t, x, g, h, attributes, inplace: bool = False, rows=None):
    """Adagrad on one tensor; returns (X_new, H_new)."""
    done = _gathered_or_checked(adagrad_step, r, t, (x, h), g, attributes, rows, ADAGRAD_NAMES, "Adagrad")
    if done is not None:
        return done
    a = attributes
    rate = adagrad_rate(scalar_rate(r, "Adagrad"), scalar_count(t, "Adagrad"), a["decay_factor"])
    if rows is not None:
        _fused.adagrad_(x, g, h, rate, a["epsilon"], a["norm_coefficient"], rows=rows)
        return x, h
    if inplace and _fusable(x, g, h):
        _fused.adagrad_(x, g, h, rate, a["epsilon"], a["norm_coefficient"])
        return x, h
    return adagrad_update(x, g, h, rate, a["epsilon"], a["norm_coefficient"])


# op type -> ``step(r, t, *tensors, attributes, inplace=False, rows=None)``: the updated tensors
STEPS: dict[str, Callable[..., tuple[np.ndarray, ...]]] = {
    "Adam": adam_step, "Momentum": momentum_step, "Adagrad": adagrad_step}


def prepare(op_type: str, r: object, t: object, tensors: Sequence[object], attributes: Mapping[str, Any],
            decay: object = None) -> Callable[[], None] | None:
    """``STEPS[op_type](r, t, *tensors, attributes, inplace=True)`` for arrays that stay the
    same objects from call to call (the fast path's buffers): every check runs once, here,
    and the returned ``run()`` reads R and T and calls the fused kernel. None when the fused
    kernels do not apply (the caller keeps the checked per-call path). ``decay`` (Adam only:
    None otherwise): a 0-d array of X's dtype, ``X *= decay`` first, in the kernel's pass."""
    if not _FUSED or type(r) is not np.ndarray or type(t) is not np.ndarray or not _plain_arrays(tensors):
        return None
    if decay is not None and (op_type != "Adam" or type(decay) is not np.ndarray or decay.size != 1
                              or decay.dtype != tensors[0].dtype):
        return None
    names = {"Adam": ADAM_NAMES, "Momentum": MOMENTUM_NAMES, "Adagrad": ADAGRAD_NAMES}[op_type]
    check_group(tensors, names, op_type)
    scalar_rate(r, op_type), scalar_count(t, op_type)  # dtype and shape: fixed from now on
    if not _fused.supports(*tensors):
        return None
    r0, t0, a = r.reshape(()), t.reshape(()), attributes
    if op_type == "Adam":
        x, g, v, h = tensors
        alpha, beta = a["alpha"], a["beta"]
        adam = _fused.adam_prepared(x, g, v, h, alpha, beta, a["epsilon"], a["norm_coefficient"],
                                    a["norm_coefficient_post"], decay)
        return lambda: adam(adam_rate(float(r0), int(t0), alpha, beta))
    if op_type == "Momentum":
        x, g, v = tensors
        beta = a["beta"]
        momentum = _fused.momentum_prepared(x, g, v, a["alpha"], a["norm_coefficient"], check_mode(a["mode"]))
        return lambda: momentum(float(r0), momentum_beta(int(t0), beta))
    x, g, h = tensors
    decay_factor = a["decay_factor"]
    adagrad = _fused.adagrad_prepared(x, g, h, a["epsilon"], a["norm_coefficient"])
    return lambda: adagrad(adagrad_rate(float(r0), int(t0), decay_factor))


def _plain_arrays(values: Sequence[object]) -> TypeGuard[Sequence[np.ndarray]]:
    """Every value a numpy array itself (no subclass, no OrtValue): buffers the fast path keeps."""
    return all(type(v) is np.ndarray for v in values)


def rmsprop_step(r, x, g, states: dict, optimizer, rows=None) -> bool:
    """RMSProp (standard ops in the graph, :mod:`onnx_training_ops.optim.rmsprop`) in place with the
    fused kernel, on the ``rows`` of 2-D tables if given; False (nothing done) when it does not apply."""
    if rows is None and not _fusable(x, g, *states.values()):
        return False
    if rows is not None and (not _FUSED or not _fused.supports_rows([x, *states.values()], g, rows)):
        return False
    _fused.rmsprop_(x, g, states, np.asarray(r, x.dtype).reshape(()), optimizer, rows=rows)
    return True


def fused_available() -> bool:
    return _FUSED
