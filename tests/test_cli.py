"""The command line: prepare and conformance, through a real subprocess."""

import subprocess
import sys

import onnx
from model_factory import optimizer_model

import onnx_training_ops as ot


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "onnx_training_ops", *args], capture_output=True, text=True, timeout=300)


def test_prepare_writes_a_prepared_model(tmp_path):
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(optimizer_model("Adam", n=2), source)
    result = run_cli("prepare", str(source), str(target))
    assert result.returncode == 0, result.stderr
    assert onnx.load(target) == ot.prepare(source)


def test_prepare_reports_invalid_models_without_a_traceback(tmp_path):
    source = tmp_path / "bad.onnx"
    model = optimizer_model("Momentum", attributes=dict(alpha=0.9, beta=0.1, mode="fast", norm_coefficient=0.0))
    onnx.save(model, source)
    result = run_cli("prepare", str(source), str(tmp_path / "out.onnx"))
    assert result.returncode == 2
    assert "Momentum node 'opt'" in result.stderr and "'fast'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_conformance_prints_a_table_and_exits_zero():
    result = run_cli("conformance")
    assert "test_adam_multiple" in result.stdout and "test_nesterov_momentum" in result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
