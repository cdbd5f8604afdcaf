"""Row drivers of the fused kernels: the optimizer step on the rows ``u`` of 2-D tables.

For each touched row ``u[i]`` the element loop of :mod:`._numba_kernels` runs on the row
views ``x[u[i]]``, ``g[i]``, ``v[u[i]]`` (...): the same arithmetic, in place, in one pass
over the touched rows — no gathered copies, nothing of the table's size. ``u`` must not
repeat a row (the sparse gradient's indices are unique).
"""

from __future__ import annotations

from ._numba_kernels import (_jit, adagrad_serial, adam_serial, momentum_serial,
                             nesterov_serial)


@_jit(parallel=False)
def adam_rows(x, g, v, h, u, s):
    for i in range(u.size):
        r = u[i]
        adam_serial(x[r], g[i], v[r], h[r], s)


@_jit(parallel=False)
def momentum_rows(x, g, v, u, s):
    for i in range(u.size):
        r = u[i]
        momentum_serial(x[r], g[i], v[r], s)


@_jit(parallel=False)
def nesterov_rows(x, g, v, u, s):
    for i in range(u.size):
        r = u[i]
        nesterov_serial(x[r], g[i], v[r], s)


@_jit(parallel=False)
def adagrad_rows(x, g, h, u, s):
    for i in range(u.size):
        r = u[i]
        adagrad_serial(x[r], g[i], h[r], s)


ALL = (adam_rows, momentum_rows, nesterov_rows, adagrad_rows)
