"""Row drivers of the fused kernels: the optimizer step on the rows ``u`` of 2-D tables.

For each touched row ``u[i]`` the element loop of :mod:`._numba_kernels` runs on the row
views ``x[u[i]]``, ``g[i]``, ``v[u[i]]`` (...): the same arithmetic, in place, in one pass
over the touched rows — no gathered copies, nothing of the table's size. ``u`` must not
repeat a row (the sparse gradient's indices are unique).
"""

from __future__ import annotations

from ._numba_kernels import _jit, adagrad_serial, adam_serial, momentum_serial, nesterov_serial


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


@_jit(parallel=False)
def dedup_rows(index, rows, slots, order, summed):
    """Sum the rows of repeated indices (from zero, in order of appearance); ``slots``: -1 per
    table row on entry and on return. Fills ``order``/``summed``; returns the distinct count."""
    count = 0
    for i in range(index.size):
        r = index[i]
        k = slots[r]
        if k < 0:
            k = count
            slots[r] = k
            order[k] = r
            count += 1
            for j in range(rows.shape[1]):
                summed[k, j] = 0
        for j in range(rows.shape[1]):
            summed[k, j] += rows[i, j]
    for k in range(count):
        slots[order[k]] = -1
    return count


ALL = (adam_rows, momentum_rows, nesterov_rows, adagrad_rows, dedup_rows)
