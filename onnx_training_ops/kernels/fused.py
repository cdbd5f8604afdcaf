"""Fused in-place kernels: one pass over memory per optimizer step, multithreaded.

Same math as the reference kernels (:mod:`onnx_training_ops.optim.adam`, ``.momentum``,
``.adagrad``), operation by operation in the arrays' dtype, but updating ``X`` and the state
tensors in place in a single numba loop instead of a dozen numpy temporaries. The scalars come
prepared by the reference's own scalar functions (``adam_rate``, ``momentum_beta``,
``adagrad_rate``) and travel as each optimizer's named tuple (``AdamScalars``, ...), rounded
to the arrays' dtype::

    from onnx_training_ops.kernels import fused
    from onnx_training_ops.optim.adam import adam_rate

    if fused.supports(x, g, v, h):
        fused.adam_(x, g, v, h, adam_rate(r, t, alpha, beta), alpha, beta, epsilon, nc, nc_post)
    else:
        x, v, h = adam_update(x, g, v, h, ...)

Nothing is compiled before it is needed. The ``*_prepared`` forms (the training session's fast
path) compile, or load from numba's on-disk cache, the loops their arrays need when they are
prepared: the dtype's serial loop, and past the op's parallel threshold the parallel one
(starting numba's thread pool). The other entry points compile a specialization on its first
call; :func:`warm_up` compiles every one at once (benchmarks call it before the clock starts).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from ..optim import adagrad as _adagrad
from ..optim import adam as _adam
from ..optim import momentum as _momentum
from ..optim import rmsprop as _rmsprop
from . import _numba_kernels as _k
from . import _numba_rmsprop as _rms
from . import _numba_rows as _rows
from .compile_notice import announce_compiles

# Below this many elements (per op) the serial loop runs: waking numba's thread pool costs
# a few microseconds, as much as updating ~16k-32k float32 elements on one core.
# Measured crossovers on a 2-core Zen 4, float32, median us of 2000 calls, serial /
# parallel: Adam 7.35 / 7.28 at 16k; Adagrad 6.09 / 6.64 at 16k, 8.17 / 6.49 at 24k;
# Momentum 3.40 / 3.91 at 16k, 6.19 / 5.52 at 32k. Ties go to serial, which is also
# immune to the other core being busy (see ADAPTIVE below).
# Mutable: set a value to sys.maxsize to keep that op single-threaded.
PARALLEL_THRESHOLDS = {"adam": 1 << 14, "adagrad": 3 << 13, "momentum": 1 << 15, "nesterov": 1 << 15,
                       "rmsprop": 1 << 14}  # rmsprop: not measured, Adam's
PARALLEL_THRESHOLD = min(PARALLEL_THRESHOLDS.values())  # the smallest switch point

# Above the threshold, choose serial or parallel by measured cost (ADAPTIVE = True) or
# always run parallel (False). Why: on 2 cores, a parallel loop launched while another
# process (or onnxruntime's spinning intra-op threads) holds the other core waits for a
# scheduler slice, ~8 ms on this machine, at every launch: 20-50x the step itself at
# 1e5-1e6 elements. Each op and power-of-two size bucket runs one variant and keeps its
# running (EWMA) cost per element; it leaves it after two calls in a row cost 1.5x the
# other's last measured cost. Every 16 calls it probes the other variant with a burst of
# 3 calls (the first may wake a sleeping thread pool, so the burst's best counts) and
# switches if that beats the running cost, backing off to every 1024 calls (at most
# _PROBE_SECONDS of kernel time) while probes keep losing. Both variants compute every element
# identically: the choice changes time, never results.
ADAPTIVE = True
_PROBE_MIN, _PROBE_MAX, _PROBE_LEN, _EWMA, _SLACK = 16, 1024, 3, 0.25, 1.5
# a probe that lost backs off at most to this much kernel time between probes: a pick made
# while the other core was busy is revisited within ~0.25 s, not 1024 calls (5 s at 1e7)
_PROBE_SECONDS = 0.25
_INF = float("inf")


class _Choice:
    """Serial or parallel for one op and size bucket: the running variant, each variant's
    measured cost per element, and the probe schedule (see ADAPTIVE)."""

    __slots__ = ("use", "cost", "strikes", "countdown", "interval", "probe", "probe_left", "probe_best")

    def __init__(self):
        self.use = 1  # running variant: 0 serial, 1 parallel
        self.cost = [_INF, _INF]  # seconds per element: [serial, parallel]
        self.strikes = 0
        self.countdown = self.interval = _PROBE_MIN
        self.probe, self.probe_left, self.probe_best = 1, _PROBE_LEN, _INF  # measure parallel first

    def pick(self) -> int:
        """The variant this call runs: the probe's while one lasts, else the running one
        (starting a probe of the other when the countdown ends)."""
        if self.probe_left:
            return self.probe
        self.countdown -= 1
        if self.countdown > 0:
            return self.use
        self.probe = 1 - self.use
        self.probe_left, self.probe_best = _PROBE_LEN, _INF
        return self.probe

    def record(self, use: int, per_element: float, n: int) -> None:
        """What a call of variant ``use`` on ``n`` elements cost (seconds per element)."""
        if self.probe_left:
            self.probe_best = min(self.probe_best, per_element)  # the burst's best counts
            self.probe_left -= 1
            if not self.probe_left:
                self._end_probe(use, n)
        else:
            self._track(use, per_element)

    def _end_probe(self, use: int, n: int) -> None:
        """A probe burst ended: keep its best; switch if it beat the other, else back off."""
        other = self.cost[1 - use]
        self.cost[use] = self.probe_best
        if other == _INF:  # the other variant not measured yet: probe it next
            self.use, self.countdown = use, 1
            return
        if self.probe_best < other:
            self.use, self.strikes, self.interval = use, 0, _PROBE_MIN
        else:  # back off, but probe again within _PROBE_SECONDS of kernel time
            running = other * n
            cap = _PROBE_MAX if running <= 0 else max(_PROBE_MIN, min(_PROBE_MAX, int(_PROBE_SECONDS / running)))
            self.interval = min(2 * self.interval, cap)
        self.countdown = self.interval

    def _track(self, use: int, per_element: float) -> None:
        """The running variant's EWMA cost; two calls in a row over _SLACK times the other's
        cost switch to the other."""
        self.cost[use] += _EWMA * (per_element - self.cost[use])
        if per_element <= _SLACK * self.cost[1 - use]:
            self.strikes = 0
            return
        self.strikes += 1
        if self.strikes >= 2:
            self.use, self.strikes = 1 - use, 0


_CHOICES: dict[tuple[str, int], _Choice] = {}

# One parallel loop at a time in the process. numba releases the GIL inside a parallel
# region, and its workqueue threading layer aborts the process ("Concurrent access has been
# detected") when a second thread launches one meanwhile: four threads with a session each
# did. A thread that finds the pool busy runs the serial loop, which computes every element
# identically; it never waits.
_POOL = threading.Lock()


def _fresh_pool_lock() -> None:
    """A forked child starts with the lock free: a thread that held it in the parent (running
    a parallel loop while another forked) does not exist there, and would hold it forever."""
    global _POOL
    _POOL = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_pool_lock)


def _launch(serial, parallel, args) -> int:
    """Run ``parallel`` if numba's thread pool is free, else ``serial``; returns the
    variant that ran (1 parallel, 0 serial)."""
    if _POOL.acquire(blocking=False):
        try:
            parallel(*args)
        finally:
            _POOL.release()
        return 1
    serial(*args)
    return 0


def _timed(serial, parallel, args, use: int) -> float | None:
    """Seconds ``parallel(*args)`` (``use`` 1) or ``serial(*args)`` (0) took; None when the
    pool was busy and the serial loop ran instead (a call that measures neither variant)."""
    start = time.perf_counter()
    if use:
        if not _launch(serial, parallel, args):
            return None
    else:
        serial(*args)
    return time.perf_counter() - start


def _dispatch(op: str, serial, parallel, n: int, *args) -> None:
    """Run ``serial(*args)`` or ``parallel(*args)``, loops over ``n`` elements that compute the
    same values: serial below the op's threshold; above it, the variant its :class:`_Choice`
    picks (ADAPTIVE), or parallel whenever numba's thread pool is free."""
    if n < PARALLEL_THRESHOLDS[op]:
        serial(*args)
        return
    if not ADAPTIVE:
        _launch(serial, parallel, args)
        return
    key = (op, n.bit_length())
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _Choice()
    use = choice.pick()
    seconds = _timed(serial, parallel, args, use)
    if seconds is not None:
        choice.record(use, seconds / n, n)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_MOST_SCALARS = max(len(t._fields) for t in (_adam.AdamScalars, _momentum.MomentumScalars,
                                             _adagrad.AdagradScalars, _rmsprop.RMSPropScalars))
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


