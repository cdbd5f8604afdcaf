"""Mixed precision on the session side: which providers can run a 16-bit model, and the loss
scale's state (``build_training_model(..., precision=...)``, :mod:`...passes.mixed_precision`,
:mod:`...builder.loss_scaling`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...passes.mixed_precision import CPU

BF16_HINT = (
    "bfloat16 needs an execution provider with bfloat16 kernels (CUDAExecutionProvider: "
    "TrainingSession(model, device='cuda'), or an exported step in DeviceTrainer(directory, "
    "providers=['CUDAExecutionProvider', 'CPUExecutionProvider'])); onnxruntime's CPU EP has none "
    "(MatMul, Gemm, Add, Mul, Softmax: NOT_IMPLEMENTED). fp16 runs on the CPU: build with precision='fp16'"
)


def check_precision(meta: TrainingMetadata, providers: Sequence[str], where: str = "TrainingSession") -> None:
    """Raise a clear :class:`TrainingOpError` for a bf16 model on the CPU EP alone (onnxruntime's
    would be NOT_IMPLEMENTED at session creation). An fp16 model runs there: onnxruntime
    computes its float16 nodes in float32 (:data:`~...passes.mixed_precision.KERNELS_16BIT`).

    Args:
        meta: the builder's metadata (``precision``).
        providers: the provider names the session runs on, in order.
        where: who asks, for the message.

    Raises:
        TrainingOpError: a bf16 model on the CPU EP alone.
    """
    precision = meta.precision
    if precision == "bf16" and all(p == CPU for p in providers):
        raise TrainingOpError(f"{where}: the model is built with precision='bf16' and would run on "
                              f"{CPU}: {BF16_HINT}")


def loss_scaling_names(meta: TrainingMetadata) -> dict[str, str] | None:
    """The loss scale's state variables (``scale``, ``growth_tracker``, ``skipped_steps``), or
    None for a model without loss scaling."""
    record = meta.loss_scaling
    if not record:
        return None
    return {k: record[k] for k in ("scale", "growth_tracker", "skipped_steps")}


def loss_scale(meta: TrainingMetadata, state: Mapping[str, np.ndarray]) -> float | None:
    """The current loss scale (float32), or None without loss scaling."""
    names = loss_scaling_names(meta)
    return None if names is None else float(state[names["scale"]])


def overflow_steps(meta: TrainingMetadata, state: Mapping[str, np.ndarray]) -> int:
    """Steps the loss scaling skipped for a non-finite gradient (0 without loss scaling)."""
    names = loss_scaling_names(meta)
    return 0 if names is None else int(state[names["skipped_steps"]])
