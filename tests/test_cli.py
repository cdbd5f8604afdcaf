"""The command line: prepare and conformance, through a real subprocess."""

import subprocess
import sys

import onnx
import pytest
from model_factory import optimizer_model

import onnx_training_ops as ot


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "onnx_training_ops", *args], capture_output=True, text=True,
                          timeout=300)


def test_prepare_writes_a_prepared_model(tmp_path):
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(optimizer_model("Adam", n=2), source)
    result = run_cli("prepare", str(source), str(target))
    assert result.returncode == 0, result.stderr
    assert onnx.load(target) == ot.prepare(source)


def test_prepare_portable_writes_a_model_of_standard_ops_only(tmp_path):
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(optimizer_model("Adam", n=2), source)
    result = run_cli("prepare", "--portable", str(source), str(target))
    assert result.returncode == 0, result.stderr
    assert "portable" in result.stdout
    written = onnx.load(target)
    assert written == ot.prepare(source, portable=True)
    assert {n.domain for n in written.graph.node} <= {"", "ai.onnx"}


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


def test_cli_exit_codes_and_clear_errors(tmp_path, capsys):
    from onnx_training_ops.cli import main
    assert main(["prepare", str(tmp_path / "missing.onnx"), str(tmp_path / "o.onnx")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "text.onnx").write_text("not a model")
    assert main(["prepare", str(tmp_path / "text.onnx"), str(tmp_path / "o.onnx")]) == 2
    assert "not an ONNX model" in capsys.readouterr().err
    model = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "models" /
                "linear_regression_adam.onnx")
    assert main(["prepare", model, str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    for bad in (["train", "--epochs", "0"], ["demo", "--batch-size", "-1"]):
        with pytest.raises(SystemExit) as info:
            main(bad)
        assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and "onnx-training-ops" in capsys.readouterr().out


def test_train_below_min_accuracy_says_so(tmp_path, capsys):
    pytest.importorskip("sklearn")
    from onnx_training_ops.cli import main
    code = main(["train", "--out", str(tmp_path), "--epochs", "1", "--no-progress",
                 "--min-accuracy", "1.01"])
    assert code == 1 and "below --min-accuracy" in capsys.readouterr().err


def test_missing_extra_is_a_one_line_hint(monkeypatch, capsys, tmp_path):
    import importlib.util

    from onnx_training_ops.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("sklearn", "torch") else real(name, *a))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: this command needs 'sklearn': pip install 'onnx-training-ops[demo]'"]


def test_the_benchmarks_are_not_a_command_of_the_package(capsys):
    """They live in the checkout's benchmarks/ (``python -m benchmarks``), not in the installed package."""
    from onnx_training_ops.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--quick"])
    assert exit_.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err
