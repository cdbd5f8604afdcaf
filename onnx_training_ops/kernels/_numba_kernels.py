"""Numba loops behind :mod:`onnx_training_ops.kernels.fused` (one pass over memory, in place).

Every loop takes flat C-contiguous arrays of one dtype plus ``s``, a small array of the
same dtype holding the op's scalars already rounded to that dtype, exactly as numpy
rounds a Python float meeting an array of that dtype (NEP 50 "weak" scalars). So the
per-element arithmetic is the reference kernel's, operation by operation, in the
array's own dtype; ``fastmath=False`` keeps LLVM from contracting into FMAs or
reassociating, so results match numpy bit for bit (sqrt and division are correctly
rounded in both).

The per-element arithmetic is written once (``*_element``, inlined into every loop);
each loop exists twice: a ``prange`` variant (``parallel=True``) for large arrays and a
serial one for small arrays, where waking the thread pool costs more than the work.
The two loops are separate functions rather than one function compiled twice: numba's disk
cache keys an entry by function and signature, not by the ``parallel`` flag, so two
dispatchers of one function would load each other's code.
numba releases the GIL inside a parallel region (whatever ``nogil`` says), and the
workqueue threading layer aborts the process on concurrent parallel launches from several
Python threads: :mod:`.fused` launches the parallel loops under one process-wide lock.

Threading layer: ``workqueue`` unless ``NUMBA_THREADING_LAYER`` says otherwise. GNU OpenMP
(numba's first choice where it exists) makes every ``fork()`` child of a process that used
it die ("fork() called from a process already using GNU OpenMP"), which breaks
``multiprocessing`` pools; workqueue forks cleanly and measured as fast or faster here
(Adam at 1e7 float32, parallel loop: 4.9-5.1 ms vs 8.0 ms with omp, same run).
"""

from __future__ import annotations

import os
import warnings

import numba
import numpy as np
from numba import njit, prange

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

_WARNED = False
_OPTIONS = dict(fastmath=False, error_model="numpy", boundscheck=False)


def _jit(parallel: bool):
    """``njit`` with an on-disk cache.

    numba's locator chain finds the cache directory: ``NUMBA_CACHE_DIR`` if set, else
    ``__pycache__`` beside this file, else (package directory read-only, as in a system
    site-packages) a user-wide directory (``~/.cache/numba`` or the platform's
    equivalent). Only when none is writable does ``cache=True`` raise at decoration
    time; we then compile once per process instead of failing the import.
    """

    def decorate(func):
        global _WARNED
        try:
            return njit(parallel=parallel, cache=True, **_OPTIONS)(func)
        except RuntimeError as exc:  # "cannot cache function ...: no locator available"
            if not _WARNED:
                _WARNED = True
                warnings.warn(f"numba cannot cache the fused kernels ({exc}); compiling them once "
                              "per process (about 5 s). Set NUMBA_CACHE_DIR to a writable "
                              "directory to keep them between runs")
            return njit(parallel=parallel, cache=False, **_OPTIONS)(func)

    return decorate


# Scalar layouts (index -> value), each rounded to the arrays' dtype by the caller:
#   adam:     rate, alpha, 1-alpha, beta, 1-beta, epsilon, norm_coefficient, 1-norm_coefficient_post
#   momentum: rate, alpha, beta_adjusted, norm_coefficient
#   adagrad:  rate, epsilon, norm_coefficient


# ---- the per-element arithmetic, written once: every loop here and in _numba_rows,
# _numba_rmsprop and _native_kernels inlines these (numba inline="always": the same IR as
# a written-out body). Scalars come unpacked into a tuple once per call, so LLVM keeps them
# in registers (reading ``s[k]`` per element, ``s`` could alias the arrays being written).
# A cached caller in another file is not invalidated when these change: clear
# __pycache__/*.nbi after editing them.


@njit(inline="always", **_OPTIONS)
def adam_scalars(s):
    return s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]


@njit(inline="always", **_OPTIONS)
def adam_element(xi, gi, vi, hi, c):
    """(X_new, V_new, H_new) of one element: the reference kernel's operations in order."""
    rate, alpha, one_minus_alpha, beta, one_minus_beta, epsilon, norm, post = c
    g_regularized = norm * xi + gi
    v_new = alpha * vi + one_minus_alpha * g_regularized
    h_new = beta * hi + one_minus_beta * (g_regularized * g_regularized)
    h_sqrt = np.sqrt(h_new) + epsilon
    return post * (xi - rate * (v_new / h_sqrt)), v_new, h_new


