"""Write the browser example's model: the digits MLP, pre-trained briefly in Python, exported.

    python examples/browser/export_model.py examples/browser/model

trains a 64-32-10 MLP on scikit-learn's 8x8 digits (they ship inside scikit-learn: no
download) for 30 Adam steps under a warm-up + cosine schedule, then writes
``export_step(session, OUT)`` — a checkpoint taken mid-run, schedule position included, with
the WebGPU step (batches of 32; its eval model takes the whole held-out set) — and
the digits as ``data.safetensors`` (train_x, train_y, test_x, test_y) for the page to
fine-tune on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import onnx_training_ops as ot
from onnx_training_ops import schedules
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.export import export_step
from onnx_training_ops.storage import safetensors

PRETRAIN_STEPS = 30
BROWSER_STEPS = 300


def write_example(out_dir: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    model = ot.build_training_model(make_mlp((64, 32, 10)), "cross_entropy", ot.Adam(lr=1e-2))
    session = ot.TrainingSession(model)
    session.set_lr_schedule(schedules.WarmupCosineLR(warmup_steps=10, total_steps=PRETRAIN_STEPS + BROWSER_STEPS))
    for i in range(PRETRAIN_STEPS):
        start = i * 32 % 1400
        session.step({"input": x[start:start + 32], "labels": y[start:start + 32]})
    out_dir = Path(out_dir)
    export_step(session, out_dir, packed=True, target="webgpu", input_shapes={"input": [32, 64], "labels": [32]},
                eval_input_shapes={"input": [len(x) - 1400, 64], "labels": [len(x) - 1400]})
    (out_dir / "data.safetensors").write_bytes(safetensors.encode(
        {"train_x": x[:1400], "train_y": y[:1400], "test_x": x[1400:], "test_y": y[1400:]}))
    return out_dir


if __name__ == "__main__":
    print(write_example(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "model")))
