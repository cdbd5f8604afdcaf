"""The fused in-place kernels against the numpy reference kernels (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_training_ops.kernels import fused
from onnx_training_ops.optim.adagrad import adagrad, adagrad_rate
from onnx_training_ops.optim.adam import DEFAULTS as ADAM_DEFAULTS
from onnx_training_ops.optim.adam import adam, adam_rate
from onnx_training_ops.optim.momentum import momentum, momentum_beta

RTOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}
SETTINGS = settings(max_examples=30, deadline=None)

dtypes = st.sampled_from([np.float32, np.float64])
shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)  # () .. rank 4
# Sizes straddling the serial/parallel switch.
big_shapes = st.integers(min(fused.PARALLEL_THRESHOLDS.values()) - 2,
                         2 * max(fused.PARALLEL_THRESHOLDS.values())).flatmap(
    lambda n: st.sampled_from([(n,), (1, n), (n, 1, 1)])
)
counts = st.one_of(st.just(0), st.integers(1, 1000))  # T == 0 (no bias correction / first momentum step) and T > 0
seeds = st.integers(0, 2**32 - 1)
open_unit = st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)
epsilons = st.floats(1e-10, 1e-1)
norms = st.one_of(st.just(0.0), st.floats(1e-6, 0.5))
rates = st.floats(1e-6, 1.0)


def tensors(seed, shape, dtype, k):
    """k arrays: X, G, V ~ N(0, 1)-ish with some exact zeros; the last (H, if k == 4 or
    Adagrad) non-negative as an accumulator of squares is."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        a = np.asarray(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 2), dtype=dtype)
        a[rng.random(shape) < 0.05] = 0
        out.append(a)
    return out


def exact(r, dtype):
    """R as the reference reads it from a tensor of ``dtype``."""
    return float(np.array(r, dtype))


def close(actual, expected):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=RTOL[a.dtype], atol=0)
        # Same operation order, same dtype, no FMA contraction: in fact bit for bit.
        np.testing.assert_array_equal(a, e)


def run_adam(seed, shape, dtype, t, alpha, beta, epsilon, nc, nc_post, r=0.01):
    x, g, v, h = tensors(seed, shape, dtype, 4)
    np.abs(h, out=h)
    attrs = dict(alpha=alpha, beta=beta, epsilon=epsilon, norm_coefficient=nc, norm_coefficient_post=nc_post)
    expected = adam(np.array(r, dtype), np.array(t, np.int64), x, g, v, h, **attrs)
    g0 = g.copy()
    assert fused.supports(x, g, v, h)
    fused.adam_(x, g, v, h, adam_rate(exact(r, dtype), t, alpha, beta), alpha, beta, epsilon, nc, nc_post)
    close((x, v, h), expected)
    np.testing.assert_array_equal(g, g0)


def run_momentum(seed, shape, dtype, t, alpha, beta, nc, nesterov, r=0.01):
    x, g, v = tensors(seed, shape, dtype, 3)
    mode = "nesterov" if nesterov else "standard"
    expected = momentum(
        np.array(r, dtype), np.array(t, np.int64), x, g, v, alpha=alpha, beta=beta, mode=mode, norm_coefficient=nc
    )
    g0 = g.copy()
    assert fused.supports(x, g, v)
    fused.momentum_(x, g, v, exact(r, dtype), alpha, momentum_beta(t, beta), nc, nesterov)
    close((x, v), expected)
    np.testing.assert_array_equal(g, g0)


def run_adagrad(seed, shape, dtype, t, decay, epsilon, nc, r=0.01):
    x, g, h = tensors(seed, shape, dtype, 3)
    np.abs(h, out=h)
    expected = adagrad(
        np.array(r, dtype), np.array(t, np.int64), x, g, h, decay_factor=decay, epsilon=epsilon, norm_coefficient=nc
    )
    g0 = g.copy()
    assert fused.supports(x, g, h)
    fused.adagrad_(x, g, h, adagrad_rate(exact(r, dtype), t, decay), epsilon, nc)
    close((x, h), expected)
    np.testing.assert_array_equal(g, g0)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    assert fused.warm_up() >= 0.0


