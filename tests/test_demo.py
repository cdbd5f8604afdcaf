"""The demo, quick: few epochs on digits; files written; CLI wiring."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from onnx_training_ops import TrainingSession  # noqa: E402
from onnx_training_ops.cli import main  # noqa: E402
from onnx_training_ops.demo import load_digits_split, train  # noqa: E402


def test_quick_demo(tmp_path, capsys):
    result = train(out_dir=str(tmp_path), epochs=4, progress=False)
    assert result.accuracy >= 0.9
    assert result.losses[-1] < result.losses[0]
    png = tmp_path / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and str(tmp_path) in out
    # the exported inference model: plain onnxruntime, same accuracy
    _, _, x_test, y_test = load_digits_split(0)
    plain = ort.InferenceSession(str(tmp_path / "inference_model.onnx"), providers=["CPUExecutionProvider"])
    accuracy = float(np.mean(np.argmax(plain.run(None, {"input": x_test})[0], axis=1) == y_test))
    assert accuracy == pytest.approx(result.accuracy)
    # the checkpoint resumes
    checkpoint = onnx.load(tmp_path / "training_model.onnx")
    assert len(checkpoint.training_info) == 1
    session = TrainingSession(tmp_path / "training_model.onnx")
    assert int(session.state_dict()["optimizer.T"]) == result.steps
    # the summary the CLI promises, with the held-out curve the plot shows (issue 20 items 14, 16)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["accuracy"] == result.accuracy and summary["steps"] == result.steps
    assert len(summary["held_out_losses_per_epoch"]) == 4 == len(result.held_out_losses)
    assert summary["held_out_losses_per_epoch"][-1] < summary["held_out_losses_per_epoch"][0]


@pytest.mark.parametrize("optimizer", ["momentum", "adagrad"])
def test_cli_train(tmp_path, optimizer, capsys):
    code = main(["train", "--out", str(tmp_path), "--epochs", "2", "--optimizer", optimizer, "--no-progress",
                 "--min-accuracy", "0.8"])
    assert code == 0
    assert (tmp_path / "loss_curve.png").exists()
    assert (tmp_path / "training_model.onnx").exists() and (tmp_path / "inference_model.onnx").exists()
    assert "held-out accuracy" in capsys.readouterr().out
