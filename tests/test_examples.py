"""The examples run and do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_torch_export(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    result = _load("finetune_torch_export").main(str(tmp_path), epochs=4)
    assert result["after"] > result["before"] + 0.2
    assert result["after"] >= 0.85
    assert result["exported_check"] == pytest.approx(result["after"])


def test_from_graph(tmp_path):
    result = _load("from_graph").main(steps=120, out_dir=str(tmp_path))
    assert result["accuracy"] > 0.95
    assert Path(result["path"]).exists()
    from onnx_training_ops import TrainingSession

    resumed = TrainingSession(result["path"])
    assert int(resumed.state_dict()["T"]) == 120


def test_finetune_transformer(tmp_path):
    pytest.importorskip("transformers")
    result = _load("finetune_transformer").main(str(tmp_path), steps=120)
    assert result["last"] < result["first"] - 1.0  # from ~log(82) toward the text's entropy
    assert Path(result["plot"]).exists()
    assert result["sample"].startswith("Beautiful is")


def test_train_loop(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    history = _load("train_loop").main(str(tmp_path), epochs=4)
    assert history["accuracy"] >= 0.9
    assert history["val"][-1] < history["val"][0] / 3
    assert history["resumed_at"] == 2 and len(history["train"]) == 4
    assert Path(history["plot"]).exists()
    from onnx_training_ops import TrainingSession

    final = TrainingSession(history["checkpoint"])
    assert final.properties["epoch"] == 4
    assert final.lr_schedule_step == final.lr_schedule.total_steps


def test_recommender():
    pytest.importorskip("tqdm")
    result = _load("recommender").main(users=1500, items=600, dim=16, epochs=4, k=20)
    for mode in ("dense", "lazy"):  # both learn the synthetic tastes (untrained: ~k/items)
        assert result[mode] > result["untrained"] + 0.15, result