@SETTINGS
@given(seeds, shapes, dtypes, counts, open_unit, open_unit, epsilons, norms, norms, rates)
def test_adam_matches_reference(seed, shape, dtype, t, alpha, beta, epsilon, nc, nc_post, r):
    run_adam(seed, shape, dtype, t, alpha, beta, epsilon, nc, nc_post, r)


@SETTINGS
@given(seeds, shapes, dtypes, counts, open_unit, open_unit, norms, st.booleans(), rates)
def test_momentum_matches_reference(seed, shape, dtype, t, alpha, beta, nc, nesterov, r):
    run_momentum(seed, shape, dtype, t, alpha, beta, nc, nesterov, r)


@SETTINGS
@given(seeds, shapes, dtypes, counts, st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), epsilons, norms, rates)
def test_adagrad_matches_reference(seed, shape, dtype, t, decay, epsilon, nc, r):
    run_adagrad(seed, shape, dtype, t, decay, epsilon, nc, r)


@settings(max_examples=10, deadline=None)
@given(seeds, big_shapes, dtypes, counts, open_unit, open_unit, norms, st.booleans())
def test_parallel_sizes_match_reference(seed, shape, dtype, t, alpha, beta, nc, nesterov):
    run_adam(seed, shape, dtype, t, alpha, beta, 1e-6, nc, nc)
    run_momentum(seed, shape, dtype, t, alpha, beta, nc, nesterov)
    run_adagrad(seed, shape, dtype, t, 1 - beta, 1e-6, nc)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["adam", "momentum", "adagrad"])
def test_both_sides_of_the_parallel_switch(op, dtype):
    for n in (fused.PARALLEL_THRESHOLDS[op] - 1, fused.PARALLEL_THRESHOLDS[op]):
        if op == "adam":
            run_adam(n, (n,), dtype, 3, 0.9, 0.999, 1e-6, 0.01, 0.01)
        elif op == "momentum":
            run_momentum(n, (n,), dtype, 3, 0.9, 0.9, 0.01, False)
            run_momentum(n, (n,), dtype, 3, 0.9, 0.9, 0.01, True)
        else:
            run_adagrad(n, (n,), dtype, 3, 0.1, 1e-6, 0.01)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 7, fused.PARALLEL_THRESHOLDS["adam"] - 1, fused.PARALLEL_THRESHOLDS["adam"] + 5])
def test_adam_with_the_decay_folded_in_equals_multiply_then_adam(dtype, n):
    # AdamW's fast path: X *= decay inside the kernel's pass, bit for bit numpy's multiply then Adam
    rng = np.random.default_rng(n)
    x, g, v = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    h = rng.random(n).astype(dtype)
    decay = np.array(1 - 1e-2 * 0.1, dtype)
    ours = [a.copy() for a in (x, g, v, h)]
    ref = [a.copy() for a in (x, g, v, h)]
    run_decayed = fused.adam_prepared(*ours, 0.9, 0.999, 1e-8, 0.0, 0.0, decay=decay)
    run_plain = fused.adam_prepared(*ref, 0.9, 0.999, 1e-8, 0.0, 0.0)
    for step in range(4):
        decay[...] = 1 - 1e-2 * 0.1 * (step + 1)  # read at each run (a schedule moves it)
        run_decayed(0.01 * (step + 1))
        np.multiply(ref[0], decay, out=ref[0])
        run_plain(0.01 * (step + 1))
        for a, b in zip(ours, ref):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)])