def supports_rows(tables, g, rows) -> bool:
    """True when the row drivers apply: 2-D tables (X and its states) of one shape, ``g``
    of shape [len(rows), row size], all passing :func:`supports`' dtype/layout rules, and
    ``rows`` int64, C-contiguous, in range and without repeats (the caller's promise for
    repeats: the sparse gradient's indices are unique)."""
    x = tables[0]
    if not isinstance(rows, np.ndarray) or rows.dtype != np.int64 or rows.ndim != 1 \
            or not rows.flags.c_contiguous or not isinstance(x, np.ndarray) or x.ndim != 2 \
            or not isinstance(g, np.ndarray) or g.shape != (rows.size, x.shape[1]):
        return False
    if rows.size and (rows.min() < 0 or rows.max() >= x.shape[0]):
        return False
    return supports(*tables) and supports(g.reshape(-1), np.empty(g.size, x.dtype))


def _flat(a: np.ndarray) -> np.ndarray:
    # A view for C-contiguous arrays, including 0-d ones (-> shape (1,)).
    return a.reshape(-1)


def adam_(x, g, v, h, rate, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post,
          rows=None) -> None:
    """Adam step in place: ``x``, ``v``, ``h`` become X_new, V_new, H_new.

    ``rate`` is R_adjusted from :func:`onnx_training_ops.optim.adam.adam_rate`. Arrays must pass :func:`supports`,
    or with ``rows`` :func:`supports_rows` (the step on those rows of 2-D tables).
    """
    s = np.array(_adam.adam_scalars(rate, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post),
                 dtype=x.dtype)
    if rows is not None:
        _rows.adam_rows(x, g, v, h, rows, s)
        return
    _dispatch("adam", _k.adam_serial, _k.adam_parallel, x.size, _flat(x), _flat(g), _flat(v), _flat(h), s)


