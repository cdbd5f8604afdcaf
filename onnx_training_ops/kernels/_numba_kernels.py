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
from numba import njit, prange

from ..optim import adagrad as _adagrad
from ..optim import adam as _adam
from ..optim import momentum as _momentum
from ..optim._numba import OPTIONS as _OPTIONS
from ..optim._numba import JitOptions, cache_covers_inlined_sources

if "NUMBA_THREADING_LAYER" not in os.environ:
    # numba.config defines its settings in a function that copies its locals into globals()
    numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]

_WARNED = False
cache_covers_inlined_sources()  # before any cached loop below is defined


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
        cached: JitOptions = {**_OPTIONS, "parallel": parallel, "cache": True}
        try:
            return njit(**cached)(func)
        except RuntimeError as exc:  # "cannot cache function ...: no locator available"
            if not _WARNED:
                _WARNED = True
                warnings.warn(f"numba cannot cache the fused kernels ({exc}); compiling them once "
                              "per process (about 5 s). Set NUMBA_CACHE_DIR to a writable "
                              "directory to keep them between runs", stacklevel=2)
            uncached: JitOptions = {**cached, "cache": False}
            return njit(**uncached)(func)

    return decorate


# ---- the per-element arithmetic is written once, in the optimizer's module
# (onnx_training_ops.optim.<name>: *_element, and load_scalars reading the scalar array as the
# optimizer's named tuple, e.g. AdamScalars); every loop here and in _numba_rows,
# _numba_rmsprop and _native_kernels inlines them (numba inline="always": the same IR as a
# written-out body). Scalars come unpacked into a tuple once per call, so LLVM keeps them in
# registers (reading ``s[k]`` per element, ``s`` could alias the arrays being written).
# A cached caller in another file is not invalidated when these change: clear
# __pycache__/*.nbi after editing them.


# ---- in-place loops: parallel and serial (see the module doc for why both are written out)


@_jit(parallel=True)
def adam_parallel(x, g, v, h, s):
    c = _adam.load_scalars(s)
    for i in prange(x.size):
        x[i], v[i], h[i] = _adam.adam_element(x[i], g[i], v[i], h[i], c)


@_jit(parallel=False)
def adam_serial(x, g, v, h, s):
    c = _adam.load_scalars(s)
    for i in range(x.size):
        x[i], v[i], h[i] = _adam.adam_element(x[i], g[i], v[i], h[i], c)


# AdamW's decoupled decay folded in: ``x *= decay`` (AdamScalars.decay; a float multiply in
# x's dtype, as numpy's in-place multiply) right before the update, in the same pass over memory.
@_jit(parallel=True)
def adam_decay_parallel(x, g, v, h, s):
    c = _adam.load_scalars(s)
    for i in prange(x.size):
        x[i], v[i], h[i] = _adam.adam_element(x[i] * c.decay, g[i], v[i], h[i], c)


@_jit(parallel=False)
def adam_decay_serial(x, g, v, h, s):
    c = _adam.load_scalars(s)
    for i in range(x.size):
        x[i], v[i], h[i] = _adam.adam_element(x[i] * c.decay, g[i], v[i], h[i], c)


@_jit(parallel=True)
def momentum_parallel(x, g, v, s):
    c = _momentum.load_scalars(s)
    for i in prange(x.size):
        x[i], v[i] = _momentum.momentum_element(x[i], g[i], v[i], c)


@_jit(parallel=False)
def momentum_serial(x, g, v, s):
    c = _momentum.load_scalars(s)
    for i in range(x.size):
        x[i], v[i] = _momentum.momentum_element(x[i], g[i], v[i], c)


@_jit(parallel=True)
def nesterov_parallel(x, g, v, s):
    c = _momentum.load_scalars(s)
    for i in prange(x.size):
        x[i], v[i] = _momentum.nesterov_element(x[i], g[i], v[i], c)


@_jit(parallel=False)
def nesterov_serial(x, g, v, s):
    c = _momentum.load_scalars(s)
    for i in range(x.size):
        x[i], v[i] = _momentum.nesterov_element(x[i], g[i], v[i], c)


@_jit(parallel=True)
def adagrad_parallel(x, g, h, s):
    c = _adagrad.load_scalars(s)
    for i in prange(x.size):
        x[i], h[i] = _adagrad.adagrad_element(x[i], g[i], h[i], c)


@_jit(parallel=False)
def adagrad_serial(x, g, h, s):
    c = _adagrad.load_scalars(s)
    for i in range(x.size):
        x[i], h[i] = _adagrad.adagrad_element(x[i], g[i], h[i], c)


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
