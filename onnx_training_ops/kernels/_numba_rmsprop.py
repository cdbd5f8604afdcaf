"""Numba loops of RMSProp (torch's form), one pass in place, operation by operation as
:func:`onnx_training_ops.optim.rmsprop.emit_rmsprop` writes the update in ONNX ops (same rounding:
every scalar arrives in ``s`` already in the arrays' dtype; ``fastmath=False``).

Scalars ``s``: :class:`onnx_training_ops.optim.rmsprop.RMSPropScalars`; the element is
:func:`onnx_training_ops.optim.rmsprop.rmsprop_element`. ``buf``/``grad_avg`` are read only
when ``use_momentum``/``centered`` (pass any 1-element array otherwise).
"""

from __future__ import annotations

from numba import prange

from ..optim import rmsprop as _rmsprop
from ._numba_kernels import _jit


@_jit(parallel=False)
def rmsprop_serial(x, g, square_avg, buf, grad_avg, s, decay, use_momentum, centered):
    c = _rmsprop.load_scalars(s)
    mb, cg = (1 if use_momentum else 0), (1 if centered else 0)  # unused states: read element 0
    for i in range(x.size):
        x[i], square_avg[i], b, ga = _rmsprop.rmsprop_element(
            x[i], g[i], square_avg[i], buf[i * mb], grad_avg[i * cg], c, decay, use_momentum, centered)
        if use_momentum:
            buf[i] = b
        if centered:
            grad_avg[i] = ga


@_jit(parallel=True)
def rmsprop_parallel(x, g, square_avg, buf, grad_avg, s, decay, use_momentum, centered):
    c = _rmsprop.load_scalars(s)
    mb, cg = (1 if use_momentum else 0), (1 if centered else 0)  # unused states: read element 0
    for i in prange(x.size):
        x[i], square_avg[i], b, ga = _rmsprop.rmsprop_element(
            x[i], g[i], square_avg[i], buf[i * mb], grad_avg[i * cg], c, decay, use_momentum, centered)
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
