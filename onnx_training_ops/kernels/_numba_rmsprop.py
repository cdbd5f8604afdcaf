"""Numba loops of RMSProp (torch's form), one pass in place, operation by operation as
:func:`onnx_training_ops.build.rmsprop.emit_rmsprop` writes the update in ONNX ops (same rounding:
every scalar arrives in ``s`` already in the arrays' dtype; ``fastmath=False``).

Scalars ``s``: rate, weight_decay, alpha, 1-alpha, eps, momentum. ``buf``/``grad_avg`` are
read only when ``use_momentum``/``centered`` (pass any 1-element array otherwise).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numba_kernels import _jit


@njit(inline="always", fastmath=False, error_model="numpy", boundscheck=False)
def _element(xi, gi, sq, b, ga, c, decay, use_momentum, centered):
    """(X_new, square_avg_new, buf_new, grad_avg_new) of one element, in the graph's order."""
    rate, weight_decay, alpha, one_minus_alpha, eps, momentum = c
    if decay:
        gi = gi + weight_decay * xi
    sq = alpha * sq + one_minus_alpha * (gi * gi)
    avg = sq
    if centered:
        ga = ga + one_minus_alpha * (gi - ga)
        avg = sq - ga * ga
    step = gi / (np.sqrt(avg) + eps)
    if use_momentum:
        step = momentum * b + step
        b = step
    return xi - rate * step, sq, b, ga


@_jit(parallel=False)
def rmsprop_serial(x, g, square_avg, buf, grad_avg, s, decay, use_momentum, centered):
    c = (s[0], s[1], s[2], s[3], s[4], s[5])
    mb, cg = (1 if use_momentum else 0), (1 if centered else 0)  # unused states: read element 0
    for i in range(x.size):
        x[i], square_avg[i], b, ga = _element(x[i], g[i], square_avg[i], buf[i * mb],
                                              grad_avg[i * cg], c, decay, use_momentum, centered)
        if use_momentum:
            buf[i] = b
        if centered:
            grad_avg[i] = ga


@_jit(parallel=True)
def rmsprop_parallel(x, g, square_avg, buf, grad_avg, s, decay, use_momentum, centered):
    c = (s[0], s[1], s[2], s[3], s[4], s[5])
    mb, cg = (1 if use_momentum else 0), (1 if centered else 0)  # unused states: read element 0
    for i in prange(x.size):
        x[i], square_avg[i], b, ga = _element(x[i], g[i], square_avg[i], buf[i * mb],
                                              grad_avg[i * cg], c, decay, use_momentum, centered)
        if use_momentum:
            buf[i] = b
        if centered:
            grad_avg[i] = ga


@_jit(parallel=False)
def rmsprop_rows(x, g, square_avg, buf, grad_avg, u, s, decay, use_momentum, centered):
    """The loop on rows ``u`` (distinct) of 2-D tables; ``g`` has one row per index."""
    for i in range(u.size):
        r = u[i]
        rmsprop_serial(x[r], g[i], square_avg[r], buf[r], grad_avg[r], s, decay, use_momentum, centered)


ALL = (rmsprop_serial, rmsprop_parallel, rmsprop_rows)