def test_empty_tensors(dtype, shape):
    run_adam(0, shape, dtype, 1, 0.9, 0.999, 1e-6, 0.0, 0.0)
    run_momentum(0, shape, dtype, 1, 0.9, 0.5, 0.0, True)
    run_adagrad(0, shape, dtype, 1, 0.1, 1e-6, 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_epsilon_and_zero_state_follow_numpy(dtype):
    # 0/0 -> nan and x/0 -> inf as numpy, no ZeroDivisionError (error_model="numpy").
    x = np.array([1.0, 2.0], dtype)
    g = np.array([0.0, 1.0], dtype)
    with np.errstate(all="ignore"):
        expected = adagrad(np.array(0.1, dtype), np.array(0, np.int64), x, g, np.zeros(2, dtype), epsilon=0.0)
    h = np.zeros(2, dtype)
    fused.adagrad_(x, g, h, 0.1, 0.0, 0.0)
    np.testing.assert_array_equal(x, expected[0])
    np.testing.assert_array_equal(h, expected[1])
    assert np.isnan(x[0])


def test_steps_accumulate_like_reference():
    # Five Adam steps in place track five reference steps (state carried through).
    rng = np.random.default_rng(1)
    x, v, h = rng.standard_normal(50_000).astype(np.float32), np.zeros(50_000, np.float32), np.zeros(50_000, np.float32)
    rx, rv, rh = x.copy(), v.copy(), h.copy()
    r = np.float32(0.01)  # as a model holds it; the reference reads it exactly
    for t in range(5):
        g = rng.standard_normal(50_000).astype(np.float32)
        rx, rv, rh = adam(r, np.int64(t), rx, g, rv, rh, norm_coefficient=0.01)
        d = ADAM_DEFAULTS  # float32-exact alpha, beta, epsilon, as a model holds them
        rate = adam_rate(float(r), t, d["alpha"], d["beta"])
        fused.adam_(x, g, v, h, rate, d["alpha"], d["beta"], d["epsilon"], 0.01, 0.0)
    close((x, v, h), (rx, rv, rh))


class TestSupports:
    def arrays(self, k=4, shape=(3, 4), dtype=np.float32):
        return [np.ones(shape, dtype) for _ in range(k)]

    @pytest.mark.parametrize("dtype", [np.float32, np.float64])
    @pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 1, 3, 2)])
    def test_accepts_matching_contiguous(self, dtype, shape):
        assert fused.supports(*self.arrays(4, shape, dtype))
        assert fused.supports(*self.arrays(3, shape, dtype))

    def test_accepts_disjoint_views(self):
        buf = np.zeros(48, np.float32)
        assert fused.supports(*(buf[12 * i : 12 * (i + 1)].reshape(3, 4) for i in range(4)))

    def test_rejects_non_contiguous(self):
        a = self.arrays()
        assert not fused.supports(np.ones((3, 8), np.float32)[:, ::2], *a[1:])
        assert not fused.supports(a[0], np.asfortranarray(np.ones((3, 4), np.float32)), *a[2:])

    def test_rejects_mismatched_dtype(self):
        a = self.arrays()
        assert not fused.supports(a[0], a[1].astype(np.float64), *a[2:])
        assert not fused.supports(*(x.astype(np.float16) for x in a))
        assert not fused.supports(*(x.astype(np.int64) for x in a))

    def test_rejects_broadcasting_shapes(self):
        a = self.arrays()
        assert not fused.supports(a[0], np.ones((1, 4), np.float32), *a[2:])
        assert not fused.supports(a[0], a[1], np.ones((), np.float32), a[3])
        assert not fused.supports(np.ones((4, 3), np.float32), *a[1:])

    def test_rejects_read_only(self):
        a = self.arrays()
        a[2].flags.writeable = False
        assert not fused.supports(*a)

    def test_rejects_shared_memory(self):
        a = self.arrays()
        assert not fused.supports(a[0], a[0], *a[2:])
        buf = np.zeros(24, np.float32)
        assert not fused.supports(buf[:12].reshape(3, 4), a[1], buf[6:18].reshape(3, 4), a[3])

    def test_rejects_non_arrays(self):
        assert not fused.supports()
        assert not fused.supports([1.0], [2.0])
        assert not fused.supports(np.float32(1.0), np.float32(2.0))


