"""Adagrad's reference kernel: now in :mod:`onnx_training_ops.optim.adagrad` (with its other forms)."""

from ..optim.adagrad import DEFAULTS, NAMES, adagrad, adagrad_rate, adagrad_update

__all__ = ["DEFAULTS", "NAMES", "adagrad", "adagrad_rate", "adagrad_update"]
