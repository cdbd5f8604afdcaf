"""Numba loops of RMSProp (torch's form), one pass in place, operation by operation as
:func:`onnx_training_ops.rmsprop.emit_rmsprop` writes the update in ONNX ops (same rounding:
every scalar arrives in ``s`` already in the arrays' dtype; ``fastmath=False``).

Scalars ``s``: rate, weight_decay, alpha, 1-alpha, eps, momentum. ``buf``/``grad_avg`` are
read only when ``use_momentum``/``centered`` (pass any 1-element array otherwise).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._numba_kernels import _jit


@_jit(parallel=False)
def rmsprop_serial(x, g, square_avg, buf, grad_avg, s, decay, use_momentum, centered):
    rate, weight_decay, alpha, one_minus_alpha, eps, momentum = s[0], s[1], s[2], s[3], s[4], s[5]
    for i in range(x.size):
        xi = x[i]
        gi = g[i]
        if decay:
            gi = gi + weight_decay * xi
        sq = alpha * square_avg[i] + one_minus_alpha * (gi * gi)
        square_avg[i] = sq
        if centered:
            ga = grad_avg[i] + one_minus_alpha * (gi - grad_avg[i])
            grad_avg[i] = ga
            sq = sq - ga * ga
        step = gi / (np.sqrt(sq) + eps)
        if use_momentum:
            step = momentum * buf[i] + step
            buf[i] = step
        x[i] = xi - rate * step


@_jit(parallel=True)
def rmsprop_parallel(x, g, square_avg, buf, grad_avg, s, decay, use_momentum, centered):
    rate, weight_decay, alpha, one_minus_alpha, eps, momentum = s[0], s[1], s[2], s[3], s[4], s[5]
    for i in prange(x.size):
        xi = x[i]
        gi = g[i]
        if decay:
            gi = gi + weight_decay * xi
        sq = alpha * square_avg[i] + one_minus_alpha * (gi * gi)
        square_avg[i] = sq
        if centered:
            ga = grad_avg[i] + one_minus_alpha * (gi - grad_avg[i])
            grad_avg[i] = ga
            sq = sq - ga * ga
        step = gi / (np.sqrt(sq) + eps)
        if use_momentum:
            step = momentum * buf[i] + step
            buf[i] = step
        x[i] = xi - rate * step


@_jit(parallel=False)
def rmsprop_rows(x, g, square_avg, buf, grad_avg, u, s, decay, use_momentum, centered):
    """The loop on rows ``u`` (distinct) of 2-D tables; ``g`` has one row per index."""
    for i in range(u.size):
        r = u[i]
        rmsprop_serial(x[r], g[i], square_avg[r], buf[r], grad_avg[r], s, decay, use_momentum, centered)


ALL = (rmsprop_serial, rmsprop_parallel, rmsprop_rows)