def momentum_(x, g, v, rate, alpha, beta_adjusted, norm_coefficient, nesterov: bool, rows=None) -> None:
    """Momentum step (standard or Nesterov) in place: ``x``, ``v`` become X_new, V_new.

    ``beta_adjusted`` comes from :func:`onnx_training_ops.optim.momentum.momentum_beta`. Arrays must
    pass :func:`supports` (with ``rows``: :func:`supports_rows`).
    """
    s = np.array(_momentum.MomentumScalars(rate, alpha, beta_adjusted, norm_coefficient), dtype=x.dtype)
    if rows is not None:
        (_rows.nesterov_rows if nesterov else _rows.momentum_rows)(x, g, v, rows, s)
        return
    if nesterov:
        _dispatch("nesterov", _k.nesterov_serial, _k.nesterov_parallel, x.size, _flat(x), _flat(g), _flat(v), s)
    else:
        _dispatch("momentum", _k.momentum_serial, _k.momentum_parallel, x.size, _flat(x), _flat(g), _flat(v), s)


def adagrad_(x, g, h, rate, epsilon, norm_coefficient, rows=None) -> None:
    """Adagrad step in place: ``x``, ``h`` become X_new, H_new.

    ``rate`` comes from :func:`onnx_training_ops.optim.adagrad.adagrad_rate`. Arrays must pass :func:`supports`
    (with ``rows``: :func:`supports_rows`).
    """
    s = np.array(_adagrad.AdagradScalars(rate, epsilon, norm_coefficient), dtype=x.dtype)
    if rows is not None:
        _rows.adagrad_rows(x, g, h, rows, s)
        return
    _dispatch("adagrad", _k.adagrad_serial, _k.adagrad_parallel, x.size, _flat(x), _flat(g), _flat(h), s)


