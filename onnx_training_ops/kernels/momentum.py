"""Momentum's reference kernel: now in :mod:`onnx_training_ops.optim.momentum` (with its other forms)."""

from ..optim.momentum import MODES, NAMES, check_mode, momentum, momentum_beta, momentum_update

__all__ = ["MODES", "NAMES", "check_mode", "momentum", "momentum_beta", "momentum_update"]
