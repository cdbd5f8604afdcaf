"""Fused in-place kernels: one pass over memory per optimizer step, multithreaded.

Same math as the reference kernels (:mod:`.adam`, :mod:`.momentum`, :mod:`.adagrad`),
operation by operation in the arrays' dtype, but updating ``X`` and the state tensors in
place in a single numba loop instead of a dozen numpy temporaries. The scalars come
prepared by the reference's own scalar functions (``adam_rate``, ``momentum_beta``,
``adagrad_rate``)::

    from onnx_training_ops.kernels import fused
    from onnx_training_ops.kernels.adam import adam_rate

    if fused.supports(x, g, v, h):
        fused.adam_(x, g, v, h, adam_rate(r, t, alpha, beta), alpha, beta, epsilon, nc, nc_post)
    else:
        x, v, h = adam_update(x, g, v, h, ...)

Call :func:`warm_up` once at start-up: the first call of each specialization otherwise
compiles (or loads from numba's on-disk cache) on the step path.
"""

from __future__ import annotations

import time

import numpy as np

from . import _numba_kernels as _k

# Below this many elements (per op) the serial loop runs: waking numba's thread pool costs
# a few microseconds, as much as updating ~16k-32k float32 elements on one core. Measured
# crossovers on a 2-core Zen 4 (median us, serial / parallel; benchmarks/bench_kernels.py
# has the method): Adam 7.35 / 7.28 at 16k; Adagrad 6.09 / 6.64 at 16k, 8.17 / 6.49 at 24k;
# Momentum 3.40 / 3.91 at 16k, 6.19 / 5.52 at 32k. Ties go to serial, which is also immune
# to the other core being busy (a parallel step then waits for a scheduler slice, ~4-12 ms).
# Mutable: set a value to sys.maxsize to keep that op single-threaded.
PARALLEL_THRESHOLDS = {"adam": 1 << 14, "adagrad": 3 << 13, "momentum": 1 << 15}
PARALLEL_THRESHOLD = min(PARALLEL_THRESHOLDS.values())  # the smallest switch point

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


# NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE, as in ndarray.flags.num
_REQUIRED_FLAGS = 0x0001 | 0x0100 | 0x0400


def supports(*arrays) -> bool:
    """True when the fused kernels apply to ``arrays`` (X first, then G and the states).

    That is: numpy arrays of one shape (no broadcasting) and one float dtype (float32 or
    float64), C-contiguous, aligned and writeable, no two of them sharing memory (the
    kernel writes X and the states while reading all). Otherwise use the reference kernel.
    Costs well under a microsecond for arrays that own their memory.
    """
    if not arrays:
        return False
    first = arrays[0]
    if not isinstance(first, np.ndarray) or first.dtype not in _FLOATS:
        return False
    dtype, shape = first.dtype, first.shape
    views = False
    for a in arrays:
        if (
            not isinstance(a, np.ndarray)
            or a.dtype != dtype
            or a.shape != shape
            or a.flags.num & _REQUIRED_FLAGS != _REQUIRED_FLAGS
        ):
            return False
        if a.base is not None:
            views = True
    if len({id(a) for a in arrays}) != len(arrays):
        return False
    if views:  # distinct arrays that own their memory cannot overlap; views may
        for i, a in enumerate(arrays):
            for b in arrays[i + 1 :]:
                if np.may_share_memory(a, b):
                    return False
    return True


def _flat(a: np.ndarray) -> np.ndarray:
    # A view for C-contiguous arrays, including 0-d ones (-> shape (1,)).
    return a.reshape(-1)


def adam_(x, g, v, h, rate, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post) -> None:
    """Adam step in place: ``x``, ``v``, ``h`` become X_new, V_new, H_new.

    ``rate`` is R_adjusted from :func:`.adam.adam_rate`. Arrays must pass :func:`supports`.
    """
    s = np.array(
        (rate, alpha, 1.0 - alpha, beta, 1.0 - beta, epsilon, norm_coefficient, 1.0 - norm_coefficient_post),
        dtype=x.dtype,
    )
    kernel = _k.adam_parallel if x.size >= PARALLEL_THRESHOLDS["adam"] else _k.adam_serial
    kernel(_flat(x), _flat(g), _flat(v), _flat(h), s)


def momentum_(x, g, v, rate, alpha, beta_adjusted, norm_coefficient, nesterov: bool) -> None:
    """Momentum step (standard or Nesterov) in place: ``x``, ``v`` become X_new, V_new.

    ``beta_adjusted`` comes from :func:`.momentum.momentum_beta`. Arrays must pass :func:`supports`.
    """
    s = np.array((rate, alpha, beta_adjusted, norm_coefficient), dtype=x.dtype)
    if x.size >= PARALLEL_THRESHOLDS["momentum"]:
        kernel = _k.nesterov_parallel if nesterov else _k.momentum_parallel
    else:
        kernel = _k.nesterov_serial if nesterov else _k.momentum_serial
    kernel(_flat(x), _flat(g), _flat(v), s)


def adagrad_(x, g, h, rate, epsilon, norm_coefficient) -> None:
    """Adagrad step in place: ``x``, ``h`` become X_new, H_new.

    ``rate`` comes from :func:`.adagrad.adagrad_rate`. Arrays must pass :func:`supports`.
    """
    s = np.array((rate, epsilon, norm_coefficient), dtype=x.dtype)
    kernel = _k.adagrad_parallel if x.size >= PARALLEL_THRESHOLDS["adagrad"] else _k.adagrad_serial
    kernel(_flat(x), _flat(g), _flat(h), s)


def warm_up() -> float:
    """Compile, or load from numba's disk cache, every specialization (serial and
    parallel, float32 and float64); returns the seconds it took."""
    start = time.perf_counter()
    for dtype in _FLOATS:
        for n in (1, max(PARALLEL_THRESHOLDS.values())):
            x, g, v, h = (np.zeros(n, dtype) for _ in range(4))
            adam_(x, g, v, h, 0.1, 0.9, 0.999, 1e-6, 0.0, 0.0)
            momentum_(x, g, v, 0.1, 0.9, 1.0, 0.0, False)
            momentum_(x, g, v, 0.1, 0.9, 1.0, 0.0, True)
            adagrad_(x, g, h, 0.1, 1e-6, 0.0)
    return time.perf_counter() - start


__all__ = ["adam_", "momentum_", "adagrad_", "supports", "warm_up", "PARALLEL_THRESHOLDS"]
