"""The committed onnxruntime-training fixtures (tests/fixtures/ortt, made by its make_fixtures.py)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

ORTT = Path(__file__).parent / "fixtures" / "ortt"
CASES = ("mlp", "bert", "mlp_wd", "mlp_torch")


@cache
def trajectory(case: str) -> dict[str, np.ndarray]:
    with np.load(ORTT / case / "trajectory.npz") as data:
        return {k: data[k] for k in data.files}


def batch(case: str, step: int) -> list[np.ndarray]:
    """The inputs of step ``step`` in the order the model takes them (labels last)."""
    t = trajectory(case)
    return [t[f"batch/{step}/{j}"] for j in range(3 if case == "bert" else 2)]


def params(case: str, step: int, trainable_only: bool = True) -> dict[str, np.ndarray]:
    """onnxruntime-training's parameters after ``step`` updates."""
    t = trajectory(case)
    names = list(t["trainable"]) + ([] if trainable_only else list(t["frozen"]))
    return {str(n): t[f"p/{n}"][step] for n in names}


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    """``|ours - theirs| / |theirs|`` (Euclidean norms over the tensor)."""
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))
