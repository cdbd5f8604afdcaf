"""onnxruntime-training's AdamW in standard ONNX ops: now in :mod:`onnx_training_ops.optim.ort_adamw`
(registered in :mod:`onnx_training_ops.optim.registry`); kept for old imports."""

from ..optim.ort_adamw import OrtAdamW, emit_update

__all__ = ["OrtAdamW", "emit_update"]
