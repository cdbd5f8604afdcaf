"""The model and batches shared by the data-parallel tests and their worker processes."""

from __future__ import annotations

import numpy as np

from onnx_training_ops import Adam, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.schedules import StepLR

SIZES, BATCH = (8, 16, 4), 16


def training_model(dtype=np.float64, clip: bool = True):
    """An MLP with Adam, gradient clipping (unless ``clip`` is false) and a StepLR schedule."""
    from onnx_training_ops import TrainingSession

    model = build_training_model(make_mlp(SIZES, activation="Tanh", dtype=dtype, seed=3), "cross_entropy",
                                 Adam(lr=1e-2), clip_grad_norm=1.0 if clip else None)
    session = TrainingSession(model)
    session.set_lr_schedule(StepLR(step_size=5, gamma=0.5))
    return session.training_model()


def batch(k: int, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Global batch number ``k``."""
    rng = np.random.default_rng(1000 + k)
    return rng.standard_normal((BATCH, SIZES[0])).astype(dtype), rng.integers(0, SIZES[-1], BATCH).astype(np.int64)


def batchnorm_training_model():
    """Linear -> BatchNorm1d -> Tanh -> Linear from torch (float32), mode="train": BatchNorm
    running statistics are per-rank state (buffers)."""
    import io
    import warnings

    import onnx
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.BatchNorm1d(SIZES[1]),
                                 torch.nn.Tanh(), torch.nn.Linear(SIZES[1], SIZES[2]))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.zeros(BATCH, SIZES[0]),), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "N"}})
    return build_training_model(onnx.load_from_string(f.getvalue()), "cross_entropy", Adam(lr=1e-2), mode="train")
