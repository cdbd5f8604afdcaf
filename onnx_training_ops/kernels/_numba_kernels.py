"""Numba loops behind :mod:`onnx_training_ops.kernels.fused` (one pass over memory, in place).

Every loop takes flat C-contiguous arrays of one dtype plus ``s``, a small array of the
same dtype holding the op's scalars already rounded to that dtype, exactly as numpy
rounds a Python float meeting an array of that dtype (NEP 50 "weak" scalars). So the
per-element arithmetic is the reference kernel's, operation by operation, in the
array's own dtype; ``fastmath=False`` keeps LLVM from contracting into FMAs or
reassociating, so results match numpy bit for bit (sqrt and division are correctly
rounded in both).

Each loop exists twice: a ``prange`` variant (``parallel=True``) for large arrays and a
serial one for small arrays, where waking the thread pool costs more than the work.
The two bodies are written out rather than compiled from one function: numba's disk
cache keys an entry by function and signature, not by the ``parallel`` flag, so two
dispatchers of one function would load each other's code.
The GIL stays held during a call (no ``nogil``): the workqueue threading layer aborts
on concurrent parallel launches from several Python threads, and holding the GIL
rules that out whatever layer numba picks.

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


@_jit(parallel=True)
def adam_parallel(x, g, v, h, s):
    rate, alpha, one_minus_alpha = s[0], s[1], s[2]
    beta, one_minus_beta, epsilon = s[3], s[4], s[5]
    norm, post = s[6], s[7]
    for i in prange(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        v_new = alpha * v[i] + one_minus_alpha * g_regularized
        h_new = beta * h[i] + one_minus_beta * (g_regularized * g_regularized)
        h_sqrt = np.sqrt(h_new) + epsilon
        x[i] = post * (xi - rate * (v_new / h_sqrt))
        v[i] = v_new
        h[i] = h_new


@_jit(parallel=False)
def adam_serial(x, g, v, h, s):
    rate, alpha, one_minus_alpha = s[0], s[1], s[2]
    beta, one_minus_beta, epsilon = s[3], s[4], s[5]
    norm, post = s[6], s[7]
    for i in range(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        v_new = alpha * v[i] + one_minus_alpha * g_regularized
        h_new = beta * h[i] + one_minus_beta * (g_regularized * g_regularized)
        h_sqrt = np.sqrt(h_new) + epsilon
        x[i] = post * (xi - rate * (v_new / h_sqrt))
        v[i] = v_new
        h[i] = h_new


@_jit(parallel=True)
def momentum_parallel(x, g, v, s):
    rate, alpha, beta_adjusted, norm = s[0], s[1], s[2], s[3]
    for i in prange(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        v_new = alpha * v[i] + beta_adjusted * g_regularized
        x[i] = xi - rate * v_new
        v[i] = v_new


@_jit(parallel=False)
def momentum_serial(x, g, v, s):
    rate, alpha, beta_adjusted, norm = s[0], s[1], s[2], s[3]
    for i in range(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        v_new = alpha * v[i] + beta_adjusted * g_regularized
        x[i] = xi - rate * v_new
        v[i] = v_new


@_jit(parallel=True)
def nesterov_parallel(x, g, v, s):
    rate, alpha, beta_adjusted, norm = s[0], s[1], s[2], s[3]
    for i in prange(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        v_new = alpha * v[i] + beta_adjusted * g_regularized
        x[i] = xi - rate * (g_regularized + alpha * v_new)
        v[i] = v_new


@_jit(parallel=False)
def nesterov_serial(x, g, v, s):
    rate, alpha, beta_adjusted, norm = s[0], s[1], s[2], s[3]
    for i in range(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        v_new = alpha * v[i] + beta_adjusted * g_regularized
        x[i] = xi - rate * (g_regularized + alpha * v_new)
        v[i] = v_new


@_jit(parallel=True)
def adagrad_parallel(x, g, h, s):
    rate, epsilon, norm = s[0], s[1], s[2]
    for i in prange(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        h_new = h[i] + g_regularized * g_regularized
        h_sqrt = np.sqrt(h_new) + epsilon
        x[i] = xi - rate * g_regularized / h_sqrt
        h[i] = h_new


@_jit(parallel=False)
def adagrad_serial(x, g, h, s):
    rate, epsilon, norm = s[0], s[1], s[2]
    for i in range(x.size):
        xi = x[i]
        g_regularized = norm * xi + g[i]
        h_new = h[i] + g_regularized * g_regularized
        h_sqrt = np.sqrt(h_new) + epsilon
        x[i] = xi - rate * g_regularized / h_sqrt
        h[i] = h_new


# Distinct functions, not one body jitted twice: numba's cache index is keyed by the
# function's qualified name and line, and would mix a parallel and a serial build.
ALL = (
    adam_parallel,
    adam_serial,
    momentum_parallel,
    momentum_serial,
    nesterov_parallel,
    nesterov_serial,
    adagrad_parallel,
    adagrad_serial,
)
