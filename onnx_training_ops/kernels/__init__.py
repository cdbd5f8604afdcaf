"""Numpy reference kernels of the training domain's optimizers: the oracle every faster path is tested against.

``adam(r, t, *tensors, **attributes)`` (likewise ``momentum``, ``adagrad``) take the op's
inputs in the op's order and return its outputs in the op's order.
"""

from .adagrad import adagrad
from .adam import adam
from .momentum import momentum

REFERENCE_KERNELS = {"Adam": adam, "Momentum": momentum, "Adagrad": adagrad}

__all__ = ["adam", "momentum", "adagrad", "REFERENCE_KERNELS"]