_CACHE_PROBE = """
import json, sys
import numba.core.caching as caching

def read_only(self):  # the package directory of a non-editable, read-only install
    raise PermissionError("read-only site-packages")

in_tree = getattr(caching, "InTreeCacheLocator", None) or caching._InTreeCacheLocator  # numba >= 0.59 / older
in_tree.ensure_cache_path = read_only
import numpy as np
from onnx_training_ops.kernels import _numba_kernels as K
for dtype in (np.float32, np.float64):  # one loop, both dtypes: compiling all 18 takes a minute (warm_up's test)
    K.momentum_serial(*[np.zeros(1, dtype) for _ in range(3)], np.zeros(8, dtype))
f = K.momentum_serial
json.dump({f.py_func.__name__: [sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values())]}, sys.stdout)
"""


def test_cache_falls_back_to_user_dir_and_is_reused(tmp_path):
    """Package directory not writable -> numba's user-wide cache dir; a second process
    loads every specialization from it instead of compiling."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)

    def probe():
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = probe()
    assert all(misses == 2 and hits == 0 for hits, misses in cold.values()), cold  # float32 + float64 each
    assert len(list(tmp_path.glob("numba/**/*.nbi"))) == len(cold) == 1
    warm = probe()
    assert all(hits == 2 and misses == 0 for hits, misses in warm.values()), warm


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_dispatch_keeps_results(adaptive, monkeypatch):
    """Many steps above the threshold (serial/parallel chosen and probed by cost, or
    always parallel) give exactly the reference trajectory."""
    monkeypatch.setattr(fused, "ADAPTIVE", adaptive)
    monkeypatch.setattr(fused, "_CHOICES", {})
    n = fused.PARALLEL_THRESHOLDS["adagrad"] + 7
    rng = np.random.default_rng(3)
    x, h = rng.standard_normal(n), np.zeros(n)
    rx, rh = x.copy(), h.copy()
    for t in range(40):
        g = rng.standard_normal(n)
        rx, rh = adagrad(np.float64(0.1), np.int64(t), rx, g, rh, decay_factor=0.01, epsilon=1e-6,
                         norm_coefficient=0.001)
        fused.adagrad_(x, g, h, adagrad_rate(0.1, t, 0.01), 1e-6, 0.001)
    close((x, h), (rx, rh))
    if adaptive:
        (choice,) = fused._CHOICES.values()
        assert all(0 < cost < 1 for cost in choice.cost)  # both variants were measured


def test_a_pick_made_under_load_is_revisited_within_a_quarter_second(monkeypatch):
    """At 1e7 elements serial takes 6.35 ms and parallel 4.5 ms, but while the other core is
    busy parallel takes 12 ms: the dispatcher picks serial then; once the load is gone it
    must return to parallel within ~0.25 s of kernel time (it used to back off to 1024
    calls, 582 of 600 calls of one trace ran serial)."""
    clock = [0.0]
    monkeypatch.setattr(fused.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(fused, "ADAPTIVE", True)
    monkeypatch.setattr(fused, "_CHOICES", {})
    loaded_until, calls = 300, [0]
    ran = []

    def serial():
        clock[0] += 6.35e-3
        ran.append(0)

    def parallel():
        clock[0] += 12e-3 if calls[0] < loaded_until else 4.5e-3
        ran.append(1)

    n = 10_000_000
    for i in range(900):
        calls[0] = i
        fused._dispatch("adam", serial, parallel, n)
    assert ran[loaded_until - 20:loaded_until].count(0) >= 15  # serial while parallel was slow
    back = next(i for i in range(loaded_until, len(ran)) if ran[i:i + 20].count(1) == 20)
    assert (back - loaded_until) * 6.35e-3 < 0.4  # parallel again within ~0.25 s (+ a probe)
    assert ran[back:].count(1) / len(ran[back:]) > 0.9
