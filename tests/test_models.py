"""The sample training models in models/: rebuilt by their script, each trains through TrainingSession."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_training_ops import TrainingSession

MODELS = Path(__file__).resolve().parents[1] / "models"
sys.path.insert(0, str(MODELS))
import build_models  # noqa: E402


def _feeds(name: str, rng):
    if name.startswith("linear_regression"):
        x = rng.standard_normal((16, 3)).astype(np.float32)
        return {"x": x, "target": (x @ np.array([[1, -1], [2, 0], [0, 3]], np.float32) + 1).astype(np.float32)}
    x = rng.standard_normal((16, 4)).astype(np.float32)
    return {"input": x, "labels": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)}


@pytest.mark.parametrize("name", sorted(build_models.MODELS))
def test_sample_model_trains(name):
    path = MODELS / name
    assert path.exists(), f"run python models/build_models.py ({name} is missing)"
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert len(model.training_info) == 1
    session = TrainingSession(path)
    assert session.fast_path_nodes  # the optimizer runs in place
    rng = np.random.default_rng(0)
    feeds = _feeds(name, rng)
    first = float(session.step(feeds)["loss"])
    for _ in range(30):
        last = float(session.step(feeds)["loss"])
    assert last < first


@pytest.mark.parametrize("name", sorted(build_models.MODELS))
def test_committed_model_matches_script(name, tmp_path):
    built = build_models.MODELS[name]()
    committed = onnx.load(MODELS / name)
    assert built.SerializeToString() == committed.SerializeToString(), f"rebuild {name}: python models/build_models.py"
