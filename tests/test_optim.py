"""The optimizers package: one registry, a contract every description meets, and the scalar
preparation compiled for the native kernels equal to the Python one."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from onnx_training_ops.optim import adagrad, adam, momentum, registry
from onnx_training_ops.optim.base import Optimizer


def test_every_registered_description_meets_the_contract():
    for name, cls in registry.OPTIMIZER_CLASSES.items():
        opt = cls()
        assert isinstance(opt, Optimizer), name
        assert isinstance(opt.op_type, str) and isinstance(opt.t_offset, int)
        assert all(isinstance(opt.initial_value(s), float) for s in opt.states)
        assert isinstance(opt.decoupled_weight_decay, float)
        assert isinstance(opt.attributes(), dict)
        # a domain op or a standard-op update: exactly one of the two
        assert bool(opt.op_type) != (cls in registry.STANDARD_OP_UPDATES), name
        assert registry.from_json(registry.to_json(opt)) == opt


def test_each_domain_op_has_a_lowering_and_a_reference():
    from onnx_training_ops.kernels import REFERENCE_KERNELS
    from onnx_training_ops.schema import OPTIMIZERS

    assert set(registry.LOWERINGS) == set(OPTIMIZERS) == set(REFERENCE_KERNELS)


_FRESH = """
import json, sys
from onnx_training_ops.optim.registry import OPTIMIZER_CLASSES, from_json
from onnx_training_ops.builder.emit_update import STANDARD_OP_UPDATES
before = (sorted(OPTIMIZER_CLASSES), sorted(c.__name__ for c in STANDARD_OP_UPDATES))
out = [type(from_json(t)).__name__ for t in json.loads(sys.argv[1])]
import onnx_training_ops.optim.ort_adamw, onnx_training_ops.optim.rmsprop  # noqa: E401
after = (sorted(OPTIMIZER_CLASSES), sorted(c.__name__ for c in STANDARD_OP_UPDATES))
print(json.dumps([out, before == after]))
"""


def test_from_json_reads_every_optimizer_whatever_was_imported():
    """No optimizer registers itself on import: a process that imported only the builder's
    optimizers reads OrtAdamW and RMSProp back, and importing their modules adds nothing."""
    texts = [registry.to_json(cls()) for cls in registry.OPTIMIZER_CLASSES.values()]
    done = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(texts)], capture_output=True,
                          text=True, check=True)
    names, unchanged = json.loads(done.stdout.strip().splitlines()[-1])
    assert names == list(registry.OPTIMIZER_CLASSES) and unchanged


@njit(cache=False)
def _adam_jit(r, t, a, b, e, n, p):
    return adam.step_scalars(r, t, a, b, e, n, p)


@njit(cache=False)
def _momentum_jit(r, t, a, b, n):
    return momentum.step_scalars(r, t, a, b, n)


@njit(cache=False)
def _adagrad_jit(r, t, d, e, n):
    return adagrad.step_scalars(r, t, d, e, n)


@pytest.mark.parametrize("t", [0, 1, 2, 7, 1000, 123456])
def test_scalars_compiled_for_the_native_kernels_equal_the_python_ones(t):
    """The native kernels compile each optimizer's ``step_scalars``; the reference and the
    fused kernels call it as Python: the same float64 bits (Adam's pow, Adagrad's decay)."""
    rng = np.random.default_rng(t)
    r, a, b, e, n, p = (float(np.float32(v)) for v in rng.uniform(0.01, 0.999, 6))
    for python, compiled in (
        (adam.step_scalars(r, t, a, b, e, n, p), _adam_jit(r, t, a, b, e, n, p)),
        (momentum.step_scalars(r, t, a, b, n), _momentum_jit(r, t, a, b, n)),
        (adagrad.step_scalars(r, t, a, e, n), _adagrad_jit(r, t, a, e, n)),
    ):
        assert type(compiled) is type(python)
        assert np.array(python).tobytes() == np.array(compiled).tobytes()
    assert adam.step_scalars(r, t, a, b, e, n, p).rate == adam.adam_rate(r, t, a, b)


def test_adam_rate_keeps_pythons_power():
    """adam_rate uses math.pow so that numba compiles the same call: the bits of the former
    ``beta**t`` (both are C's pow)."""
    for t in (1, 3, 10, 10_000):
        for alpha, beta in ((0.9, 0.999), (0.5, 0.25), (float(np.float32(0.9)), float(np.float32(0.999)))):
            assert adam.adam_rate(1e-3, t, alpha, beta) == 1e-3 * math.sqrt(1.0 - beta**t) / (1.0 - alpha**t)


_CACHE_STAMP = """
import json, pathlib, sys
import numpy as np
if sys.argv[1] == "edited":  # optim/adagrad.py as if edited since the cache was written
    read = pathlib.Path.read_bytes
    pathlib.Path.read_bytes = lambda p: read(p) + (b"#" if p.name == "adagrad.py" else b"")
from onnx_training_ops.kernels import _numba_kernels as K
x, g, h = (np.ones(3, np.float32) for _ in range(3))
K.adagrad_serial(x, g, h, np.array(K._adagrad.AdagradScalars(0.1, 1e-6, 0.0), np.float32))
stats = K.adagrad_serial.stats
print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


def test_kernel_caches_are_stale_when_an_inlined_source_changes(tmp_path):
    """numba keys a cache by the function's own file; the loops inline elements from optim/:
    their caches are keyed by those sources too, so an edited element recompiles them."""
    import os

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def run(mode):
        done = subprocess.run([sys.executable, "-c", _CACHE_STAMP, mode], env=env, capture_output=True,
                              text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run("same") == [0, 1]  # compiled
    assert run("same") == [1, 0]  # loaded
    assert run("edited") == [0, 1]  # the stamp changed: compiled again