@njit(inline="always", **_OPTIONS)
def momentum_scalars(s):
    return s[0], s[1], s[2], s[3]


@njit(inline="always", **_OPTIONS)
def momentum_element(xi, gi, vi, c):
    rate, alpha, beta_adjusted, norm = c
    g_regularized = norm * xi + gi
    v_new = alpha * vi + beta_adjusted * g_regularized
    return xi - rate * v_new, v_new


@njit(inline="always", **_OPTIONS)
def nesterov_element(xi, gi, vi, c):
    rate, alpha, beta_adjusted, norm = c
    g_regularized = norm * xi + gi
    v_new = alpha * vi + beta_adjusted * g_regularized
    return xi - rate * (g_regularized + alpha * v_new), v_new


@njit(inline="always", **_OPTIONS)
def adagrad_scalars(s):
    return s[0], s[1], s[2]


@njit(inline="always", **_OPTIONS)
def adagrad_element(xi, gi, hi, c):
    rate, epsilon, norm = c
    g_regularized = norm * xi + gi
    h_new = hi + g_regularized * g_regularized
    h_sqrt = np.sqrt(h_new) + epsilon
    return xi - rate * g_regularized / h_sqrt, h_new


# ---- in-place loops: parallel and serial (see the module doc for why both are written out)


@_jit(parallel=True)
def adam_parallel(x, g, v, h, s):
    c = adam_scalars(s)
    for i in prange(x.size):
        x[i], v[i], h[i] = adam_element(x[i], g[i], v[i], h[i], c)


@_jit(parallel=False)
def adam_serial(x, g, v, h, s):
    c = adam_scalars(s)
    for i in range(x.size):
        x[i], v[i], h[i] = adam_element(x[i], g[i], v[i], h[i], c)


# AdamW's decoupled decay folded in: ``x *= s[8]`` (float multiply in x's dtype, as numpy's
# in-place multiply) right before the update, in the same pass over memory.
@_jit(parallel=True)
def adam_decay_parallel(x, g, v, h, s):
    c, decay = adam_scalars(s), s[8]
    for i in prange(x.size):
        x[i], v[i], h[i] = adam_element(x[i] * decay, g[i], v[i], h[i], c)


@_jit(parallel=False)
def adam_decay_serial(x, g, v, h, s):
    c, decay = adam_scalars(s), s[8]
    for i in range(x.size):
        x[i], v[i], h[i] = adam_element(x[i] * decay, g[i], v[i], h[i], c)


@_jit(parallel=True)
def momentum_parallel(x, g, v, s):
    c = momentum_scalars(s)
    for i in prange(x.size):
        x[i], v[i] = momentum_element(x[i], g[i], v[i], c)


@_jit(parallel=False)
def momentum_serial(x, g, v, s):
    c = momentum_scalars(s)
    for i in range(x.size):
        x[i], v[i] = momentum_element(x[i], g[i], v[i], c)


@_jit(parallel=True)
def nesterov_parallel(x, g, v, s):
    c = momentum_scalars(s)
    for i in prange(x.size):
        x[i], v[i] = nesterov_element(x[i], g[i], v[i], c)


@_jit(parallel=False)
def nesterov_serial(x, g, v, s):
    c = momentum_scalars(s)
    for i in range(x.size):
        x[i], v[i] = nesterov_element(x[i], g[i], v[i], c)


@_jit(parallel=True)
def adagrad_parallel(x, g, h, s):
    c = adagrad_scalars(s)
    for i in prange(x.size):
        x[i], h[i] = adagrad_element(x[i], g[i], h[i], c)


@_jit(parallel=False)
def adagrad_serial(x, g, h, s):
    c = adagrad_scalars(s)
    for i in range(x.size):
        x[i], h[i] = adagrad_element(x[i], g[i], h[i], c)


# Distinct functions, not one body jitted twice: numba's cache index is keyed by the
# function's qualified name and line, and would mix a parallel and a serial build.
ALL = (
    adam_parallel,
    adam_serial,
    adam_decay_parallel,
    adam_decay_serial,
    momentum_parallel,
    momentum_serial,
    nesterov_parallel,
    nesterov_serial,
    adagrad_parallel,
    adagrad_serial,
)
SERIAL = (adam_serial, adam_decay_serial, momentum_serial, nesterov_serial, adagrad_serial)
