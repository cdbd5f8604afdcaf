"""First use never looks hung (issue 36, D.4): a session compiles only the kernels its model uses, and
a real compile says so on stderr before it starts (benchmarks/bench_first_run.py measures the README's
examples cold and warm; tests/test_native.py checks which native kernels a fresh process loads)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from onnx_training_ops.kernels import _ort_api, compile_notice, fused

ROOT = Path(__file__).resolve().parents[1]


def test_a_native_kernel_compiled_on_first_use_is_announced_once(monkeypatch, capsys):
    monkeypatch.setattr(compile_notice, "_announced", False)
    monkeypatch.setattr(_ort_api, "_OPTIONS", dict(_ort_api._OPTIONS, cache=False))  # a real compile
    first = _ort_api.LazyCFunc(_ort_api.kernel_destroy.signature, _ort_api._destroy_trampoline)
    second = _ort_api.LazyCFunc(_ort_api.kernel_compute.signature, _ort_api._compute_trampoline)
    assert first.compiled is None and first.address and second.address
    assert capsys.readouterr().err.count(compile_notice.MESSAGE) == 1


def test_a_training_session_loads_only_the_fused_loops_its_tensors_run():
    """A fresh process, an MLP of float32 tensors below the parallel threshold, one step: Adam's
    serial float32 loop is the only fused loop compiled or loaded (before: every specialization,
    serial and parallel, float32 and float64, rows, RMSProp, at session creation)."""
    code = """
import numpy as np
from onnx_training_ops import Adam, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.kernels import _numba_kernels as k, _numba_rmsprop as r, _numba_rows as w
session = TrainingSession(build_training_model(make_mlp((8, 16, 4)), "cross_entropy", Adam(lr=1e-2)))
rng = np.random.default_rng(0)
session.step({"input": rng.standard_normal((4, 8)).astype(np.float32), "labels": rng.integers(0, 4, 4)})
loops = [k.adam_serial, k.adam_parallel, k.adam_decay_serial, k.momentum_serial, k.adagrad_parallel,
         r.rmsprop_serial, w.adam_rows, w.dedup_rows]
print([len(f.signatures) for f in loops], [str(s[0].dtype) for s in k.adam_serial.signatures])
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[1, 0, 0, 0, 0, 0, 0, 0] ['float32']", done.stdout


def test_a_tensor_past_the_parallel_threshold_prepares_both_loops(monkeypatch):
    monkeypatch.setattr(fused, "_READY", set())
    x, g, v = (np.zeros(fused.PARALLEL_THRESHOLDS["momentum"], np.float64) for _ in range(3))
    fused.momentum_prepared(x, g, v, 0.9, 0.0, nesterov=False)
    assert fused._READY == {(fused._k.momentum_serial, np.dtype(np.float64), True)}