_READY: set = set()  # (serial loop, dtype, with its parallel twin) compiled or loaded in this process


def _ready(op: str, serial, parallel, dtype: np.dtype, n: int, arrays: int) -> None:
    """Compile (or load from numba's cache) the loops a tensor of ``n`` elements of ``dtype``
    runs, before its first update (so that the adaptive choice never times a compile): the
    serial loop, and the parallel one when ``n`` reaches the op's threshold (its first launch
    starts numba's thread pool). Once per process each."""
    key = (serial, dtype, n >= PARALLEL_THRESHOLDS[op])
    if key in _READY:
        return
    with announce_compiles():
        args = [np.zeros(1, dtype) for _ in range(arrays)] + [np.zeros(_MOST_SCALARS, dtype)]
        serial(*args)  # each loop reads only the scalars it needs
        if key[2]:
            _launch(serial, parallel, args)
    _READY.add(key)


def adam_prepared(x, g, v, h, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post, decay=None):
    """:func:`adam_` for arrays used again and again: the scalars and flat views are built
    once; returns ``run(rate)``. The arrays must pass :func:`supports` and stay alive.
    ``decay``: a 0-d array of x's dtype, read at each run: ``x *= decay`` first (AdamW's
    decoupled decay), in the same pass."""
    s = np.array(_adam.adam_scalars(0.0, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post),
                 dtype=x.dtype)
    args, n = (_flat(x), _flat(g), _flat(v), _flat(h), s), x.size
    serial, parallel = (_k.adam_serial, _k.adam_parallel) if decay is None else \
        (_k.adam_decay_serial, _k.adam_decay_parallel)
    factor = None if decay is None else decay.reshape(())
    _ready("adam", serial, parallel, x.dtype, n, 4)

    def run(rate: float) -> None:
        s[_adam.RATE] = rate
        if factor is not None:
            s[_adam.DECAY] = factor
        _dispatch("adam", serial, parallel, n, *args)

    return run


def momentum_prepared(x, g, v, alpha, norm_coefficient, nesterov: bool):
    """:func:`momentum_` prepared once; returns ``run(rate, beta_adjusted)``."""
    s = np.array(_momentum.MomentumScalars(0.0, alpha, 0.0, norm_coefficient), dtype=x.dtype)
    op = "nesterov" if nesterov else "momentum"
    serial, parallel = ((_k.nesterov_serial, _k.nesterov_parallel) if nesterov
                        else (_k.momentum_serial, _k.momentum_parallel))
    args, n = (_flat(x), _flat(g), _flat(v), s), x.size
    _ready(op, serial, parallel, x.dtype, n, 3)

    def run(rate: float, beta_adjusted: float) -> None:
        s[_momentum.RATE], s[_momentum.BETA_ADJUSTED] = rate, beta_adjusted
        _dispatch(op, serial, parallel, n, *args)

    return run


