"""Adam's reference kernel: now in :mod:`onnx_training_ops.optim.adam` (with its other forms)."""

from ..optim.adam import DEFAULTS, NAMES, adam, adam_rate, adam_update

__all__ = ["DEFAULTS", "NAMES", "adam", "adam_rate", "adam_update"]