def adagrad_prepared(x, g, h, epsilon, norm_coefficient):
    """:func:`adagrad_` prepared once; returns ``run(rate)``."""
    s = np.array(_adagrad.AdagradScalars(0.0, epsilon, norm_coefficient), dtype=x.dtype)
    args, n, serial, parallel = (_flat(x), _flat(g), _flat(h), s), x.size, _k.adagrad_serial, _k.adagrad_parallel
    _ready("adagrad", serial, parallel, x.dtype, n, 3)

    def run(rate: float) -> None:
        s[_adagrad.RATE] = rate
        _dispatch("adagrad", serial, parallel, n, *args)

    return run


def rmsprop_(x, g, states: dict, rate, opt, rows=None) -> None:
    """RMSProp (torch's form, :class:`onnx_training_ops.RMSProp` ``opt``) in place on ``x`` and
    ``states`` (square_avg[, momentum_buffer][, grad_avg]); ``rate`` in x's dtype as the graph
    casts it. Arrays must pass :func:`supports` (with ``rows``: :func:`supports_rows`)."""
    s = np.array(_rmsprop.rmsprop_scalars(rate, opt), dtype=x.dtype)
    spare = states["square_avg"]  # never read: the flags say so
    flags = (opt.weight_decay != 0, opt.momentum > 0, bool(opt.centered))
    if rows is not None:
        _rms.rmsprop_rows(x, g, spare, states.get("momentum_buffer", spare), states.get("grad_avg", spare),
                          rows, s, *flags)
        return
    _dispatch("rmsprop", _rms.rmsprop_serial, _rms.rmsprop_parallel, x.size, _flat(x), _flat(g),
              _flat(states["square_avg"]), _flat(states.get("momentum_buffer", spare)),
              _flat(states.get("grad_avg", spare)), s, *flags)


def warm_up() -> float:
    """Compile, or load from numba's disk cache, every specialization (serial and
    parallel, float32 and float64) and start numba's thread pool; returns the seconds
    it took. Call it once at start-up so that no step pays for it."""
    start = time.perf_counter()
    if _POOL.acquire(blocking=False):  # the first calls launch numba's thread pool: one thread at a time
        try:
            _warm_up_all(parallel=True)
        finally:
            _POOL.release()
    else:  # another thread runs a parallel loop: the pool is up; its variants compile on first use
        _warm_up_all(parallel=False)
    return time.perf_counter() - start


def _warm_up_all(parallel: bool) -> None:
    for dtype in _FLOATS:
        arrays = [np.zeros(1, dtype) for _ in range(4)]
        s = np.zeros(_MOST_SCALARS, dtype)  # each kernel reads only the scalars it needs
        adams = (_k.adam_parallel, _k.adam_serial, _k.adam_decay_parallel, _k.adam_decay_serial)
        for kernel in _k.ALL if parallel else _k.SERIAL:
            nargs = 4 if kernel in adams else 3
            kernel(*arrays[:nargs], s)
        tables, u = [np.zeros((1, 1), dtype) for _ in range(4)], np.zeros(1, np.int64)
        for kernel in (_rows.adam_rows, _rows.momentum_rows, _rows.nesterov_rows, _rows.adagrad_rows):
            nargs = 4 if kernel is _rows.adam_rows else 3
            kernel(*tables[:nargs], u, s)
        _rows.dedup_rows(u, tables[0], np.full(1, -1, np.int64), np.empty(1, np.int64), tables[1])
        for kernel in (_rms.rmsprop_serial, _rms.rmsprop_parallel) if parallel else (_rms.rmsprop_serial,):
            kernel(*arrays, arrays[0], s, True, True, True)
        _rms.rmsprop_rows(*tables, tables[0], u, s, True, True, True)


__all__ = ["adam_", "momentum_", "adagrad_", "rmsprop_", "adam_prepared", "momentum_prepared", "adagrad_prepared",
           "supports", "supports_rows", "warm_up", "PARALLEL_THRESHOLDS", "ADAPTIVE"]
